"""Packed token batches from text shards: rows whose order follows from the manifests, each replica reading only the
shards of its own rows, resumable exactly on any number of replicas.

The order of the rows is ``pretrain.data.rows``' (read it first): a function of (seed, epoch, the shards' token
counts, seq_len, lanes) and, in a mixture, the weights; never of the number of replicas, workers or the batch size.

Rows and batches. A row holds ``seq_len + 1`` tokens of one shard: its first L are ``input_ids``, its last L
``labels``; ``position_ids`` count from 0 at every document start and at every row start. Replica r of R builds, from
where the iteration started, batch k of the rows ``share`` gives it (round k's rows ≡ r mod R), so R replicas × A
micro-batches read the same rows as 1 replica × R·A (the elastic resume of docs/CONTRACTS.md). DataLoader worker w
of W builds, of every batch, the rows of its own lanes (``_Rows.part``), and the trainer's process puts each
batch's W parts together: a worker reads only its lanes' shards, and keeps one packed shard per lane in memory.

The cursor is ``row``, the rows of the stream all replicas have consumed (with ``epoch``, the finished epochs there):
the same on every replica at a step's end, so a state resumes on any number of replicas and any ``batch_size``, and
the first batch after it reads only the shards of its rows (no replay). With ``epochs=N`` the stream ends after N
epochs' rows, and a last round they do not fill is dropped.

A shard that turns out corrupt (``ShardError``) stops the stream, or with ``skip_corrupt`` is logged, counted in
``skipped_shards`` and replaced: its rows come from the next readable shard of the epoch's order (cyclically), so
the layout the manifests give holds.

``PRETRAIN_SHARD_READ_LOG=DIR`` makes every loader process append the URL of each shard it reads to
``DIR/shard_reads.rank<RANK>.pid<PID>.txt`` (``RANK`` from the environment, 0 without): which shards a rank really
opened, to set beside what ``tools/bench_data.py`` predicts.
"""
import hashlib
import logging
import math
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from pretrain.data.rows import MixedRows, RowPlace, SourceRows, lane_sources, share
from pretrain.data.shards import ShardError, expand_shards, recorded_checksums
from pretrain.data.stream import Skips, StreamLoader, check_at_least, check_split
from pretrain.data.text_shards import check_tokenizer, iter_shard_tokens, shard_counts

log = logging.getLogger(__name__)
DATA_ORDER = 2  # the row order's version in a state; states without it packed one stream across shards
READ_LOG = "PRETRAIN_SHARD_READ_LOG"
MIX_BY = ("tokens", "documents")


class _Cursor(NamedTuple):
    epoch: int  # finished epochs at ``row`` (the fewest of any source in a mixture)
    row: int    # rows of the stream consumed by all replicas


class _Packed(NamedTuple):
    tokens: np.ndarray     # the shard's documents, in their (shuffled) order, concatenated
    positions: np.ndarray  # per token, its position in its document, at most seq_len (uint16 or uint32)


@dataclass(frozen=True)
class _Source:
    urls: tuple[str, ...]
    checksums: dict[str, str]  # sha256 of the local shards, from their manifests
    counts: tuple[tuple[int, int], ...]  # (tokens, documents) per shard, from their manifests


