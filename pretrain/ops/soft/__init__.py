"""SOFT — softmax-free attention (Lu et al. 2021): a Gaussian kernel through landmarks and a Newton pseudo-inverse.

docs/MIXERS.md#soft. With ``G(a, b) = exp(−‖a − b‖² / 2)`` on queries already scaled by ``d^{-1/4}`` (keys are the
queries: tied projections), ``Y = K1 · NS(A) · (K1ᵀ V)``, ``K1 = G(Q, L)`` ``[n, m]``, ``A = G(L, L)`` ``[m, m]``.
No row normalisation; optionally the symmetric one ``D · NS(A) · D`` with ``D = diag(rowsum A)^{-1/2}``. Both
invert ``A + 0.01·I`` (the released model's ridge); the released symmetric variant drops the ridge, which
``tools/soft_inverse_report.py`` shows collapses or blows up its inverse (docs/MIXERS.md#soft).
Non-causal only: the landmarks pool the whole image.

``naive.py`` holds the definition with an exact inverse (the oracle), ``newton_schulz.py`` the iterative inverse.
"""
import torch

from ..precision import upcast
from .naive import soft_attention_naive
from .newton_schulz import RIDGE, newton_schulz_pinv


def gaussian_kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``exp(−‖a_i − b_j‖² / 2)`` for ``a [B, n, H, D]``, ``b [B, m, H, D]`` → ``[B, H, n, m]``, by matmul."""
    sq_a = a.square().sum(-1).transpose(1, 2)[..., :, None]
    sq_b = b.square().sum(-1).transpose(1, 2)[..., None, :]
    cross = torch.einsum("bihd,bjhd->bhij", a, b)
    return torch.exp(-(sq_a + sq_b - 2 * cross).clamp(min=0) / 2)


def soft_attention(q, landmarks, v, *, newton_iters: int = 20, symmetric: bool = False):
    """q ``[B, n, H, D]`` (scaled by ``D^{-1/4}``), landmarks ``[B, m, H, D]``, v ``[B, n, H, Dv]`` → ``[B, n, H, Dv]``.

    O(n·m) time and memory: ``K1 (NS(A) (K1ᵀ V))``.
    """
    _check(q, landmarks, v)
    q32, l32, v32 = upcast(q, landmarks, v)
    k1 = gaussian_kernel(q32, l32)  # [B, H, n, m]
    a = gaussian_kernel(l32, l32)
    inverse = newton_schulz_pinv(a, iters=newton_iters)
    if symmetric:
        scale = a.sum(-1).rsqrt()
        inverse = scale[..., :, None] * inverse * scale[..., None, :]
    context = k1.mT @ v32.transpose(1, 2)  # [B, H, m, Dv]
    return (k1 @ (inverse @ context)).transpose(1, 2).to(v.dtype)


def _check(q, landmarks, v):
    if not (q.dim() == landmarks.dim() == v.dim() == 4 and q.shape[0] == landmarks.shape[0] == v.shape[0]
            and q.shape[2:] == landmarks.shape[2:] and q.shape[:3] == v.shape[:3]):
        raise ValueError(f"soft_attention: q {tuple(q.shape)}, landmarks {tuple(landmarks.shape)}, "
                         f"v {tuple(v.shape)} must be [B, n, H, D], [B, m, H, D], [B, n, H, Dv]")


__all__ = ["soft_attention", "soft_attention_naive", "newton_schulz_pinv", "gaussian_kernel", "RIDGE"]
