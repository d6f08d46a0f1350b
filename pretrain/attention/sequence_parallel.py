"""The mixers' sequence-parallel forms: how each op's recurrent state crosses from one rank's slice to the next.

A mixer on a slice computes the state its slice hands on (its op's ``state of tokens``, from zero), and
``entering_states`` returns, per document of the packed slice, the state it starts from: the fold of the earlier
ranks' states (the op's combine rule) for each row's first document where it continues, the op's empty state for
every other document. ``pretrain.parallel`` holds the collectives; each op module holds its state and combine rule.
"""
from collections.abc import Callable, Sequence

import torch

from ..ops.decayed_linear_attention.state import combine_decayed_states, decayed_state_of_tokens, log_decay_after
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
                                      shard: SequenceShard, normalize: str, num_docs: int, *,
                                      shared: Sequence[torch.Tensor] = ()
                                      ) -> tuple[LinearAttentionState, list[torch.Tensor]]:
    """``states_entering_slice`` for decayed linear attention (g packed ``[1, B·T, H]`` like k): each slice hands on
    its tail document's state and total log-decay, whose empty values are zeros; the log-decay is dropped once
    folded."""
    rows = position_ids.shape
    g_rows = g.reshape(*rows, g.shape[-1])
    fields = len(FIELDS[normalize])

    def state_of(k, v, mask):
        state, log_decay = decayed_state_of_tokens(k, v, g_rows, mask, normalize)
        return [*state[:fields], log_decay]

    def combine(earlier, later):
        state, log_decay = combine_decayed_states((LinearAttentionState(*earlier[:-1]), earlier[-1]),
                                                  (LinearAttentionState(*later[:-1]), later[-1]))
        return [*state[:fields], log_decay]

    initial, shared = states_entering_slice(k, v, position_ids, shard, state_of=state_of, combine=combine,
                                            empty=[0.0] * (fields + 1), num_docs=num_docs, shared=shared)
    return LinearAttentionState(*initial[:-1]), shared



def decayed_conv_entering(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, features: torch.Tensor,
                          position_ids: torch.Tensor, shard: SequenceShard, num_docs: int, *, halo: int,
                          head_keys_values: Callable, head_extras: Sequence[torch.Tensor] = ()
                          ) -> tuple[LinearAttentionState, torch.Tensor]:
    """``decayed_linear_attention_entering`` (``normalize="none"``) for a mixer whose keys and values come out of a
    causal convolution reaching ``halo`` tokens back over ``features [B, T, C]``; k, v, g packed ``[1, B·T, ...]``,
    computed with zeros before the slice. Returns the initial state of each packed document and ``before
    [B, halo, C]``, the previous slice's last features (zeros where the row's first document starts here), with
    which the mixer recomputes its first ``halo`` tokens.

    The halo travels in the states' packet, one all-gather: a slice hands on its state *without* the first tokens
    whose convolution reaches back into the previous slice (their k, v here are wrong), and sends those tokens'
    features, positions, ``head_extras`` (per-token inputs ``[B, T, ...]`` of ``head_keys_values`` besides the
    features) and weights ``exp(log-decay after them)``, beside its last ``halo`` features. Folding the slices in
    order, a rank recomputes each earlier slice's missing tokens with
    ``head_keys_values(features, before, positions, *extras) -> (k, v) [B, halo, H, *]`` from the halo of the
    slice before it, and adds them to that slice's state before the combine rule. A slice whose tail document
    begins inside it has no such tokens, so the fold's restart there needs no correction.
    """
    if halo == 0:
        return decayed_linear_attention_entering(k, v, g, position_ids, shard, "none", num_docs)[0], features[:, :0]
    layout = slice_layout(position_ids)
    rows, head = position_ids.shape, slice(0, halo)
    k, v, g = (t.reshape(*rows, *t.shape[2:]) for t in (k, v, g))
    reaches_back = (position_ids[:, head] > torch.arange(halo, device=k.device)) & layout.tail[:, head]
    keep = torch.cat([~reaches_back, reaches_back.new_ones(rows[0], rows[1] - halo)], dim=1)
    state, log_decay = decayed_state_of_tokens(k * keep[..., None, None], v, g, layout.tail, "none")
    weights = log_decay_after(g.to(state.S.dtype), layout.tail)[:, head].exp() * reaches_back[..., None]
    handed_on = [state.S, log_decay, features[:, rows[1] - halo:], features[:, head], position_ids[:, head],
                 *(extra[:, head] for extra in head_extras), weights]

    def combine(earlier, later):
        S, log_decay, before = earlier[:3]
        S_later, log_decay_later, _, features, positions, *extras, weights = later
        k, v = head_keys_values(features, before, positions.round().long(), *extras)
        S_later = S_later + torch.einsum("bth,bthk,bthv->bhkv", weights, k.to(weights.dtype), v.to(weights.dtype))
        S = combine_decayed_states((LinearAttentionState(S), log_decay),
                                   (LinearAttentionState(S_later), log_decay_later))[0].S
        return [S, log_decay + log_decay_later, *later[2:]]

    initial, _ = entering_states(handed_on, layout, shard, combine, [0.0] * len(handed_on), num_docs)
    return LinearAttentionState(initial[0]), initial[2][layout.first_doc]


