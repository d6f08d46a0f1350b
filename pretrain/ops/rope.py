"""Rotary position embedding (RoPE, Su et al. 2021): positions enter q and k as rotations.

Channel pairs ``(x_i, x_{i+D/2})`` are rotated by the angle ``p · θ^(-2i/D)`` of the token's position ``p``, so
``rope(q, p)·rope(k, s)`` depends on ``p − s`` only. Positions come from ``position_ids`` (0 at every document
start), which makes each packed document see the positions it would see alone.

A mixer rotates q and k by one ``Rotation``: the angles are computed once for both, and each tensor is then five
elementwise ops (``x·cos + rotate_half(x)·sin``, in ≥ fp32): an eager step launches every one of them, twice with
activation checkpointing.
"""
from typing import NamedTuple

import torch

from .precision import upcast


class Rotation(NamedTuple):
    """The rotation at a batch of positions: ``cos`` and ``sin`` ``[B, T, 1, D]``, each angle over both channels of
    its pair; call it on ``x [B, T, H, D]``."""
    cos: torch.Tensor
    sin: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[:2] != self.cos.shape[:2] or x.shape[-1] != self.cos.shape[-1]:
            raise ValueError(f"RoPE at positions [B, T] = {tuple(self.cos.shape[:2])} and head dimension "
                             f"{self.cos.shape[-1]} cannot rotate x {tuple(x.shape)}")
        (x_wide,) = upcast(x)
        x1, x2 = x_wide.chunk(2, dim=-1)
        return torch.addcmul(x_wide * self.cos, torch.cat([-x2, x1], dim=-1), self.sin).to(x.dtype)


def rope_rotation(position_ids: torch.Tensor, head_dim: int, theta: float = 10000.0, *,
             dtype: torch.dtype = torch.float32) -> Rotation:
    """The rotation of head dimension ``head_dim`` (even) at ``position_ids [B, T]``, in ``dtype`` (≥ fp32) on their
    device."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dimension; got {head_dim}")
    dtype = torch.promote_types(dtype, torch.float32)
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=position_ids.device, dtype=dtype) / head_dim)
    angles = position_ids.to(dtype)[..., None, None] * inv_freq.repeat(2)  # [B, T, 1, D]: the pair shares its angle
    return Rotation(angles.cos(), angles.sin())


def apply_rope(x: torch.Tensor, position_ids: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """``x`` ``[B, T, H, D]`` (D even) rotated by ``position_ids`` ``[B, T]``; computed in ≥ fp32, x's dtype out."""
    if position_ids.shape != x.shape[:2]:
        raise ValueError(f"position_ids {tuple(position_ids.shape)} must match x's [B, T] = {tuple(x.shape[:2])}")
    return rope_rotation(position_ids, x.shape[-1], theta, dtype=x.dtype)(x)
