"""Scoring documents with a causal LM: the one definition of validation loss, shared by the LM task (validation
and its training loss, ``batch_nll``) and ``tools/eval_ppl.py``.

Every token of every document (its final end-of-sequence included) is scored exactly once. The first token is
predicted from a lone ``eos`` (the end of "the previous document"), as in a packed training stream. A document
longer than ``seq_len`` is cut into windows that start every ``stride`` tokens; each window scores only the
targets that the previous window did not, so with ``stride < seq_len`` later windows keep some context.
Windows of several documents share a row as separate segments (positions restart at 0), exactly as packed
training rows do. Asked ``by_position``, the loss is also kept per document position of the target, in doubling
buckets (0, 1, 2–3, 4–7, …): whether later tokens, with more context, are predicted better.
"""
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from pretrain.distributed.lockstep import until_every_rank_is_done
from pretrain.parallel import SequenceShard, shard_rows

IGNORE = -100
POSITION_BUCKETS = 48  # bucket b ≥ 1 holds document positions 2^(b−1) … 2^b − 1; bucket 0 the first token


def document_windows(tokens: np.ndarray, *, seq_len: int, stride: int, eos_id: int
                     ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """``(input_ids, position_ids, targets, target_positions)`` windows of at most ``seq_len`` inputs; unscored
    targets are IGNORE; ``target_positions`` is each target's position in the document."""
    if not 0 < stride <= seq_len:
        raise ValueError(f"stride must be in 1..seq_len={seq_len}, got {stride}")
    stream = np.concatenate([[eos_id], np.asarray(tokens, dtype=np.int64)])
    n = len(stream) - 1  # number of targets
    scored_until, start = 0, 0
    while scored_until < n:
        end = min(start + seq_len, n)
        inputs, targets = stream[start:end], stream[start + 1:end + 1].copy()
        targets[: max(0, scored_until - start)] = IGNORE
        if start == 0:  # the lone eos is its own segment; the document starts at position 0 after it
            positions = np.concatenate([[0], np.arange(end - 1)])
        else:
            positions = np.arange(end - start)
        yield inputs, positions, targets, np.arange(start, end)
        scored_until, start = end, start + stride


def packed_rows(documents: Iterable[np.ndarray], *, seq_len: int, stride: int, eos_id: int
                ) -> Iterator[tuple[np.ndarray, ...]]:
    """Windows packed greedily into rows of exactly ``seq_len`` tokens; the padding is one unscored segment."""
    parts: list[tuple[np.ndarray, ...]] = []
    used = 0

    def flush():
        pad = seq_len - used
        pieces = parts + [(np.zeros(pad, np.int64), np.arange(pad), np.full(pad, IGNORE), np.zeros(pad, np.int64))]
        return tuple(np.concatenate(column) for column in zip(*pieces))

    for tokens in documents:
        for window in document_windows(tokens, seq_len=seq_len, stride=stride, eos_id=eos_id):
            if used + len(window[0]) > seq_len:
                yield flush()
                parts, used = [], 0
            parts.append(window)
            used += len(window[0])
    if parts:
        yield flush()


def batches(rows: Iterable[tuple[np.ndarray, ...]], batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
    chunk = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == batch_size:
            yield _stack(chunk)
            chunk = []
    if chunk:
        yield _stack(chunk)


def _stack(rows) -> dict[str, torch.Tensor]:
    inputs, positions, targets, target_positions = (torch.from_numpy(np.stack(column)).long() for column in zip(*rows))
    return {"input_ids": inputs, "position_ids": positions, "labels": targets, "target_positions": target_positions}


def empty_batch(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """A batch that scores nothing: ranks with fewer batches run it so collective (ZeRO-3) forwards stay matched."""
    return {"input_ids": torch.zeros(batch_size, seq_len, dtype=torch.long),
            "position_ids": torch.arange(seq_len).expand(batch_size, seq_len).contiguous(),
            "labels": torch.full((batch_size, seq_len), IGNORE, dtype=torch.long),
            "target_positions": torch.zeros(batch_size, seq_len, dtype=torch.long)}


def batch_nll(model: Callable, batch: dict[str, torch.Tensor], device: torch.device,
              by_position: torch.Tensor | None = None, sequence: SequenceShard | None = None
              ) -> tuple[torch.Tensor, int]:
    """Summed negative log-likelihood (fp32) of the batch's scored targets, and how many there are.

    With ``by_position`` (``[POSITION_BUCKETS, 2]`` float64, no autograd), each scored token's NLL and a count of 1
    are also added to the bucket of its ``target_positions``. With ``sequence``, only this rank's slice of the rows
    is scored (the ranks of the group together score the whole batch).
    """
    if sequence is not None:
        batch = shard_rows(batch, sequence)
    count = int((batch["labels"] != IGNORE).sum())  # counted where the batch was made: no wait on the device
    labels = batch["labels"].to(device)
    input_ids, position_ids = batch["input_ids"].to(device), batch["position_ids"].to(device)
    if by_position is None:
        return model(input_ids, position_ids=position_ids, labels=labels), count
    token_nll = model(input_ids, position_ids=position_ids, labels=labels, reduction="none")
    scored = labels != IGNORE
    bucket = position_bucket(batch["target_positions"].to(device)[scored])
    by_position.index_add_(0, bucket, torch.stack([token_nll[scored].double(), torch.ones_like(bucket).double()], 1))
    return token_nll.sum(), count


def position_bucket(positions: torch.Tensor) -> torch.Tensor:
    """The bucket of each document position: 0 for 0, then ``b`` for ``2^(b−1) ≤ position < 2^b``."""
    return torch.where(positions > 0, torch.log2(positions.clamp(min=1).double()).floor().long() + 1, 0)


class Scores(NamedTuple):
    """Totals over every rank: NLL (nats) and scored tokens; ``by_position``, when asked for, ``[POSITION_BUCKETS,
    2]`` (NLL, tokens) per bucket of target positions (see ``position_bucket``)."""

    nll: float
    tokens: int
    by_position: torch.Tensor | None = None


@torch.no_grad()
def score_documents(model: Callable, documents: Iterable[np.ndarray], *, seq_len: int, stride: int, batch_size: int,
                    eos_id: int, device: torch.device, max_batches: int | None = None, progress=None,
                    by_position: bool = False, sequence: SequenceShard | None = None) -> Scores:
    """Total NLL and scored-token count over ``documents`` (at most ``max_batches`` batches of this rank's).

    Under a process group every rank passes its own share of documents and gets the totals over all ranks; ranks
    with fewer batches run empty ones, since a ZeRO-3 forward is a collective call. With ``sequence``, the ranks of
    a sequence-parallel group pass the same documents and each scores its slice of every row.
    """
    local = islice(batches(packed_rows(documents, seq_len=seq_len, stride=stride, eos_id=eos_id), batch_size),
                   max_batches)
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # on the device: nccl reduces only there
    buckets = torch.zeros(POSITION_BUCKETS, 2, dtype=torch.float64, device=device) if by_position else None
    for batch in until_every_rank_is_done(local, device):
        batch = batch if batch is not None else empty_batch(batch_size, seq_len)
        nll, scored = batch_nll(model, batch, device, buckets, sequence)
        totals += torch.stack([nll.double(), torch.tensor(scored, dtype=torch.float64, device=device)])
        if progress is not None:
            progress.update(scored)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals)
        if buckets is not None:
            dist.all_reduce(buckets)
    return Scores(totals[0].item(), int(totals[1].item()), None if buckets is None else buckets.cpu())
