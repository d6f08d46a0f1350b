"""Packed token batches from text shards: split across ranks and workers, shuffled, resumable exactly.

The design: one rank's *logical stream* is a pure function of (shards, seed, epoch, rank, world_size), and a small
cursor names a position in it. Workers only share out the work of producing it.

1. Shard order. Each epoch, all shards are permuted by rng(seed, epoch) — the same on every rank — and rank r
   takes shards r, r+W, r+2W, ... of that order, so ranks never overlap.
2. Shuffle windows (the seeded buffer). The rank reads its shards in order and groups them into windows:
   consecutive whole shards until the window holds at least ``shuffle_buffer`` documents. A window's documents are
   permuted by rng(seed, epoch, rank, position of its first shard). Unlike a streaming shuffle buffer, a window's
   contents follow from the cursor alone, so resuming reads at most one window again.
3. Packing. Documents (eos included) are concatenated across windows and epochs into one token stream, cut into
   rows of ``seq_len + 1`` tokens that overlap by one: row j holds stream tokens ``[j*L, j*L + L]``, its first L are
   ``input_ids`` and its last L are ``labels``, so every token is an input exactly once. ``batch_size`` consecutive
   rows make a batch. ``position_ids`` count from 0 at every document start and at every row start.

The cursor ``(epoch, shard, doc, token)`` — epoch, the position of the current window's first shard in the rank's
shard list, the document's index in the window's order, the offset in the document — points at the first token of
the next batch. ``state_dict()`` holds the cursor after the last batch handed out.

Workers: every DataLoader worker walks the same logical stream, and worker w builds only the batches
k ≡ w (mod num_workers), counted from where the iteration started; the DataLoader's in-order round robin hands them
out as 0, 1, 2, .... Reading and shuffling are repeated in each worker (they run at millions of tokens/s), while
assembling batches is shared. So batches and state are the same for any ``num_workers``, 0 included. Each worker
holds one window in memory: at least one whole shard.

Epochs: with ``epochs=None`` every rank cycles forever, so an uneven split of shards never hangs distributed
training; ranks merely roll over at different steps. With ``epochs=N`` the stream ends after N epochs and the final
tokens that do not fill a batch are dropped; ranks may then yield different numbers of batches (their shards differ
in size), so a distributed loop should stop all ranks together, e.g. on a step budget.

A shard that turns out corrupt mid-run (a bad tar, or a sha256 other than its manifest's) raises ``ShardError``, or
with ``skip_corrupt`` is logged, counted in ``skipped_shards`` and left out whole (the same way on every rerun).
An epoch with no readable document is an error, not a hang.
"""
import logging
import os
import zlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pretrain.data.shards import ShardError, expand_shards, recorded_checksums
from pretrain.data.text_shards import check_tokenizer, iter_shard_tokens

log = logging.getLogger(__name__)


class _Cursor(NamedTuple):
    epoch: int
    shard: int
    doc: int
    token: int


class _Skips:
    """Corrupt shards left out so far in one walk of the stream; one worker logs them, all count them."""

    def __init__(self, log: bool):
        self.count, self.log = 0, log

    def record(self, err: ShardError) -> None:
        self.count += 1
        if self.log:
            log.warning("skipping corrupt shard (%d skipped so far): %s", self.count, err)


