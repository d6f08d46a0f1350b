"""Rotary position embedding (RoPE, Su et al. 2021): positions enter q and k as rotations.

Channel pairs ``(x_i, x_{i+D/2})`` are rotated by the angle ``p · θ^(-2i/D)`` of the token's position ``p``, so
``rope(q, p)·rope(k, s)`` depends on ``p − s`` only. Positions come from ``position_ids`` (0 at every document
start), which makes each packed document see the positions it would see alone.
"""
import torch

from .precision import upcast


def apply_rope(x: torch.Tensor, position_ids: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """``x`` ``[B, T, H, D]`` (D even) rotated by ``position_ids`` ``[B, T]``; computed in ≥ fp32, x's dtype out."""
    head_dim = x.shape[-1]
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dimension; got {head_dim}")
    if position_ids.shape != x.shape[:2]:
        raise ValueError(f"position_ids {tuple(position_ids.shape)} must match x's [B, T] = {tuple(x.shape[:2])}")
    (x_wide,) = upcast(x)
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=x.device, dtype=x_wide.dtype) / head_dim)
    angles = position_ids.to(x_wide.dtype)[..., None, None] * inv_freq  # [B, T, 1, D/2]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x_wide.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
