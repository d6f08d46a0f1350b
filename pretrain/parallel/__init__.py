"""Splitting one sequence across ranks: the collectives and the slice bookkeeping the mixers' distributed forms use.

Below the mixers in the import order (ops → parallel → attention): it knows tensors and process groups, no module.
"""
from .sequence import (SequenceShard, all_gather_with_grad, exchange_with_earlier_ranks, gather_positions,
                       shard_rows, slice_layout)

__all__ = ["SequenceShard", "all_gather_with_grad", "exchange_with_earlier_ranks", "gather_positions",
           "shard_rows", "slice_layout"]
