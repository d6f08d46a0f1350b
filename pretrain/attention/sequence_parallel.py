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
                          shared: Sequence[torch.Tensor] = (), convolutions: "SliceConvolutions | None" = None
                          ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """For an op on a slice (``k``, ``v`` packed ``[1, B·T, ...]``, ``position_ids [B, T]``): the initial state of
    each packed document, from ``state_of(k, v, mask)`` (the state of the masked tokens of each row ``[B, T, ...]``,
    as a list of fields) and the op's ``combine``; and the gathered ``shared`` tensors (followed, with
    ``convolutions``, by the gathered ``convolutions.packet``, which ``convolutions.final`` reads)."""
    layout = slice_layout(position_ids)
    rows = position_ids.shape
    first_states = None
    if convolutions is not None:
        first_states = convolutions.first_states_from(len(shared), state_of)
        shared = [*shared, *convolutions.packet(layout.tail)]
    tail = layout.tail if convolutions is None else convolutions.own(layout.tail)
    handed_on = state_of(k.reshape(*rows, *k.shape[2:]), v.reshape(*rows, *v.shape[2:]), tail)
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

    def packet(self, tail: torch.Tensor) -> list[torch.Tensor]:
        """What the all-gather carries: the first and the last ``K − 1`` inputs of q, k and v, and the first tokens'
        positions and whether they belong to the tail (the document the slice hands on)."""
        first, last = slice(0, self.reach), slice(tail.shape[1] - self.reach, tail.shape[1])
        return [*(t[:, first] for t in self.inputs), *(t[:, last] for t in self.inputs),
                self.position_ids[:, first], tail[:, first]]

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
            fields = state_of(k, v, packet[7].flatten(0, 1) > 0.5)
            return [field.unflatten(0, (size, batch)) for field in fields]

        return first_states

    def final(self, gathered_packet: list[torch.Tensor]) -> list[torch.Tensor]:
        """q, k, v ``[B, T, C]`` convolved with the previous rank's halo, from the gathered ``packet``."""
        if not self.reach:
            return self.early
        halos = [from_previous_rank(last, self.shard) for last in gathered_packet[3:6]]
        return self.mixer.convolved(self.inputs, self.position_ids, halos)
