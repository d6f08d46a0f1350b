"""The causal efficient-attention state ``(Ŝ, L)`` of a run of tokens, and how two combine: what a
sequence-parallel rank hands to the ranks after it.
"""
import torch

from ..precision import finite_or_zero, upcast


def efficient_state(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal state ``(Ŝ [B, H, D, Dv], L [B, H, D])`` that the tokens of ``k [B, T, H, D]``, ``v [B, T, H, Dv]``
    where ``mask [B, T]`` leave, from nothing: ``L = log Σ e^k`` per channel, ``Ŝ = Σ e^{k − L} vᵀ``. A row with no
    token leaves the empty state ``(0, −∞)``."""
    k, v = upcast(k, v)
    logits = k.masked_fill(~mask[:, :, None, None], float("-inf"))
    log_norm = torch.logsumexp(logits, dim=1)
    weights = torch.exp(logits - finite_or_zero(log_norm)[:, None])
    return torch.einsum("bthc,bthv->bhcv", weights, v), log_norm


def combine_efficient_states(earlier, later) -> tuple[torch.Tensor, torch.Tensor]:
    """The state after ``earlier``'s tokens and then ``later``'s: normalizers add in log space, and each sum is
    rescaled to the joint one."""
    (s_a, l_a), (s_b, l_b) = earlier, later
    log_norm = torch.logaddexp(l_a, l_b)
    joint = finite_or_zero(log_norm)
    return torch.exp(l_a - joint)[..., None] * s_a + torch.exp(l_b - joint)[..., None] * s_b, log_norm
