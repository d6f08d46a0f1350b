"""The mixers' sequence-parallel forms: how each op's recurrent state crosses from one rank's slice to the next.

A mixer on a slice computes the state its slice hands on (its op's ``state of tokens``, from zero), and
``entering_states`` returns, per document of the packed slice, the state it starts from: the fold of the earlier
ranks' states (the op's combine rule) for each row's first document where it continues, the op's empty state for
every other document. ``pretrain.parallel`` holds the collectives; each op module holds its state and combine rule.
"""
from collections.abc import Callable, Sequence

import torch

from ..ops.delta_rule import delta_rule
from ..ops.delta_rule.state import combine_transitions, transition_of_tokens
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
    handed_on = state_of(k.reshape(*rows, *k.shape[2:]), v.reshape(*rows, *v.shape[2:]), layout.tail)
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


def delta_rule_entering(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None,
                        position_ids: torch.Tensor, shard: SequenceShard, num_docs: int, *, inputs: torch.Tensor,
                        halo: int, features: Callable, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule's initial state per packed document of the slice ``[N, H, D, Dv]``, and the ``halo`` inputs
    before each row ``[B, halo, C']`` for its short convolution; one all-gather.

    ``k, v [B, T, H, *]`` are the slice's features made without a halo, ``beta, g [B, T, H]``, ``inputs [B, T, C']``
    the convolution's inputs, ``features(inputs, before, positions) → (k, v)`` the mixer's convolution and norms.
    A row's first ``halo`` tokens of a document begun earlier need the previous rank's last inputs, so each rank hands
    on the pair ``(S, M)`` of its tail document without them, its first ``halo`` inputs (with β, g and positions) and
    its last ``halo`` inputs; folding rank j, a later rank makes j's first tokens from j−1's last inputs, steps the
    state through them, then applies j's pair. Only ``S`` enters the op: ``M`` of the empty state (the identity) is
    never read, so every field's fill is 0.
    """
    layout = slice_layout(position_ids)
    if g is None:
        g = torch.zeros_like(beta)
    offsets = torch.arange(position_ids.shape[1], device=position_ids.device)
    local = layout.tail & ((offsets >= halo)[None] | layout.resets[:, None])  # features exact without a halo
    S, M = transition_of_tokens(k, v, beta, g, local, chunk_size=chunk_size)
    lead = [inputs[:, :halo], beta[:, :halo], g[:, :halo], position_ids[:, :halo]]

    def then_slice(earlier, later):
        """The state after ``earlier``'s slice, carried through ``later``'s (its last inputs ride along)."""
        S_e, M_e, last_e = earlier[:3]
        S_l, M_l, last_l, lead_inputs, lead_beta, lead_g, lead_positions = later
        S_mid = S_e
        if halo:
            lead_k, lead_v = features(lead_inputs, last_e, lead_positions.long())
            _, S_mid = delta_rule(lead_k, lead_k, lead_v, lead_beta, lead_g, initial_state=S_e,
                                  output_final_state=True, impl="recurrent")
        return [*combine_transitions((S_mid, M_e), (S_l, M_l)), last_l, *later[3:]]

    fields, _ = entering_states([S, M, inputs[:, inputs.shape[1] - halo:], *lead], layout, shard, then_slice,
                                [0.0] * 7, num_docs)
    return fields[0], fields[2][layout.first_doc]
