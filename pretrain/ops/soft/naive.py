"""SOFT by its definition, with an exact inverse and the whole ``[n, n]`` matrix: the oracle."""
import torch

from ..precision import upcast
from .newton_schulz import RIDGE


def soft_attention_naive(q, landmarks, v, *, symmetric: bool = False):
    """The definition with an exact inverse: the full ``[n, n]`` matrix ``K1 (A + ridge·I)^{-1} K1ᵀ``, then V."""
    q32, l32, v32 = upcast(q, landmarks, v)

    def gaussian(x, y):  # [B, n, H, D], [B, m, H, D] -> [B, H, n, m], from explicit differences
        diff = x[:, :, None] - y[:, None, :]
        return torch.exp(-diff.square().sum(-1) / 2).permute(0, 3, 1, 2)

    k1, a = gaussian(q32, l32), gaussian(l32, l32)
    inverse = torch.linalg.inv(a + RIDGE * torch.eye(a.shape[-1], dtype=a.dtype, device=a.device))
    if symmetric:
        scale = torch.diag_embed(a.sum(-1).rsqrt())
        inverse = scale @ inverse @ scale
    weights = k1 @ inverse @ k1.mT  # [B, H, n, n]
    return torch.einsum("bhij,bjhv->bihv", weights, v32).to(v.dtype)