class SliceConvolutions:
    """A mixer's short convolutions of q, k, v on a sequence slice, sharing the all-gather that carries the states.

    A token's convolution reads the ``K − 1`` inputs before it, so a slice's first ``K − 1`` tokens read the previous
    rank's last ones (its halo), which arrive only with that all-gather. Before it, the convolutions run with a zero
    halo (``early``: right from token ``K − 1`` on), and the slice hands on the state of its tail without its first
    ``K − 1`` tokens (``own``). Their inputs travel in the packet beside the halo (``packet``), and every rank
    computes every earlier rank's state of them from the gathered copies (``first_states_from``), put in front of
    that rank's state before the fold. After it, ``final`` runs the convolutions again with the real halo.
    """

    def __init__(self, mixer, x: torch.Tensor, position_ids: torch.Tensor, shard: SequenceShard):
        self.mixer, self.position_ids, self.shard = mixer, position_ids, shard
        self.reach = max(mixer.short_conv - 1, 0)
        self.inputs = mixer.projections(x)
        self.early = mixer.convolved(self.inputs, position_ids)

    def own(self, mask: torch.Tensor) -> torch.Tensor:
        """``mask [B, T]`` without the first ``K − 1`` tokens, whose state the ranks after compute."""
        return mask & (torch.arange(mask.shape[1], device=mask.device) >= self.reach)

    def packet(self, tail: torch.Tensor, riders: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
        """What the all-gather carries: the first and the last ``K − 1`` inputs of q, k and v, and the first tokens'
        positions, whether they belong to the tail (the document the slice hands on) and their ``riders``."""
        first, last = slice(0, self.reach), slice(tail.shape[1] - self.reach, tail.shape[1])
        return [*(t[:, first] for t in self.inputs), *(t[:, last] for t in self.inputs),
                self.position_ids[:, first], tail[:, first], *(r[:, first] for r in riders)]

    def first_states_from(self, offset: int, state_of: Callable) -> Callable | None:
        """``exchange_with_earlier_ranks``' ``first_states`` when ``packet`` follows ``offset`` shared tensors: every
        rank's state of its first tokens of its tail, convolved with the halo of the rank before it (rank 0 with its
        own, which its positions never reach: its rows start documents)."""
        if not self.reach:
            return None

        def first_states(gathered: list[torch.Tensor]) -> list[torch.Tensor]:
            packet = gathered[offset:]
            size, batch = packet[0].shape[:2]
            halos = [torch.cat([last[:1], last[:-1]]).flatten(0, 1) for last in packet[3:6]]
            convolved = self.mixer.convolved([first.flatten(0, 1) for first in packet[:3]],
                                             packet[6].flatten(0, 1).long(), halos)
            _, k, v = self.mixer.features(*self.mixer.split(convolved))
            fields = state_of(k, v, packet[7].flatten(0, 1) > 0.5, *(r.flatten(0, 1) for r in packet[8:]))
            return [field.unflatten(0, (size, batch)) for field in fields]

        return first_states

    def final(self, gathered_packet: list[torch.Tensor]) -> list[torch.Tensor]:
        """q, k, v ``[B, T, C]`` convolved with the previous rank's halo, from the gathered ``packet``."""
        if not self.reach:
            return self.early
        halos = [from_previous_rank(last, self.shard) for last in gathered_packet[3:6]]
        return self.mixer.convolved(self.inputs, self.position_ids, halos)


def delta_rule_entering(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None,
                        position_ids: torch.Tensor, shard: SequenceShard, num_docs: int, *, chunk_size: int,
                        convolutions: "SliceConvolutions | None" = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``states_entering_slice`` for the delta rule (``beta``, ``g`` rows ``[B, T, H]`` ride beside k and v): the
    state per packed document ``[N, H, D, Dv]``, and the gathered shared tensors.

    What a slice hands on is the pair ``(S, M)``, the map ``S_in ↦ M S_in + S`` of its tail
    (``ops/delta_rule/state.py``), and pairs compose as maps. Only ``S`` enters the op: ``M`` of the empty state (the
    identity) is never read, so both fills are 0.
    """

    def state_of(k, v, mask, beta, g):
        return list(transition_of_tokens(k, v, beta, g, mask, chunk_size=chunk_size))

    riders = [beta, torch.zeros_like(beta) if g is None else g]
    (initial, _), shared = states_entering_slice(k, v, position_ids, shard, state_of=state_of,
                                                 combine=combine_transitions, empty=[0.0, 0.0], num_docs=num_docs,
                                                 convolutions=convolutions, riders=riders)
    return initial, shared