@dataclass(frozen=True)
class _Stream:
    """The logical stream of one rank; see the module docstring."""
    urls: tuple[str, ...]
    checksums: dict[str, str]  # sha256 of the local shards, from their manifests
    rank: int
    world_size: int
    seed: int
    shuffle: bool
    shuffle_buffer: int
    epochs: int | None
    skip_corrupt: bool
    tokenizer_sha256: str | None
    seq_len: int
    batch_size: int

    def epoch_shards(self, epoch: int) -> list[str]:
        order = np.arange(len(self.urls))
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.urls))
        return [self.urls[i] for i in order[self.rank::self.world_size]]

    def _read(self, url: str, skips: _Skips) -> list[np.ndarray]:
        try:
            return list(iter_shard_tokens(url, self.checksums.get(url), self.tokenizer_sha256))
        except ShardError as err:
            if not self.skip_corrupt:
                raise
            skips.record(err)
            return []

    def windows(self, epoch: int, start: int, skips: _Skips) -> Iterator[tuple[int, list[np.ndarray]]]:
        """(position of the first shard, documents in shuffled order) of each window from shard ``start``."""
        shards = self.epoch_shards(epoch)
        i = start
        while i < len(shards):
            first, docs = i, []
            while i < len(shards) and (i == first or (self.shuffle and len(docs) < self.shuffle_buffer)):
                docs.extend(self._read(shards[i], skips))
                i += 1
            if self.shuffle and self.shuffle_buffer > 1:
                order = np.random.default_rng([self.seed, epoch, self.rank, first]).permutation(len(docs))
                docs = [docs[j] for j in order]
            yield first, docs

    def documents(self, start: _Cursor, skips: _Skips) -> Iterator[tuple[np.ndarray, _Cursor]]:
        """(tokens from the cursor on, cursor of their first token) of each document from ``start``."""
        epoch = start.epoch
        while self.epochs is None or epoch < self.epochs:
            resuming = epoch == start.epoch
            found = resuming and start != _Cursor(epoch, 0, 0, 0)  # documents before the cursor were read
            for first, docs in self.windows(epoch, start.shard if resuming else 0, skips):
                at_cursor = resuming and first == start.shard
                for d in range(start.doc if at_cursor else 0, len(docs)):
                    offset = start.token if at_cursor and d == start.doc else 0
                    found = True
                    yield docs[d][offset:], _Cursor(epoch, first, d, offset)
            if not found:
                raise ShardError(f"rank {self.rank}: no readable document in epoch {epoch} "
                                 f"({len(self.epoch_shards(epoch))} shards, {skips.count} skipped as corrupt)")
            epoch += 1

    def batches(self, start: _Cursor, worker: int = 0, num_workers: int = 1) -> Iterator[tuple[tuple, tuple, int]]:
        """(batch, cursor after it, shards skipped so far) of the batches k ≡ worker (mod num_workers)."""
        rows, length = self.batch_size, self.seq_len
        span = rows * length  # tokens a batch consumes; it also reads the next one, as the last label
        pending: deque[tuple[np.ndarray, _Cursor]] = deque()
        available, k, skips = 0, 0, _Skips(log=worker == 0)
        for tokens, cursor in self.documents(start, skips):
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
                if k % num_workers == worker:
                    pieces.append(pending[0][0][:1])
                    yield self._assemble(np.concatenate(pieces), starts), tuple(pending[0][1]), skips.count
                k += 1

    def _assemble(self, flat: np.ndarray, starts: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The batch's ``B*L + 1`` tokens and its position ids, as numpy arrays: they pass between processes several
        times faster than torch tensors, and the inputs and labels, overlapping views of one array, pass once."""
        rows, length = self.batch_size, self.seq_len
        is_start = np.zeros(rows * length, dtype=bool)
        is_start[starts] = True
        is_start[::length] = True
        index = np.arange(rows * length)
        positions = index - np.maximum.accumulate(np.where(is_start, index, 0))
        return flat.astype(np.int64), positions.reshape(rows, length)


class _WorkerShare(IterableDataset):
    def __init__(self, stream: _Stream, start: _Cursor):
        self.stream, self.start = stream, start

    def __iter__(self):
        info = get_worker_info()
        return self.stream.batches(self.start, info.id, info.num_workers)


def _as_is(item):
    return item


class TokenLoader:
    """Iterates dicts of ``input_ids``, ``labels``, ``position_ids`` (``torch.long``, ``[batch_size, seq_len]``)."""

    def __init__(self, pattern: str, *, seq_len: int, batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, num_workers: int = 0, shuffle: bool = True, shuffle_buffer: int = 1000,
                 epochs: int | None = None, allow_pipe: bool = False, skip_corrupt: bool = False,
                 tokenizer_sha256: str | None = None):
        for name, value, least in (("seq_len", seq_len, 1), ("batch_size", batch_size, 1),
                                   ("world_size", world_size, 1), ("num_workers", num_workers, 0),
                                   ("shuffle_buffer", shuffle_buffer, 0)):
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{name}={value!r}: expected an integer >= {least}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank!r}: expected 0 <= rank < world_size={world_size}")
        if epochs is not None and (not isinstance(epochs, int) or epochs < 1):
            raise ValueError(f"epochs={epochs!r}: expected None (forever) or an integer >= 1")
        urls = expand_shards(pattern, allow_pipe=allow_pipe)
        if len(urls) < world_size:
            raise ShardError(f"shard pattern {pattern!r} names {len(urls)} shards, fewer than world_size={world_size}:"
                             " every rank needs at least one")
        if tokenizer_sha256 is not None:
            check_tokenizer(urls, tokenizer_sha256)
        self._stream = _Stream(tuple(urls), recorded_checksums(urls), rank, world_size, seed, shuffle, shuffle_buffer,
                               epochs, skip_corrupt, tokenizer_sha256, seq_len, batch_size)
        self.num_workers = num_workers
        self._cursor = _Cursor(0, 0, 0, 0)
        self.skipped_shards = 0
        self.batches = 0

    def epoch_shards(self, epoch: int) -> list[str]:
        """The shards this rank reads in ``epoch``, in reading order."""
        return self._stream.epoch_shards(epoch)

    @property
    def epoch(self) -> int:
        """Finished epochs (the epoch of the next token)."""
        return self._cursor.epoch

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        stream, start, skipped_before = self._stream, self._cursor, self.skipped_shards
        if stream.epochs is not None and start.epoch >= stream.epochs:
            return
        if self.num_workers == 0:
            produced = stream.batches(start)
        else:
            produced = DataLoader(_WorkerShare(stream, start), batch_size=None, num_workers=self.num_workers,
                                  collate_fn=_as_is)
        shape = (stream.batch_size, stream.seq_len)
        for (tokens, positions), cursor, skipped in produced:
            self._cursor = _Cursor(*cursor)
            self.skipped_shards = skipped_before + skipped
            self.batches += 1
            yield {"input_ids": torch.from_numpy(tokens[:-1].reshape(shape)),
                   "labels": torch.from_numpy(tokens[1:].reshape(shape).copy()),
                   "position_ids": torch.from_numpy(positions)}
        self._cursor = _Cursor(stream.epochs, 0, 0, 0)  # only a finite stream ends

    def _stream_identity(self) -> dict:
        s = self._stream
        names = "\n".join(os.path.basename(u) for u in s.urls).encode()
        return {"rank": s.rank, "world_size": s.world_size, "seed": s.seed, "shuffle": s.shuffle,
                "shuffle_buffer": s.shuffle_buffer, "num_shards": len(s.urls), "shards_crc32": zlib.crc32(names)}

    def state_dict(self) -> dict:
        return {**self._cursor._asdict(), **self._stream_identity(),
                "skipped_shards": self.skipped_shards, "batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly after the batch the state was taken at (any num_workers, seq_len, batch_size)."""
        for key, mine in self._stream_identity().items():
            if key not in state:
                raise ValueError(f"data loader state lacks key {key!r}")
            if state[key] != mine:
                raise ValueError(f"data loader state key {key!r} is {state[key]!r}, but this loader has {mine!r}: "
                                 "resuming would read a different stream")
        try:
            self._cursor = _Cursor(*(int(state[k]) for k in _Cursor._fields))
            self.skipped_shards, self.batches = int(state["skipped_shards"]), int(state["batches"])
        except KeyError as err:
            raise ValueError(f"data loader state lacks key {err.args[0]!r}") from None
