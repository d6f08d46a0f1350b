"""The mixers' sequence-parallel forms: how each op's recurrent state crosses from one rank's slice to the next.

A mixer on a slice computes the state its slice hands on (its op's ``state of tokens``, from zero), and
``entering_states`` returns, per document of the packed slice, the state it starts from: the fold of the earlier
ranks' states (the op's combine rule) for each row's first document where it continues, the op's empty state for
every other document. ``pretrain.parallel`` holds the collectives; each op module holds its state and combine rule.
"""
from collections.abc import Callable, Sequence

import torch

from ..ops.decayed_linear_attention.state import combine_decayed_states, decayed_state_of_tokens
from ..ops.delta_rule.state import combine_transitions, transition_of_tokens
from ..ops.linear_attention.state import FIELDS, LinearAttentionState, combine_states, state_of_tokens
from ..parallel import SequenceShard, exchange_with_earlier_ranks, slice_layout
from ..parallel.sequence import Combine, SliceLayout


def entering_states(handed_on: Sequence[torch.Tensor], layout: SliceLayout, shard: SequenceShard, combine: Combine,
                    empty: Sequence[float], num_docs: int, *, shared: Sequence[torch.Tensor] = (),
                    first_states: Callable | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``([N, ...] per state field, one row per packed document; [size, ...] per shared tensor)``.

    ``empty`` is each field's value before any token (0 for sums, −∞ for running maxima and log-normalizers).
    """
    entering, shared = exchange_with_earlier_ranks(handed_on, layout, shard, combine, shared=shared,
                                                   first_states=first_states)
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
                          shared: Sequence[torch.Tensor] = (), convolutions: "SliceConvolutions | None" = None,
                          riders: Sequence[torch.Tensor] = ()) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """For an op on a slice (``k``, ``v`` packed ``[1, B·T, ...]``, ``position_ids [B, T]``): the initial state of
    each packed document, from ``state_of(k, v, mask)`` (the state of the masked tokens of each row ``[B, T, ...]``,
    as a list of fields) and the op's ``combine``; and the gathered ``shared`` tensors (followed, with
    ``convolutions``, by the gathered ``convolutions.packet``, which ``convolutions.final`` reads). ``riders``:
    per-token tensors ``[B, T, ...]`` beside k and v that the state reads (the delta rule's β and g), handed to
    ``state_of(k, v, mask, *riders)``; with ``convolutions`` their first tokens travel in the packet too."""
    layout = slice_layout(position_ids)
    rows = position_ids.shape
    first_states = None
    if convolutions is not None:
        first_states = convolutions.first_states_from(len(shared), state_of)
        shared = [*shared, *convolutions.packet(layout.tail, riders)]
    tail = layout.tail if convolutions is None else convolutions.own(layout.tail)
    # only each row's tail makes the state: from the earliest tail start on, so that what ``state_of`` keeps for
    # backward (masked copies of k and v) covers the last documents, not the whole slice
    start = int((~tail).sum(dim=1).min())
    k, v = (x.reshape(*rows, *x.shape[2:])[:, start:] for x in (k, v))
    handed_on = state_of(k, v, tail[:, start:], *(r[:, start:] for r in riders))
    return entering_states(handed_on, layout, shard, combine, empty, num_docs, shared=shared,
                           first_states=first_states)


def linear_attention_entering(k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor, shard: SequenceShard,
                              normalize: str, num_docs: int, *, shared: Sequence[torch.Tensor] = (),
                              convolutions: "SliceConvolutions | None" = None
                              ) -> tuple[LinearAttentionState, list[torch.Tensor]]:
    """``states_entering_slice`` for linear attention: sums, whose empty state is zeros."""

    def state_of(k, v, mask):
        return [field for field in state_of_tokens(k, v, mask, normalize) if field is not None]

    def combine(earlier, later):
        return [field for field in combine_states(LinearAttentionState(*earlier), LinearAttentionState(*later))
                if field is not None]

    fields = len(FIELDS[normalize])
    initial, shared = states_entering_slice(k, v, position_ids, shard, state_of=state_of, combine=combine,
                                            empty=[0.0] * fields, num_docs=num_docs, shared=shared,
                                            convolutions=convolutions)
    return LinearAttentionState(*initial), shared


def decayed_linear_attention_entering(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, position_ids: torch.Tensor,
                                      shard: SequenceShard, num_docs: int, *, value_scale: torch.Tensor | None = None,
                                      convolutions: "SliceConvolutions | None" = None
                                      ) -> tuple[LinearAttentionState, list[torch.Tensor]]:
    """``states_entering_slice`` for decayed linear attention without a normalizer (``g`` rows ``[B, T, H]`` ride
    beside k and v): the state (``S``) per packed document, and the gathered shared tensors. Each slice hands on its
    tail document's ``S`` and total log-decay ``G``, whose empty values are zeros; G is dropped once folded.
    ``value_scale [B, T, H]`` (mamba2's Δ) rides too: the state's values are ``v · value_scale``."""

    def state_of(k, v, mask, g, scale=None):
        state, log_decay = decayed_state_of_tokens(k, v if scale is None else v * scale[..., None], g, mask, "none")
        return [state.S, log_decay]

    def combine(earlier, later):
        state, log_decay = combine_decayed_states((LinearAttentionState(earlier[0]), earlier[1]),
                                                  (LinearAttentionState(later[0]), later[1]))
        return [state.S, log_decay]

    riders = [g] if value_scale is None else [g, value_scale]
    (initial, _), shared = states_entering_slice(k, v, position_ids, shard, state_of=state_of, combine=combine,
                                                 empty=[0.0, 0.0], num_docs=num_docs, convolutions=convolutions,
                                                 riders=riders)
    return LinearAttentionState(initial), shared


class SliceConvolutions:
    """A mixer's short convolutions on a sequence slice, sharing the all-gather that carries the states.

    A token's convolution reads the ``K − 1`` inputs before it, so a slice's first ``K − 1`` tokens read the previous
    rank's last ones (its halo), which arrive only with that all-gather. Before it, the convolutions run with a zero
    halo (``early``: right from token ``K − 1`` on), and the slice hands on the state of its tail without its first
    ``K − 1`` tokens (``own``). Their inputs travel in the packet beside the halo (``packet``), and every rank
    computes every earlier rank's state of them from the gathered copies (``first_states_from``), put in front of
    that rank's state before the fold. After it, ``final`` convolves the first ``K − 1`` tokens again with the real
    halo.

    The mixer says what it convolves and what its state reads of it: ``projections(x)`` (the convolutions' inputs,
    ``[B, T, C_i]`` each), ``convolved(inputs, position_ids, before)``, ``conv_reach`` (``K − 1``) and
    ``keys_values(convolved, position_ids)`` (the k and v that ``state_of`` reads).

    ``remade_riders``: the state's riders are made from the convolved inputs too (rwkv7's, after its token shift), so
    the halo changes them: ``keys_values`` returns them after k and v, and they stay out of the packet.
    """

    def __init__(self, mixer, x: torch.Tensor, position_ids: torch.Tensor, shard: SequenceShard, *,
                 remade_riders: bool = False):
        self.mixer, self.position_ids, self.shard, self.remade_riders = mixer, position_ids, shard, remade_riders
        self.reach = mixer.conv_reach
        self.inputs = mixer.projections(x)
        self.early = mixer.convolved(self.inputs, position_ids)

    def own(self, mask: torch.Tensor) -> torch.Tensor:
        """``mask [B, T]`` without the first ``K − 1`` tokens, whose state the ranks after compute."""
        return mask & (torch.arange(mask.shape[1], device=mask.device) >= self.reach)

    def packet(self, tail: torch.Tensor, riders: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
        """What the all-gather carries: the first and the last ``K − 1`` of each input, and the first tokens'
        positions, whether they belong to the tail (the document the slice hands on) and their ``riders``."""
        first, last = slice(0, self.reach), slice(tail.shape[1] - self.reach, tail.shape[1])
        riders = () if self.remade_riders else riders
        return [*(t[:, first] for t in self.inputs), *(t[:, last] for t in self.inputs),
                self.position_ids[:, first], tail[:, first], *(r[:, first] for r in riders)]

    def first_states_from(self, offset: int, state_of: Callable) -> Callable | None:
        """``exchange_with_earlier_ranks``' ``first_states`` when ``packet`` follows ``offset`` shared tensors: every
        rank's state of its first tokens of its tail, convolved with the halo of the rank before it (rank 0 with its
        own, which its positions never reach: its rows start documents)."""
        if not self.reach:
            return None
        count = len(self.inputs)

        def first_states(gathered: list[torch.Tensor]) -> list[torch.Tensor]:
            packet = gathered[offset:]
            firsts, lasts = packet[:count], packet[count:2 * count]
            positions, tail, riders = packet[2 * count], packet[2 * count + 1], packet[2 * count + 2:]
            size, batch = positions.shape[:2]
            positions = positions.flatten(0, 1).long()
            halos = [torch.cat([last[:1], last[:-1]]).flatten(0, 1) for last in lasts]
            convolved = self.mixer.convolved([first.flatten(0, 1) for first in firsts], positions, halos)
            k, v, *remade = self.mixer.keys_values(convolved, positions)
            fields = state_of(k, v, tail.flatten(0, 1) > 0.5, *remade, *(r.flatten(0, 1) for r in riders))
            return [field.unflatten(0, (size, batch)) for field in fields]

        return first_states

    def final(self, gathered_packet: list[torch.Tensor]) -> list[torch.Tensor]:
        """The inputs convolved with the previous rank's halo (each shaped as in ``early``), from the gathered
        ``packet``: the first ``K − 1`` tokens again, the others as ``early`` has them (no tap of theirs reaches the
        halo), so the convolutions run over the whole slice once."""
        if not self.reach:
            return self.early
        count = len(self.inputs)
        halos = [from_previous_rank(last, self.shard) for last in gathered_packet[count:2 * count]]
        first = self.mixer.convolved([t[:, :self.reach] for t in self.inputs], self.position_ids[:, :self.reach],
                                     halos)
        return [torch.cat([head, rest[:, self.reach:]], dim=1) for head, rest in zip(first, self.early)]


def transition_entering(k: torch.Tensor, v: torch.Tensor, riders: Sequence[torch.Tensor], position_ids: torch.Tensor,
                        shard: SequenceShard, num_docs: int, *, chunk_size: int,
                        transition: Callable = transition_of_tokens, convolutions: "SliceConvolutions | None" = None
                        ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``states_entering_slice`` for the delta rule and the DPLR rule (``riders``, rows ``[B, T, ...]``, ride beside k
    and v: the delta rule's β and g, the DPLR rule's a, b and g): the state per packed document ``[N, H, D, Dv]``, and
    the gathered shared tensors.

    What a slice hands on is the pair ``(S, M)``, the map ``S_in ↦ M S_in + S`` of its tail
    (``ops/delta_rule/state.py``), and pairs compose as maps. Only ``S`` enters the op: ``M`` of the empty state (the
    identity) is never read, so both fills are 0. ``transition(k, v, *riders, mask, chunk_size=…)`` makes the pair:
    the delta rule's by default, a mixer's own for other transitions of this kind (``kda``'s, per-channel ``g``;
    ``rwkv7``'s, ``ops/dplr/state.py``).
    """

    def state_of(k, v, mask, *riders):
        return list(transition(k, v, *riders, mask, chunk_size=chunk_size))

    (initial, _), shared = states_entering_slice(k, v, position_ids, shard, state_of=state_of,
                                                 combine=combine_transitions, empty=[0.0, 0.0], num_docs=num_docs,
                                                 convolutions=convolutions, riders=riders)
    return initial, shared