@dataclass(frozen=True)
class _Rows:
    """What every producer of batches knows: the sources, the order of rows, and the share to build."""
    sources: tuple[_Source, ...]
    order: MixedRows
    seq_len: int
    batch_size: int
    replica: int
    replicas: int
    seed: int
    shuffle: bool
    epochs: int | None
    skip_corrupt: bool
    tokenizer_sha256: str | None

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(url for source in self.sources for url in source.urls)

    @property
    def checksums(self) -> dict[str, str]:
        return {url: sha for source in self.sources for url, sha in source.checksums.items()}

    def epoch_shards(self, epoch: int) -> list[str]:
        """Every source's shards in the order epoch ``epoch`` walks them."""
        return [source.urls[i] for source, rows in zip(self.sources, self.order.sources)
                for i in rows.shard_order(epoch)[0]]

    def url(self, place: RowPlace) -> str:
        return self.sources[place.source].urls[place.shard]

    def part(self, start: int, batch: int, worker: int, num_workers: int) -> list[tuple[int, int]]:
        """(index in the batch, stream row) of the rows of this replica's batch ``batch`` from ``start`` that worker
        ``worker`` of ``num_workers`` builds: those of its lanes. The replica meets the lanes ≡ c (mod G), G =
        gcd(replicas, lanes); lane c + G·i is worker i mod num_workers's."""
        lanes = self.order.lanes
        spacing = math.gcd(self.replicas, lanes)
        rows = share(start, self.batch_size, self.replica, self.replicas, batch)
        return [(j, g) for j, g in enumerate(rows) if g % lanes // spacing % num_workers == worker]

    def batch_count(self, start: int) -> int | None:
        """Batches a replica builds from row ``start`` (None: forever)."""
        if self.epochs is None:
            return None
        return max(0, (self.order.sources[0].epoch_rows * self.epochs - start) // (self.batch_size * self.replicas))

    def batches(self, start: tuple, worker: int = 0, num_workers: int = 1) -> Iterator[tuple[tuple, tuple, int]]:
        """Per batch of the replica: (the part of it worker ``worker`` builds, cursor after its round, shards skipped
        so far); a part is (indices in the batch, and ``_assemble``'s inputs, labels, position ids of its rows)."""
        skips, lanes, corrupt = Skips(log=True), {}, set()  # each worker meets its own shards
        count, k, row = self.batch_count(start[1]), 0, start[1]
        while count is None or k < count:
            mine = self.part(row, k, worker, num_workers)
            rows = [self._row(self.order.place(g), lanes, corrupt, skips) for _, g in mine]
            after = row + (k + 1) * self.batch_size * self.replicas
            yield ([j for j, _ in mine], *_assemble(rows, self.seq_len)), (self.order.epoch(after), after), skips.count
            k += 1

    def _row(self, place: RowPlace, lanes: dict, corrupt: set, skips: Skips) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, positions in their documents) of one row; ``lanes`` holds the shard each lane read last."""
        key = place[:3]
        held = lanes.get((place.source, place.lane))
        if held is None or held[0] != key:
            held = next((entry for entry in lanes.values() if entry[0] == key), None)  # a shard two lanes share
            if held is None:
                held = (key, *self._readable(place, corrupt, skips))
            lanes[(place.source, place.lane)] = held
        _, packed, rows = held
        at = place.row % rows * self.seq_len
        return packed.tokens[at:at + self.seq_len + 1], packed.positions[at:at + self.seq_len]

    def _readable(self, place: RowPlace, corrupt: set, skips: Skips) -> tuple[_Packed, int]:
        """The packed shard of ``place`` and its rows; with ``skip_corrupt``, a corrupt one's stand-in."""
        layout, shard = self.order.sources[place.source], place.shard
        for _ in range(len(layout.tokens)):
            if (place.source, shard) not in corrupt and layout.shard_rows[shard] > 0:
                try:
                    return self._read(place.source, place.epoch, shard), int(layout.shard_rows[shard])
                except ShardError as err:
                    if not self.skip_corrupt:
                        raise
                    corrupt.add((place.source, shard))
                    skips.record(err)
            shard = layout.next_shard(place.epoch, shard)
        raise ShardError(f"no readable document in epoch {place.epoch} ({len(layout.tokens)} shards, "
                         f"{skips.count} skipped as corrupt)")

    def _read(self, source: int, epoch: int, shard: int) -> _Packed:
        url, tokens = self.sources[source].urls[shard], self.sources[source].counts[shard][0]
        _log_read(url)
        documents = list(iter_shard_tokens(url, self.sources[source].checksums.get(url), self.tokenizer_sha256))
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch, source, shard]).permutation(len(documents))
            documents = [documents[i] for i in order]
        flat = np.concatenate(documents) if documents else np.zeros(0, np.int64)
        if len(flat) != tokens:
            raise ShardError(f"shard {url} holds {len(flat)} tokens, but its manifest records {tokens}")
        lengths = np.fromiter(map(len, documents), np.int64, len(documents))
        positions = np.arange(len(flat), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        np.minimum(positions, self.seq_len, out=positions)
        return _Packed(flat, positions.astype(np.uint16 if self.seq_len < 1 << 16 else np.uint32))


def _log_read(url: str) -> None:
    directory = os.environ.get(READ_LOG)
    if directory:
        path = os.path.join(directory, f"shard_reads.rank{os.environ.get('RANK', '0')}.pid{os.getpid()}.txt")
        with open(path, "a") as f:
            f.write(url + "\n")


def _assemble(rows: list[tuple[np.ndarray, np.ndarray]], length: int) -> tuple[np.ndarray, ...]:
    """The rows' ``[n, L]`` inputs, labels and position ids, as numpy arrays: they pass between processes several
    times faster than torch tensors. A row's positions are its tokens' in their documents, but at most their offset
    in the row: a row start starts afresh."""
    inputs, labels, positions = (np.empty((len(rows), length), np.int64) for _ in range(3))
    offsets = np.arange(length)
    for i, (tokens, in_document) in enumerate(rows):
        inputs[i], labels[i] = tokens[:-1], tokens[1:]
        np.minimum(in_document, offsets, out=positions[i])
    return inputs, labels, positions


class TokenLoader(StreamLoader):
    """Iterates dicts of ``input_ids``, ``labels``, ``position_ids`` (``torch.long``, ``[batch_size, seq_len]``):
    replica ``rank``'s share of the rows that ``world_size`` replicas share."""

    def __init__(self, pattern: str, *, seq_len: int, batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, num_workers: int = 0, shuffle: bool = True, lanes: int = 64,
                 epochs: int | None = None, allow_pipe: bool = False, skip_corrupt: bool = False,
                 tokenizer_sha256: str | None = None):
        check_at_least(seq_len=(seq_len, 1), batch_size=(batch_size, 1), world_size=(world_size, 1),
                       num_workers=(num_workers, 0), lanes=(lanes, 1))
        check_split(rank, world_size, epochs)
        urls = expand_shards(pattern, allow_pipe=allow_pipe)
        if tokenizer_sha256 is not None:
            check_tokenizer(urls, tokenizer_sha256)
        super().__init__(num_workers)
        source = _Source(tuple(urls), recorded_checksums(urls), tuple(shard_counts(urls)))
        rows = SourceRows(tuple(tokens for tokens, _ in source.counts), seq_len, lanes, seed, shuffle)
        self._stream = _Rows((source,), MixedRows((rows,), (0,) * lanes), seq_len, batch_size, rank, world_size,
                             seed, shuffle, epochs, skip_corrupt, tokenizer_sha256)
        self._cursor = _Cursor(0, 0)

    def _parts_per_batch(self) -> int:
        """Each worker builds the rows of its own lanes of every batch."""
        return max(1, self.num_workers)

    def _merge(self, parts: tuple) -> tuple[tuple[np.ndarray, ...], tuple, int]:
        """The batch from its workers' parts (in process: the one part, the whole batch)."""
        skipped = sum(count for *_, count in parts)
        if len(parts) == 1:
            return parts[0][0][1:], parts[0][1], skipped
        s = self._stream
        batch = tuple(np.empty((s.batch_size, s.seq_len), np.int64) for _ in range(3))
        for (where, *arrays), _, _ in parts:
            for whole, part in zip(batch, arrays):
                whole[where] = part
        return batch, parts[0][1], skipped

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for inputs, labels, positions in self._produce():
            yield {"input_ids": torch.from_numpy(inputs), "labels": torch.from_numpy(labels),
                   "position_ids": torch.from_numpy(positions)}

    @property
    def lanes(self) -> int:
        return self._stream.order.lanes

    @property
    def rows_per_epoch(self) -> int:
        """Rows of an epoch of the (first) source."""
        return self._stream.order.sources[0].epoch_rows

    def place_of_row(self, row: int) -> tuple[str, int]:
        """(the shard, the row of it) that the stream's row ``row`` is."""
        place = self._stream.order.place(row)
        return self._stream.url(place), place.row

    def planned_shards(self, batches: int, *, worker: int = 0, num_workers: int = 1) -> set[str]:
        """The shards this replica's worker ``worker`` of ``num_workers`` reads for its batches among the next
        ``batches`` of the replica (from the cursor), without reading any: the loader's own walk, for benchmarks and
        tests to hold the reads to."""
        stream, start = self._stream, self._cursor.row
        count = stream.batch_count(start)
        return {stream.url(stream.order.place(g)) for k in range(batches if count is None else min(batches, count))
                for _, g in stream.part(start, k, worker, num_workers)}

    def _stream_identity(self) -> dict:
        """Without rank and world size: the rows do not depend on them, so a state resumes on any number; with the
        digest of the shards' sha256 from their manifests, so shards moved elsewhere resume, and others do not
        (None where a shard has none on record: streamed shards)."""
        s, recorded = self._stream, self._stream.checksums
        checksums = [recorded.get(url) for url in s.urls]
        digest = None if None in checksums else hashlib.sha256("\n".join(checksums).encode()).hexdigest()
        names = "\n".join(os.path.basename(u) for u in s.urls).encode()
        return {"data_order": DATA_ORDER, "seed": s.seed, "shuffle": s.shuffle, "seq_len": s.seq_len,
                "lanes": s.order.lanes, "num_shards": len(s.urls),
                "shards_crc32": zlib.crc32(names), "shards_sha256": digest}

    def load_state_dict(self, state: dict) -> None:
        if "data_order" not in state:
            raise ValueError("this data loader state was written before the replicas read their own shares "
                             f"(data order 1; this version orders rows by shard and lane, data order {DATA_ORDER}): "
                             "it cannot resume here; start a new run.dir, or resume with the version that wrote it")
        mine = self._identity["shards_sha256"]
        if state.get("shards_sha256") is None or mine is None:  # unknown on either side
            state = {**state, "shards_sha256": mine}
        super().load_state_dict(state)


class MixtureLoader(TokenLoader):
    """TokenLoader's batches from the rows of several sources, shared out by weight (a data mixture).

    ``sources`` are ``(TokenLoader, weight)`` pairs, the loaders built for the same rank, world size, seed, shuffle,
    ``seq_len``, ``batch_size`` and ``lanes`` (only their shards are used; their ``epochs`` must be None: a mixture
    runs forever). Source i gets a share of the lanes (``rows.lane_sources``), hence of the rows and tokens:
    ``by="tokens"`` its weight's share, ``by="documents"`` its weight times its mean document length (from the
    manifests), so its share of the documents is its weight's. Each source walks its own epochs.
    """

    def __init__(self, sources: Sequence[tuple[TokenLoader, float]], *, num_workers: int = 0, by: str = "tokens"):
        if not sources:
            raise ValueError("sources: a mixture needs at least one (loader, weight)")
        if by not in MIX_BY:
            raise ValueError(f"by={by!r}: expected one of {', '.join(MIX_BY)}")
        check_at_least(num_workers=(num_workers, 0))
        streams = [loader._stream for loader, _ in sources]
        first = streams[0]
        for i, ((_, weight), stream) in enumerate(zip(sources, streams)):
            if not (isinstance(weight, int | float) and math.isfinite(weight) and weight > 0):
                raise ValueError(f"sources[{i}] weight={weight!r}: expected a number > 0")
            for key in ("replica", "replicas", "seed", "shuffle", "seq_len", "batch_size", "epochs"):
                if getattr(stream, key) != getattr(first, key):
                    raise ValueError(f"sources[{i}] {key}={getattr(stream, key)!r}, but sources[0] has "
                                     f"{getattr(first, key)!r}: every source must be read alike")
            if stream.order.lanes != first.order.lanes:
                raise ValueError(f"sources[{i}] lanes={stream.order.lanes}, but sources[0] has "
                                 f"{first.order.lanes}: every source must be read alike")
        if first.epochs is not None:
            raise ValueError(f"epochs={first.epochs}: a mixture runs forever (epochs=None)")
        StreamLoader.__init__(self, num_workers)
        total = sum(weight for _, weight in sources)
        self.weights = tuple(weight / total for _, weight in sources)
        self.by = by
        per_row = [1.0] * len(streams)
        if by == "documents":  # rows of source i per document of it: its mean document length
            per_row = [sum(t for t, _ in s.sources[0].counts) / sum(d for _, d in s.sources[0].counts)
                       for s in streams]
        shares = [w * r for w, r in zip(self.weights, per_row)]
        lane_source = lane_sources([s / sum(shares) for s in shares], first.order.lanes)
        layouts = tuple(SourceRows(s.order.sources[0].tokens, first.seq_len, lane_source.count(i), first.seed,
                                   first.shuffle) for i, s in enumerate(streams))
        self._stream = _Rows(tuple(s.sources[0] for s in streams), MixedRows(layouts, lane_source), first.seq_len,
                             first.batch_size, first.replica, first.replicas, first.seed, first.shuffle, None,
                             first.skip_corrupt, first.tokenizer_sha256)
        self._cursor = _Cursor(0, 0)

    def source_counts(self) -> list[tuple[int, int]]:
        """(rows, input tokens) each source has given every replica's batches so far."""
        return [(rows, rows * self._stream.seq_len) for rows in self._stream.order.source_rows(self._cursor.row)]

    def _stream_identity(self) -> dict:
        return {**super()._stream_identity(), "weights": list(self.weights), "by": self.by,
                "source_shards": [len(source.urls) for source in self._stream.sources]}
