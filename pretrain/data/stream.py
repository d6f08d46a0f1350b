"""What every resumable shard loader shares: the per-rank stream of samples, its cursor, workers and state.

One rank's *logical stream* is a pure function of (shards, seed, epoch, rank, world_size), and a small cursor names a
position in it. Workers only share out the work of producing it.

1. Shard order. Each epoch, all shards are permuted by rng(seed, epoch) — the same on every rank — and rank r
   takes shards r, r+W, r+2W, ... of that order, so ranks never overlap.
2. Shuffle windows (the seeded buffer). The rank reads its shards in order and groups them into windows:
   consecutive whole shards until the window holds at least ``shuffle_buffer`` samples. A window's samples are
   permuted by rng(seed, epoch, rank, position of its first shard). Unlike a streaming shuffle buffer, a window's
   contents follow from the cursor alone, so resuming reads at most one window again. Each worker holds one window
   in memory: at least one whole shard.
3. A ``Position`` ``(epoch, shard, index)`` — the epoch, the position of the window's first shard in the rank's shard
   list, the sample's index in the window's order — names one sample; a loader's cursor starts with it.

Workers: every DataLoader worker walks the same logical stream, and worker w builds only the batches
k ≡ w (mod num_workers), counted from where the iteration started; the DataLoader's in-order round robin hands them
out as 0, 1, 2, .... Reading and shuffling are repeated in each worker, while the costly part of a batch (packing
tokens, decoding images) is shared. So batches and state are the same for any ``num_workers``, 0 included.

A shard that turns out corrupt mid-run (a bad tar, a sha256 other than its manifest's, a malformed sample) raises
``ShardError``, or with ``skip_corrupt`` is logged, counted in ``skipped_shards`` and left out whole (the same way on
every rerun and in every worker). An epoch with no readable sample is an error, not a hang.
"""
import functools
import logging
import os
import signal
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pretrain.data.shards import ShardError

log = logging.getLogger(__name__)


class Position(NamedTuple):
    epoch: int
    shard: int  # position of the window's first shard in the rank's shard list of the epoch
    index: int  # the sample's index in the window's (shuffled) order


class Skips:
    """Corrupt shards left out so far in one walk of the stream; one worker logs them, all count them."""

    def __init__(self, log: bool):
        self.count, self.log = 0, log

    def record(self, err: ShardError) -> None:
        self.count += 1
        if self.log:
            log.warning("skipping corrupt shard (%d skipped so far): %s", self.count, err)


@dataclass(frozen=True)
class ShardStream:
    """The logical stream of one rank; subclasses say how a shard reads (``read_shard``) and batch its samples."""
    urls: tuple[str, ...]
    checksums: dict[str, str]  # sha256 of the local shards, from their manifests
    rank: int
    world_size: int
    seed: int
    shuffle: bool
    shuffle_buffer: int
    epochs: int | None
    skip_corrupt: bool
    sample_noun = "sample"  # what a sample is, in error messages

    def read_shard(self, url: str) -> list:
        """The samples of one shard, in shard order; ``ShardError`` if it is corrupt."""
        raise NotImplementedError

    def batches(self, start: tuple, worker: int = 0, num_workers: int = 1) -> Iterator[tuple[Any, tuple, int]]:
        """(batch, cursor after it, shards skipped so far) of the batches k ≡ worker (mod num_workers)."""
        raise NotImplementedError

    def epoch_shards(self, epoch: int) -> list[str]:
        order = np.arange(len(self.urls))
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.urls))
        return [self.urls[i] for i in order[self.rank::self.world_size]]

    def _read(self, url: str, skips: Skips) -> list:
        try:
            return self.read_shard(url)
        except ShardError as err:
            if not self.skip_corrupt:
                raise
            skips.record(err)
            return []

    def windows(self, epoch: int, start: int, skips: Skips) -> Iterator[tuple[int, list]]:
        """(position of the first shard, samples in shuffled order) of each window from shard ``start``."""
        shards = self.epoch_shards(epoch)
        i = start
        while i < len(shards):
            first, samples = i, []
            while i < len(shards) and (i == first or (self.shuffle and len(samples) < self.shuffle_buffer)):
                samples.extend(self._read(shards[i], skips))
                i += 1
            if self.shuffle and self.shuffle_buffer > 1:
                order = np.random.default_rng([self.seed, epoch, self.rank, first]).permutation(len(samples))
                samples = [samples[j] for j in order]
            yield first, samples

    def samples(self, start: Position, skips: Skips) -> Iterator[tuple[Any, Position]]:
        """(sample, its position) of each sample from ``start`` on, across epochs until ``epochs`` (or forever)."""
        epoch = start.epoch
        while self.epochs is None or epoch < self.epochs:
            resuming = epoch == start.epoch
            found = resuming and start[1:] != (0, 0)  # samples before the start were read
            for first, samples in self.windows(epoch, start.shard if resuming else 0, skips):
                at_start = resuming and first == start.shard
                for i in range(start.index if at_start else 0, len(samples)):
                    found = True
                    yield samples[i], Position(epoch, first, i)
            if not found:
                raise ShardError(f"rank {self.rank}: no readable {self.sample_noun} in epoch {epoch} "
                                 f"({len(self.epoch_shards(epoch))} shards, {skips.count} skipped as corrupt)")
            epoch += 1


class _WorkerFailure(NamedTuple):
    error: ShardError


