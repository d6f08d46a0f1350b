"""The causal AFT prefix state ``(num, den, max)`` per channel, and how two of them combine: what a
sequence-parallel rank hands to the ranks after it.
"""
import torch

from ..precision import finite_or_zero, upcast


def aft_state(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The prefix state ``(num, den, max)`` ``[B, C]`` that the tokens of ``k``, ``v [B, T, C]`` where ``mask [B, T]``
    leave, from nothing: ``num = Σ e^{K − max} V``, ``den = Σ e^{K − max}``, ``max`` the largest key per channel. A
    row with no token leaves the empty state ``(0, 0, −∞)``."""
    k, v = upcast(k, v)
    keys = k.masked_fill(~mask[..., None], float("-inf"))
    top = keys.amax(dim=1)
    weights = torch.exp(keys - finite_or_zero(top)[:, None])
    return (weights * v).sum(1), weights.sum(1), top


def combine_aft_states(earlier, later) -> tuple[torch.Tensor, ...]:
    """The state after ``earlier``'s tokens and then ``later``'s: both sums rescaled to the joint max."""
    (num_a, den_a, top_a), (num_b, den_b, top_b) = earlier, later
    top = torch.maximum(top_a, top_b)
    scale_a, scale_b = torch.exp(top_a - finite_or_zero(top)), torch.exp(top_b - finite_or_zero(top))
    return scale_a * num_a + scale_b * num_b, scale_a * den_a + scale_b * den_b, top


def state_as_token(state) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key, value)`` of one token that adds to every later prefix sum exactly what ``state`` adds:
    ``e^{key} = e^{max} den`` and ``value = num / den``. Finite (and meaningless) for the empty state."""
    num, den, top = state
    den = torch.where(den > 0, den, 1.0)
    return finite_or_zero(top) + torch.log(den), num / den
