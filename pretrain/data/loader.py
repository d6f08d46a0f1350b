"""Packed token batches from text shards: one stream of rows shared by the ranks, shuffled, resumable exactly.

The shuffle windows, workers and resume are ``pretrain.data.stream``'s (read it first); here a sample is a document's
token array, and a batch is packed from the stream of documents. Unlike the image loader, ranks do not split the
shards: every data-parallel replica walks the one stream of all shards (that of rank 0 of 1) and takes its share of
the batches (below), so the rows of a global step do not depend on how many ranks share them:

Packing. Documents (eos included) are concatenated across windows and epochs into one token stream, cut into rows
of ``seq_len + 1`` tokens that overlap by one: row j holds stream tokens ``[j*L, j*L + L]``, its first L are
``input_ids`` and its last L are ``labels``, so every token is an input exactly once. ``batch_size`` consecutive rows
make a batch. ``position_ids`` count from 0 at every document start and at every row start.

Replicas. Batch J of the stream (counted from where the iteration started) goes to replica J mod R of R; R
consecutive batches make a *round*. A training step of A accumulated micro-batches on R replicas takes A rounds, so
R replicas × A micro-batches read the same rows as 1 replica × R·A (the elastic resume of docs/CONTRACTS.md). Each
replica reads and packs every shard (cheap: millions of tokens/s) and assembles only its own batches.

The cursor ``(epoch, shard, doc, token)`` — the stream's position of a document and the offset in it — points at the
first token of the next round. ``state_dict()`` holds the cursor after the round of the last batch handed out, the
same on every replica at a step's end, so a state resumes on any number of replicas (and any ``batch_size``: it
names a token, not a batch). Reading and shuffling run at millions of tokens/s, so repeating them in every worker
costs little; assembling batches is shared.

Epochs: with ``epochs=None`` the stream cycles forever. With ``epochs=N`` it ends after N epochs and the final
tokens that do not fill a round are dropped, so every replica yields the same number of batches.

Mixtures (``MixtureLoader``): several such streams, one per source, and a choice per document of its source: by
tokens (each source's share of the tokens follows its weight), or by a seeded draw (its share of the documents); the
packing is the same, and the cursor holds every source's position and counts, and the pick count.

States of a run before the replicas shared one stream (``rank``/``world_size`` in the state) resume when they are a
one-rank run's (its stream is the same); a several-rank one is refused.
"""
import hashlib
import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from pretrain.data.shards import expand_shards, recorded_checksums
from pretrain.data.stream import Position, ShardStream, Skips, StreamLoader, check_at_least, check_split
from pretrain.data.text_shards import check_tokenizer, iter_shard_tokens

ONE_STREAM = dict(rank=0, world_size=1)  # the stream every replica walks: all shards, as rank 0 of 1 read them


class Share(NamedTuple):
    """Which batches of the stream one producer builds: batch J to replica J mod replicas, and the k-th batch of
    a replica to its worker k mod workers."""
    replica: int = 0
    replicas: int = 1
    worker: int = 0
    workers: int = 1

    def builds(self, j: int) -> bool:
        return j % self.replicas == self.replica and j // self.replicas % self.workers == self.worker


class _Cursor(NamedTuple):
    epoch: int
    shard: int
    doc: int
    token: int


@dataclass(frozen=True)
class _Stream(ShardStream):
    tokenizer_sha256: str | None
    seq_len: int
    batch_size: int
    replica: int
    replicas: int
    sample_noun = "document"

    def read_shard(self, url: str) -> list[np.ndarray]:
        return list(iter_shard_tokens(url, self.checksums.get(url), self.tokenizer_sha256))

    def documents(self, start: _Cursor, skips: Skips) -> Iterator[tuple[np.ndarray, _Cursor]]:
        """(tokens from the cursor on, cursor of their first token) of each document from ``start``."""
        for tokens, at in self.samples(Position(*start[:3]), skips):
            offset = start.token if at == start[:3] else 0
            yield tokens[offset:], _Cursor(*at, offset)

    def batches(self, start: _Cursor, worker: int = 0, num_workers: int = 1) -> Iterator[tuple[tuple, tuple, int]]:
        skips = Skips(log=worker == 0)
        share = Share(self.replica, self.replicas, worker, num_workers)
        return _packed(self.documents(start, skips), skips, self.batch_size, self.seq_len, share)


