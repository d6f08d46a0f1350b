"""Packed token batches from text shards: split across ranks and workers, shuffled, resumable exactly.

The rank split, shuffle windows, workers and resume are ``pretrain.data.stream``'s (read it first); here a sample is
a document's token array, and a batch is packed from the stream of documents:

Packing. Documents (eos included) are concatenated across windows and epochs into one token stream, cut into rows
of ``seq_len + 1`` tokens that overlap by one: row j holds stream tokens ``[j*L, j*L + L]``, its first L are
``input_ids`` and its last L are ``labels``, so every token is an input exactly once. ``batch_size`` consecutive rows
make a batch. ``position_ids`` count from 0 at every document start and at every row start.

The cursor ``(epoch, shard, doc, token)`` — the stream's position of a document and the offset in it — points at the
first token of the next batch. ``state_dict()`` holds the cursor after the last batch handed out. Reading and
shuffling run at millions of tokens/s, so repeating them in every worker costs little; assembling batches is shared.

Epochs: with ``epochs=None`` every rank cycles forever, so an uneven split of shards never hangs distributed
training; ranks merely roll over at different steps. With ``epochs=N`` the stream ends after N epochs and the final
tokens that do not fill a batch are dropped; ranks may then yield different numbers of batches (their shards differ
in size), so a distributed loop should stop all ranks together, e.g. on a step budget.
"""
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from pretrain.data.shards import ShardError, expand_shards, recorded_checksums
from pretrain.data.stream import Position, ShardStream, Skips, StreamLoader, check_at_least, check_split
from pretrain.data.text_shards import check_tokenizer, iter_shard_tokens


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
    sample_noun = "document"

    def read_shard(self, url: str) -> list[np.ndarray]:
        return list(iter_shard_tokens(url, self.checksums.get(url), self.tokenizer_sha256))

    def documents(self, start: _Cursor, skips: Skips) -> Iterator[tuple[np.ndarray, _Cursor]]:
        """(tokens from the cursor on, cursor of their first token) of each document from ``start``."""
        for tokens, at in self.samples(Position(*start[:3]), skips):
            offset = start.token if at == start[:3] else 0
            yield tokens[offset:], _Cursor(*at, offset)

    def batches(self, start: _Cursor, worker: int = 0, num_workers: int = 1) -> Iterator[tuple[tuple, tuple, int]]:
        rows, length = self.batch_size, self.seq_len
        span = rows * length  # tokens a batch consumes; it also reads the next one, as the last label
        pending: deque[tuple[np.ndarray, _Cursor]] = deque()
        available, k, skips = 0, 0, Skips(log=worker == 0)
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


class TokenLoader(StreamLoader):
    """Iterates dicts of ``input_ids``, ``labels``, ``position_ids`` (``torch.long``, ``[batch_size, seq_len]``)."""

    def __init__(self, pattern: str, *, seq_len: int, batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, num_workers: int = 0, shuffle: bool = True, shuffle_buffer: int = 1000,
                 epochs: int | None = None, allow_pipe: bool = False, skip_corrupt: bool = False,
                 tokenizer_sha256: str | None = None):
        check_at_least(seq_len=(seq_len, 1), batch_size=(batch_size, 1), world_size=(world_size, 1),
                       num_workers=(num_workers, 0), shuffle_buffer=(shuffle_buffer, 0))
        check_split(rank, world_size, epochs)
        urls = expand_shards(pattern, allow_pipe=allow_pipe)
        if len(urls) < world_size:
            raise ShardError(f"shard pattern {pattern!r} names {len(urls)} shards, fewer than world_size={world_size}:"
                             " every rank needs at least one")
        if tokenizer_sha256 is not None:
            check_tokenizer(urls, tokenizer_sha256)
        super().__init__(num_workers)
        self._stream = _Stream(tuple(urls), recorded_checksums(urls), rank, world_size, seed, shuffle, shuffle_buffer,
                               epochs, skip_corrupt, tokenizer_sha256, seq_len, batch_size)
        self._cursor = _Cursor(0, 0, 0, 0)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        shape = (self._stream.batch_size, self._stream.seq_len)
        for tokens, positions in self._produce():
            yield {"input_ids": torch.from_numpy(tokens[:-1].reshape(shape)),
                   "labels": torch.from_numpy(tokens[1:].reshape(shape).copy()),
                   "position_ids": torch.from_numpy(positions)}
