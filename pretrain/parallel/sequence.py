"""Sequence parallelism: the N ranks of a group hold one batch of rows as N contiguous slices of every row.

A linear-time mixer needs, of the tokens before its slice, only the fixed-size recurrent state of the document
running into it (LASP-2, arXiv 2502.07563). Each rank computes the state its slice hands on, from zero; one
all-gather per layer shares them; rank r folds those of ranks 0 … r−1 with the mixer's combine rule, starting afresh
at every slice where a document began, into the state its first document starts from. Backward needs no code of its
own: the all-gather's backward hands every rank the summed gradient of its own slot, which autograd carries on into
the tokens that made the state.

Document boundaries stay global: ``position_ids`` count from each document's start, so a slice whose first position
is not 0 continues a document begun on an earlier rank.
"""
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SequenceShard:
    """This rank's place in its sequence-parallel group: slice ``rank`` of ``size``, in sequence order."""

    group: Any
    rank: int
    size: int

    def slice(self, length: int) -> slice:
        """The positions of this rank's slice in a row of ``length`` tokens."""
        if length % self.size:
            raise ValueError(f"a row of {length} tokens does not split into {self.size} equal sequence slices")
        part = length // self.size
        return slice(self.rank * part, (self.rank + 1) * part)


def shard_rows(batch: dict[str, torch.Tensor], shard: SequenceShard) -> dict[str, torch.Tensor]:
    """Every ``[B, T]`` tensor of ``batch`` cut to this rank's slice of the rows (contiguous, for the collectives)."""
    return {key: value[:, shard.slice(value.shape[1])].contiguous() for key, value in batch.items()}


class _AllGather(torch.autograd.Function):
    """``[size, *x.shape]``: every rank's ``x``; backward: this rank's slot of the gradients summed over ranks."""

    @staticmethod
    def forward(ctx, x, shard: SequenceShard):
        ctx.shard = shard
        flat = x.contiguous().view(-1)
        out = flat.new_empty(shard.size * flat.numel())  # flat: gloo refuses a stacked [size, n] output
        dist.all_gather_single(out, flat, group=shard.group)
        return out.view(shard.size, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        shard = ctx.shard
        grad = grad.contiguous()
        if dist.get_backend(shard.group) == "nccl":
            mine = grad.new_empty(grad.shape[1:])
            dist.reduce_scatter_single(mine, grad.view(-1), group=shard.group)
            return mine, None
        dist.all_reduce(grad, group=shard.group)  # gloo has no reduce-scatter; states are small
        return grad[shard.rank], None


def all_gather_with_grad(x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """Every rank's ``x`` as ``[size, *x.shape]``, differentiable. Every rank must use the result in its loss's
    graph (a zero-weighted use is enough): backward is a collective that all ranks must enter."""
    return _AllGather.apply(x, shard)


@torch.no_grad()
def gather_positions(position_ids: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """The whole rows' ``[B, N·T]`` position ids from every rank's ``[B, T]`` slice."""
    gathered = position_ids.new_empty(shard.size * position_ids.numel())
    dist.all_gather_single(gathered, position_ids.contiguous().view(-1), group=shard.group)
    return gathered.view(shard.size, *position_ids.shape).permute(1, 0, 2).reshape(position_ids.shape[0], -1)


@dataclass(frozen=True)
class SliceLayout:
    """Where the documents of a rank's ``[B, T]`` slice begin and end, from its position ids."""

    continues: torch.Tensor  # [B] bool: the first token's document began on an earlier rank
    resets: torch.Tensor     # [B] bool: a document begins inside the slice, so earlier slices stop mattering past it
    tail: torch.Tensor       # [B, T] bool: the tokens of the document running to the slice's end (what it hands on)
    first_doc: torch.Tensor  # [B] long: each row's first document in the packed layout (cu_seqlens over B·T)


def slice_layout(position_ids: torch.Tensor | None) -> SliceLayout:
    if position_ids is None:
        raise ValueError("a mixer on a sequence slice needs position_ids (each token's position in its document): "
                         "without them a slice cannot tell whether its first document began on an earlier rank")
    starts = position_ids == 0
    index = torch.arange(position_ids.shape[1], device=position_ids.device)
    last_start = torch.where(starts, index, 0).amax(dim=1)
    docs_per_row = (starts | (index == 0)).sum(dim=1)  # a row start always opens a document of the packed layout
    return SliceLayout(continues=~starts[:, 0], resets=starts.any(dim=1), tail=index >= last_start[:, None],
                       first_doc=docs_per_row.cumsum(0) - docs_per_row)


Combine = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], Sequence[torch.Tensor]]


def exchange_with_earlier_ranks(handed_on: Sequence[torch.Tensor], layout: SliceLayout, shard: SequenceShard,
                                combine: Combine, *, shared: Sequence[torch.Tensor] = (),
                                handed_to_next: Sequence[torch.Tensor] = (),
                                first_states: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None
                                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One all-gather of what each rank hands on: the fields of its slice's final state (each ``[B, ...]``, computed
    from zero) and ``shared`` tensors (e.g. its last few tokens, a halo).

    Returns the state entering this slice — the fold of ranks 0 … rank−1 with ``combine(earlier, later)``, starting
    afresh at every rank where a document began (rank 0 gets its own state, unused: its rows start documents) — and
    every rank's copy of each ``shared`` tensor, ``[size, ...]``. ``handed_to_next``, when given, is what a rank's
    right neighbour takes instead of its full state (a state without the halo that travels as tokens); ranks further
    right still take the full one. ``first_states``, when given, maps the gathered ``shared`` tensors to the state
    of every rank's first tokens (``[size, B, ...]`` per field), which the ranks left out of what they handed on
    because those tokens read the rank before them (a short convolution's halo): it is put in front of each rank's
    state before the fold. Callers must use the state only where ``layout.continues``, and use it (zero-weighted
    elsewhere) on every rank: backward is collective.
    """
    parts = [*handed_on, *handed_to_next, *shared, layout.resets]
    dtype = torch.float32
    for part in parts:
        if part.is_floating_point():
            dtype = torch.promote_types(dtype, part.dtype)
    packet = torch.cat([part.reshape(-1).to(dtype) for part in parts])
    gathered = all_gather_with_grad(packet, shard)
    sizes = [part.numel() for part in parts]
    fields = [piece.view(shard.size, *part.shape).to(part.dtype if part.is_floating_point() else dtype)
              for piece, part in zip(gathered.split(sizes, dim=1), parts)]
    count = len(handed_on)
    states, to_next = fields[:count], fields[count:count + len(handed_to_next)] or fields[:count]
    halos, resets = fields[count + len(handed_to_next):-1], fields[-1] > 0.5

    firsts = first_states(halos) if first_states is not None else None

    def handed_on_by(j: int) -> list[torch.Tensor]:
        state = [field[j] for field in (to_next if j == shard.rank - 1 else states)]
        return state if firsts is None else list(combine([field[j] for field in firsts], state))

    entering = handed_on_by(0)
    for j in range(1, shard.rank):
        later = handed_on_by(j)
        merged = combine(entering, later)
        entering = [torch.where(_rows(resets[j], fresh), fresh, old) for fresh, old in zip(later, merged)]
    return entering, halos


def _rows(flags: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[B]`` flags shaped to broadcast against ``like [B, ...]``."""
    return flags.view(-1, *([1] * (like.dim() - 1)))
