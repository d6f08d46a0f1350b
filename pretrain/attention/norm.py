"""RMSNorm, the one norm of the models' blocks and of the mixers' per-head norms (q/k norms, output norms).

On CUDA, where x and the weight share a dtype, PyTorch's fused kernels (``F.rms_norm``: one launch forward, one
backward, fp32 inside, x and 1/rms(x) kept): written out, the formula is ~8 elementwise kernels forward and ~15
backward per norm, 40 % of an eager block's launches, and the first GPU profiles found the eager step bound by its
launches. Elsewhere ours rather than ``nn.RMSNorm``: on CPU ``nn.RMSNorm`` is autograd through the formula, which
keeps two fp32 copies of x for backward, a quarter of a bf16 block's activations; ours is a single autograd
function that keeps only x and 1/rms(x).
"""
import torch
import torch.nn.functional as F
from torch import nn

from ..ops.precision import upcast
from ..scopes import NORM, scope


class RMSNorm(nn.Module):
    """``x / rms(x) · weight`` over the last dimension (Zhang & Sennrich 2019), computed in at least fp32
    whatever the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        with scope(NORM):
            if x.is_cuda and x.dtype == self.weight.dtype:  # else torch's composite path, or a dtype it refuses
                return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
            return _RMSNormFunction.apply(x, self.weight, self.eps)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x_wide, weight_wide = upcast(x, weight)
        rstd = torch.rsqrt(x_wide.square().mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x_wide * rstd * weight_wide).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        """With n = x·r, r = 1/rms(x), u = grad ⊙ weight: dx = r·(u − n·mean(u ⊙ n)), dweight = Σ grad ⊙ n."""
        x, weight, rstd = ctx.saved_tensors
        x_wide, weight_wide, grad_wide = upcast(x, weight, grad)
        normed = x_wide * rstd
        scaled = grad_wide * weight_wide
        dx = rstd * (scaled - normed * (scaled * normed).mean(-1, keepdim=True))
        dweight = (grad_wide * normed).reshape(-1, normed.shape[-1]).sum(0)
        return dx.to(x.dtype), dweight.to(weight.dtype), None