class _WorkerShare(IterableDataset):
    def __init__(self, stream: ShardStream, start: tuple):
        self.stream, self.start = stream, start

    def __iter__(self):
        """A corrupt shard comes back in the batch's place, for the trainer to raise as is (the DataLoader would
        rewrap it in a worker traceback)."""
        info = get_worker_info()
        try:
            yield from self.stream.batches(self.start, info.id, info.num_workers)
        except ShardError as err:
            yield _WorkerFailure(err)


def _ints(value):
    """A cursor field as saved (an int, or a tuple of them: a mixture's sources) back in Python ints."""
    return tuple(_ints(v) for v in value) if isinstance(value, tuple | list) else int(value)


def _as_is(item):
    return item


def _leave_stop_signals_to_the_trainer(worker_id: int) -> None:
    """A worker ignores SIGTERM and SIGINT: its trainer, stopping on them, saves and then closes it. PyTorch's own
    handler dies of a SIGTERM from anyone but the parent (a launcher terminating every child of a rank, a signal to
    a process group), and the trainer, told of it by its SIGCHLD handler, died in turn before it saved."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)


def check_at_least(**values: tuple[Any, int]) -> None:
    """Each ``name=(value, least)`` must be an integer >= least; the error names the key."""
    for name, (value, least) in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name}={value!r}: expected an integer >= {least}")


def check_split(rank: int, world_size: int, epochs: int | None) -> None:
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r}: expected 0 <= rank < world_size={world_size}")
    if epochs is not None and (not isinstance(epochs, int) or epochs < 1):
        raise ValueError(f"epochs={epochs!r}: expected None (forever) or an integer >= 1")


class StreamLoader:
    """Iteration over a ``ShardStream``'s batches, in process or through workers, with exact resume.

    A subclass sets ``_stream`` and ``_cursor`` (a NamedTuple starting with the ``Position`` fields) and turns the
    produced batches into tensors in ``__iter__``.
    """
    _stream: ShardStream
    _cursor: NamedTuple

    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self.skipped_shards = 0
        self.batches = 0

    def epoch_shards(self, epoch: int) -> list[str]:
        """The shards this rank reads in ``epoch``, in reading order."""
        return self._stream.epoch_shards(epoch)

    @property
    def shard_urls(self) -> tuple[str, ...]:
        """Every shard of the stream, whichever rank reads it."""
        return self._stream.urls

    @property
    def epoch(self) -> int:
        """Finished epochs (the epoch of the next sample)."""
        return self._cursor.epoch

    def _produce(self) -> Iterator[Any]:
        """The stream's batches from the cursor on; the cursor follows each batch handed out."""
        stream, start, skipped_before = self._stream, self._cursor, self.skipped_shards
        if stream.epochs is not None and start.epoch >= stream.epochs:
            return
        if self.num_workers == 0:
            produced = stream.batches(start)
        else:
            produced = DataLoader(_WorkerShare(stream, start), batch_size=None, num_workers=self.num_workers,
                                  collate_fn=_as_is, worker_init_fn=_leave_stop_signals_to_the_trainer)
        # the iterator lives only in the loop (no local): an error raised here frees it, and its workers, at once
        for parts in zip(*[iter(produced)] * self._parts_per_batch()):
            for item in parts:
                if isinstance(item, _WorkerFailure):
                    raise item.error
            batch, cursor, skipped = self._merge(parts)
            self._cursor = start._make(cursor)
            self.skipped_shards = skipped_before + skipped
            self.batches += 1
            yield batch
        self._cursor = start._make((stream.epochs,) + (0,) * (len(start) - 1))  # only a finite stream ends

    def _parts_per_batch(self) -> int:
        """Items produced per batch: 1 where each worker builds whole batches (in turn)."""
        return 1

    def _merge(self, parts: tuple) -> tuple[Any, tuple, int]:
        """(batch, cursor, shards skipped) from one batch's produced items."""
        return parts[0]

    def _stream_identity(self) -> dict:
        s = self._stream
        names = "\n".join(os.path.basename(u) for u in s.urls).encode()
        return {"rank": s.rank, "world_size": s.world_size, "seed": s.seed, "shuffle": s.shuffle,
                "shuffle_buffer": s.shuffle_buffer, "num_shards": len(s.urls), "shards_crc32": zlib.crc32(names)}

    @functools.cached_property
    def _identity(self) -> dict:
        """``_stream_identity`` once per loader: the shards do not change during a run, and the trainer takes a
        state every step (hashing thousands of shard names each time cost milliseconds a step)."""
        return self._stream_identity()

    def state_dict(self) -> dict:
        return {**self._cursor._asdict(), **self._identity,
                "skipped_shards": self.skipped_shards, "batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly after the batch the state was taken at (any num_workers)."""
        for key, mine in self._identity.items():
            if key not in state:
                raise ValueError(f"data loader state lacks key {key!r}")
            if state[key] != mine:
                raise ValueError(f"data loader state key {key!r} is {state[key]!r}, but this loader has {mine!r}: "
                                 "resuming would read a different stream")
        try:
            self._cursor = self._cursor._make(_ints(state[k]) for k in self._cursor._fields)
            self.skipped_shards, self.batches = int(state["skipped_shards"]), int(state["batches"])
        except KeyError as err:
            raise ValueError(f"data loader state lacks key {err.args[0]!r}") from None
