"""A pseudo-inverse by Newton–Schulz iteration, with the exact inverse's gradient."""
import torch

from ..precision import upcast

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