def _packed(documents: Iterator[tuple[np.ndarray, NamedTuple]], skips: Skips, rows: int, length: int,
            share: Share) -> Iterator[tuple[tuple, tuple, int]]:
    """(batch, cursor after its round, shards skipped so far) of the batches ``share`` builds, packed from
    ``documents``, (tokens from the cursor on, cursor of their first token) whose cursor has a ``token`` field. A
    batch is handed out once its round is packed, so its cursor is the same on every replica."""
    span = rows * length  # tokens a batch consumes; it also reads the next one, as the last label
    pending: deque[tuple[np.ndarray, NamedTuple]] = deque()
    available, k, built = 0, 0, None
    for tokens, cursor in documents:
        if len(tokens) == 0:
            continue
        pending.append((tokens, cursor))
        available += len(tokens)
        while available > span:
            pieces, starts, taken = [], [], 0
            while taken < span:
                tokens, cursor = pending[0]
                if cursor.token == 0:
                    starts.append(taken)
                use = min(len(tokens), span - taken)
                pieces.append(tokens[:use])
                if use == len(tokens):
                    pending.popleft()
                else:
                    pending[0] = (tokens[use:], cursor._replace(token=cursor.token + use))
                taken += use
            available -= span
            if share.builds(k):
                pieces.append(pending[0][0][:1])
                built = _assemble(np.concatenate(pieces), starts, rows, length)
            if built is not None and k % share.replicas == share.replicas - 1:  # the end of the round
                yield built, tuple(pending[0][1]), skips.count
                built = None
            k += 1


