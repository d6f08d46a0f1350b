"""The mixers' sequence-parallel forms: how each op's recurrent state crosses from one rank's slice to the next.

A mixer on a slice computes the state its slice hands on (its op's ``state of tokens``, from zero), and
``entering_states`` returns, per document of the packed slice, the state it starts from: the fold of the earlier
ranks' states (the op's combine rule) for each row's first document where it continues, the op's empty state for
every other document. ``pretrain.parallel`` holds the collectives; each op module holds its state and combine rule.
"""
from collections.abc import Callable, Sequence

import torch

from ..ops.linear_attention.state import FIELDS, LinearAttentionState, combine_states, state_of_tokens
from ..parallel import SequenceShard, exchange_with_earlier_ranks, slice_layout
from ..parallel.sequence import Combine, SliceLayout


def entering_states(handed_on: Sequence[torch.Tensor], layout: SliceLayout, shard: SequenceShard, combine: Combine,
                    empty: Sequence[float], num_docs: int, *, shared: Sequence[torch.Tensor] = ()
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``([N, ...] per state field, one row per packed document; [size, ...] per shared tensor)``.

    ``empty`` is each field's value before any token (0 for sums, −∞ for running maxima and log-normalizers).
    """
    entering, shared = exchange_with_earlier_ranks(handed_on, layout, shard, combine, shared=shared)
    per_document = []
    for field, fill in zip(entering, empty):
        continues = layout.continues.view(-1, *([1] * (field.dim() - 1)))
        first = torch.where(continues, field, torch.full_like(field, fill))
        per_document.append(field.new_full((num_docs, *field.shape[1:]), fill).index_copy(0, layout.first_doc, first))
    return per_document, shared


def from_previous_rank(gathered: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """Rank r−1's copy of a shared tensor (rank 0 gets its own, which its masks never read: its rows start
    documents)."""
    return gathered[max(shard.rank - 1, 0)]


def states_entering_slice(k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor, shard: SequenceShard, *,
                          state_of: Callable, combine: Combine, empty: Sequence[float], num_docs: int,
                          shared: Sequence[torch.Tensor] = ()) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """For an op on a slice (``k``, ``v`` packed ``[1, B·T, ...]``, ``position_ids [B, T]``): the initial state of
    each packed document, from ``state_of(k, v, mask)`` (the state of the masked tokens of each row ``[B, T, ...]``,
    as a list of fields) and the op's ``combine``; and the gathered ``shared`` tensors."""
    layout = slice_layout(position_ids)
    rows = position_ids.shape
    # only each row's tail makes the state: from the earliest tail start on, so that what ``state_of`` keeps for
    # backward (masked copies of k and v) covers the last documents, not the whole slice
    start = int((~layout.tail).sum(dim=1).min())
    k, v = (x.reshape(*rows, *x.shape[2:])[:, start:] for x in (k, v))
    handed_on = state_of(k, v, layout.tail[:, start:])
    return entering_states(handed_on, layout, shard, combine, empty, num_docs, shared=shared)


def linear_attention_entering(k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor, shard: SequenceShard,
                              normalize: str, num_docs: int, *, shared: Sequence[torch.Tensor] = ()
                              ) -> tuple[LinearAttentionState, list[torch.Tensor]]:
    """``states_entering_slice`` for linear attention: sums, whose empty state is zeros."""

    def state_of(k, v, mask):
        return [field for field in state_of_tokens(k, v, mask, normalize) if field is not None]

    def combine(earlier, later):
        return [field for field in combine_states(LinearAttentionState(*earlier), LinearAttentionState(*later))
                if field is not None]

    fields = len(FIELDS[normalize])
    initial, shared = states_entering_slice(k, v, position_ids, shard, state_of=state_of, combine=combine,
                                            empty=[0.0] * fields, num_docs=num_docs, shared=shared)
    return LinearAttentionState(*initial), shared
