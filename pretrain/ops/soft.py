"""SOFT — softmax-free attention (Lu et al. 2021): a Gaussian kernel through landmarks and a Newton pseudo-inverse.

REFERENCE §6. With ``G(a, b) = exp(−‖a − b‖² / 2)`` on queries already scaled by ``d^{-1/4}`` (keys are the
queries: tied projections), ``Y = K1 · NS(A) · (K1ᵀ V)``, ``K1 = G(Q, L)`` ``[n, m]``, ``A = G(L, L)`` ``[m, m]``.
No row normalisation; optionally the symmetric one ``D · NS(A) · D`` with ``D = diag(rowsum A)^{-1/2}``.
Non-causal only: the landmarks pool the whole image.
"""
import torch

from .precision import upcast

RIDGE = 0.01  # P = A + RIDGE·I keeps the Newton iteration away from A's tiny eigenvalues


def newton_schulz_pinv(a: torch.Tensor, *, iters: int = 20, ridge: float = RIDGE) -> torch.Tensor:
    """Approximate ``(a + ridge·I)^{-1}`` for symmetric ``a [..., m, m]`` by ``iters`` Newton–Schulz steps.

    ``V₀ = α·P`` with ``α = 0.9·2/(max row sum)²``, then ``V ← 2V − V P V``. The iteration runs without autograd;
    the backward is the exact-inverse gradient ``∂L/∂A = −Vᵀ (∂L/∂V) Vᵀ``, so memory does not grow with ``iters``.
    """
    if a.dim() < 2 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"newton_schulz_pinv: need square matrices [..., m, m]; got {tuple(a.shape)}")
    return _NewtonSchulzPinv.apply(a, iters, ridge)


class _NewtonSchulzPinv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, iters, ridge):
        (p,) = upcast(a)
        p = p + ridge * torch.eye(a.shape[-1], dtype=p.dtype, device=p.device)
        alpha = 0.9 * 2 / a.abs().sum(dim=-1).amax(dim=-1).to(p.dtype).square()
        inverse = alpha[..., None, None] * p
        for _ in range(iters):
            inverse = 2 * inverse - inverse @ p @ inverse
        ctx.save_for_backward(inverse)
        return inverse.to(a.dtype)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        inverse_t = inverse.mT
        return (-inverse_t @ grad.to(inverse.dtype) @ inverse_t).to(grad.dtype), None, None


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


def soft_attention_naive(q, landmarks, v, *, symmetric: bool = False):
    """The definition with an exact inverse: the full ``[n, n]`` matrix ``K1 (A + ridge·I)^{-1} K1ᵀ``, then V."""
    _check(q, landmarks, v)
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


def _check(q, landmarks, v):
    if not (q.dim() == landmarks.dim() == v.dim() == 4 and q.shape[0] == landmarks.shape[0] == v.shape[0]
            and q.shape[2:] == landmarks.shape[2:] and q.shape[:3] == v.shape[:3]):
        raise ValueError(f"soft_attention: q {tuple(q.shape)}, landmarks {tuple(landmarks.shape)}, "
                         f"v {tuple(v.shape)} must be [B, n, H, D], [B, m, H, D], [B, n, H, Dv]")