def _assemble(flat: np.ndarray, starts: list[int], rows: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch's ``B*L + 1`` tokens and its position ids, as numpy arrays: they pass between processes several
    times faster than torch tensors, and the inputs and labels, overlapping views of one array, pass once."""
    is_start = np.zeros(rows * length, dtype=bool)
    is_start[starts] = True
    is_start[::length] = True
    index = np.arange(rows * length)
    positions = index - np.maximum.accumulate(np.where(is_start, index, 0))
    return flat.astype(np.int64), positions.reshape(rows, length)


class TokenLoader(StreamLoader):
    """Iterates dicts of ``input_ids``, ``labels``, ``position_ids`` (``torch.long``, ``[batch_size, seq_len]``):
    replica ``rank``'s share of the one stream that ``world_size`` replicas share."""

    def __init__(self, pattern: str, *, seq_len: int, batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, num_workers: int = 0, shuffle: bool = True, shuffle_buffer: int = 1000,
                 epochs: int | None = None, allow_pipe: bool = False, skip_corrupt: bool = False,
                 tokenizer_sha256: str | None = None):
        check_at_least(seq_len=(seq_len, 1), batch_size=(batch_size, 1), world_size=(world_size, 1),
                       num_workers=(num_workers, 0), shuffle_buffer=(shuffle_buffer, 0))
        check_split(rank, world_size, epochs)
        urls = expand_shards(pattern, allow_pipe=allow_pipe)
        if tokenizer_sha256 is not None:
            check_tokenizer(urls, tokenizer_sha256)
        super().__init__(num_workers)
        self._stream = _Stream(tuple(urls), recorded_checksums(urls), seed=seed, shuffle=shuffle,
                               shuffle_buffer=shuffle_buffer, epochs=epochs, skip_corrupt=skip_corrupt,
                               tokenizer_sha256=tokenizer_sha256, seq_len=seq_len, batch_size=batch_size,
                               replica=rank, replicas=world_size, **ONE_STREAM)
        self._cursor = _Cursor(0, 0, 0, 0)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        shape = (self._stream.batch_size, self._stream.seq_len)
        for tokens, positions in self._produce():
            yield {"input_ids": torch.from_numpy(tokens[:-1].reshape(shape)),
                   "labels": torch.from_numpy(tokens[1:].reshape(shape).copy()),
                   "position_ids": torch.from_numpy(positions)}

    def _stream_identity(self) -> dict:
        """Without rank and world size: every replica reads the one stream, so a state resumes on any number; with
        the digest of the shards' sha256 from their manifests, so shards moved elsewhere resume, and others do not
        (None where a shard has none on record: streamed shards)."""
        identity = super()._stream_identity()
        del identity["rank"], identity["world_size"]
        checksums = [self._stream.checksums.get(url) for url in self.shard_urls]
        digest = None if None in checksums else hashlib.sha256("\n".join(checksums).encode()).hexdigest()
        return {**identity, "shards_sha256": digest}

    def load_state_dict(self, state: dict) -> None:
        written_by = state.get("world_size", 1)  # present only in a state from before the replicas shared a stream
        if written_by != 1:
            raise ValueError(f"this data loader state is rank {state.get('rank')}'s of {written_by}, written before "
                             "the ranks shared one stream of rows: it cannot resume with this version (a one-rank "
                             "run's can); start a new run.dir, or resume with the version that wrote it")
        state = {key: value for key, value in state.items() if key not in ONE_STREAM}
        mine = self._stream_identity()["shards_sha256"]
        if state.get("shards_sha256") is None or mine is None:  # unknown on either side (or a state from before)
            state["shards_sha256"] = mine
        super().load_state_dict(state)


class _MixCursor(NamedTuple):
    epoch: int      # the fewest epochs any source has finished
    draws: int      # the mixed stream's document index (the draw that chose its source)
    token: int      # offset in that document
    sources: tuple  # per source: (epoch, shard, index) of its next document, then documents and tokens it gave


DRAW_BLOCK = 4096  # draws made by one generator: a document's source costs ~10 ns, not a generator's ~10 µs


MIX_BY = ("tokens", "documents")


@dataclass(frozen=True)
class _Mixture:
    """A mixture's logical stream: pick n chooses a source (``picks``) and takes its next document; each source is
    its own stream (shuffle windows, epochs), so a cursor holding every source's position and counts and the pick
    count resumes exactly; the replicas share it as they share a single source's."""
    sources: tuple[_Stream, ...]
    weights: tuple[float, ...]  # sum to 1
    replica: int
    replicas: int
    seed: int
    shuffle: bool
    shuffle_buffer: int
    batch_size: int
    seq_len: int
    by: str  # one of MIX_BY
    epochs = None  # every source cycles forever
    rank, world_size = 0, 1  # ONE_STREAM

    @property
    def checksums(self) -> dict[str, str]:
        return {url: sha for source in self.sources for url, sha in source.checksums.items()}

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(url for source in self.sources for url in source.urls)

    def epoch_shards(self, epoch: int) -> list[str]:
        return [url for source in self.sources for url in source.epoch_shards(epoch)]

    def picks(self, first: int, taken: list[list[int]]) -> Iterator[int]:
        """The source of every pick from ``first`` on; ``taken`` is each source's [documents, tokens] given so far,
        which the caller updates after each pick.

        By tokens, the source furthest behind its share of the tokens (``weights[i] · Σ tokens − tokens[i]``
        largest, the first on a tie), as Megatron's and NeoX's blending indices choose samples, here whole
        documents: a source's share stays within a document of its weight, whatever its documents' lengths (a 3:1
        mixture by documents gave 98.8 % / 1.2 % of the tokens where the documents' lengths differed). By
        documents, a seeded draw by weight (``draws``)."""
        if self.by == "documents":
            yield from self.draws(first)
        else:
            while True:
                total = sum(tokens for _, tokens in taken)
                yield max(range(len(taken)), key=lambda i: self.weights[i] * total - taken[i][1])

    def draws(self, first: int) -> Iterator[int]:
        """The source of every draw from ``first`` on: draw n picks source i with probability ``weights[i]``, from
        rng(seed, 0, n // DRAW_BLOCK) (0: the rank one-rank runs drew with)."""
        cdf = np.cumsum(self.weights)
        cdf[-1] = 1.0
        block, skip = divmod(first, DRAW_BLOCK)
        while True:
            u = np.random.default_rng([self.seed, 0, block, len(self.weights)]).random(DRAW_BLOCK)
            yield from np.searchsorted(cdf, u, side="right")[skip:].tolist()
            block, skip = block + 1, 0

    def documents(self, start: _MixCursor, skips: Skips) -> Iterator[tuple[np.ndarray, _MixCursor]]:
        streams = [source.samples(Position(*at[:3]), skips) for source, at in zip(self.sources, start.sources)]
        heads = [next(stream) for stream in streams]  # (tokens, position) of each source's next document
        taken = [list(at[3:]) for at in start.sources]
        for n, i in enumerate(self.picks(start.draws, taken), start=start.draws):
            offset = start.token if n == start.draws else 0
            where = tuple((*at, *count) for (_, at), count in zip(heads, taken))
            yield heads[i][0][offset:], _MixCursor(min(at.epoch for _, at in heads), n, offset, where)
            taken[i][0] += 1
            taken[i][1] += len(heads[i][0])
            heads[i] = next(streams[i])

    def batches(self, start: _MixCursor, worker: int = 0, num_workers: int = 1) -> Iterator[tuple[tuple, tuple, int]]:
        skips = Skips(log=worker == 0)
        share = Share(self.replica, self.replicas, worker, num_workers)
        return _packed(self.documents(start, skips), skips, self.batch_size, self.seq_len, share)


class MixtureLoader(TokenLoader):
    """TokenLoader's batches packed from documents of several sources, shared out by weight (a data mixture).

    ``sources`` are ``(TokenLoader, weight)`` pairs, the loaders built for the same rank, world size, seed, shuffle,
    ``seq_len`` and ``batch_size`` (only their streams are used; their ``epochs`` must be None: a mixture runs
    forever). ``by="tokens"`` gives each source its weight's share of the tokens, ``by="documents"`` of the
    documents (``_Mixture.picks``). Picks are a pure function of (seed, pick index) and the counts so far, and
    ``state_dict()`` holds each source's position and counts, so the mixture resumes exactly with any
    ``num_workers`` and any number of replicas.
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
            for key in ("replica", "replicas", "seed", "shuffle", "shuffle_buffer", "seq_len", "batch_size", "epochs"):
                if getattr(stream, key) != getattr(first, key):
                    raise ValueError(f"sources[{i}] {key}={getattr(stream, key)!r}, but sources[0] has "
                                     f"{getattr(first, key)!r}: every source must be read alike")
        if first.epochs is not None:
            raise ValueError(f"epochs={first.epochs}: a mixture runs forever (epochs=None)")
        StreamLoader.__init__(self, num_workers)
        total = sum(weight for _, weight in sources)
        self._stream = _Mixture(tuple(streams), tuple(weight / total for _, weight in sources), first.replica,
                                first.replicas, first.seed, first.shuffle, first.shuffle_buffer, first.batch_size,
                                first.seq_len, by)
        self._cursor = _MixCursor(0, 0, 0, tuple((0, 0, 0, 0, 0) for _ in streams))

    def source_counts(self) -> list[tuple[int, int]]:
        """(documents, tokens) each source has given the rounds so far, over all replicas (a document cut by the last
        round counts as given, with the tokens taken of it)."""
        cursor = self._cursor
        current = next(self._stream.picks(cursor.draws, [list(at[3:]) for at in cursor.sources]))
        return [(documents + int(i == current and cursor.token > 0), tokens + (cursor.token if i == current else 0))
                for i, (*_, documents, tokens) in enumerate(cursor.sources)]

    def _stream_identity(self) -> dict:
        by = {"by": self._stream.by} if self._stream.by != "documents" else {}  # states from before `by` drew so
        return {**super()._stream_identity(), "weights": list(self._stream.weights), **by,
                "source_shards": [len(source.urls) for source in self._stream.sources]}
