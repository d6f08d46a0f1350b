"""Evaluation in lockstep: ranks holding different amounts of data keep taking part until every one is done."""
from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch
import torch.distributed as dist

Batch = TypeVar("Batch")


def until_every_rank_is_done(batches: Iterable[Batch], device: torch.device) -> Iterator[Batch | None]:
    """This rank's batches, then ``None`` for as long as another rank still has one.

    A ZeRO-3 forward gathers the weights from every rank, a collective call, so a rank out of data must go on
    running forwards (on an empty or blank batch, for ``None``) until all are out. One small all-reduce per batch
    says whether any rank has one left. Without a process group: just the batches.
    """
    distributed = dist.is_available() and dist.is_initialized()
    batches = iter(batches)
    while True:
        batch = next(batches, None)
        more = torch.tensor(batch is not None, dtype=torch.int32, device=device)  # on the device: nccl needs it
        if distributed:
            dist.all_reduce(more, op=dist.ReduceOp.MAX)
        if not more:
            return
        yield batch
