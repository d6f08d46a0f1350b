"""The parts of a transformer block that are not the token mixer: RMSNorm, the SwiGLU feed-forward, and the
weight initialization both models share."""
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.precision import upcast


class RMSNorm(nn.Module):
    """``x / rms(x) · weight`` (Zhang & Sennrich 2019), computed in at least fp32 whatever the input dtype.

    One autograd function that keeps only ``x`` and ``1/rms(x)`` for backward: autograd through the formula keeps
    two fp32 copies of x besides, a quarter of a bf16 block's activations.
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
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


@torch.no_grad()
def init_weights(model: nn.Module, std: float, *, blocks: int) -> None:
    """Linear and embedding weights ~ N(0, std), biases zero; residual output projections ~ N(0, std/√(2·blocks)).

    Every block adds two branches (mixer, FFN) to the residual stream, so at initialization its variance grows
    with their number, 2·blocks; shrinking the projections that write into the stream (a mixer's ``o_proj``, the
    FFN's ``down_proj``) by 1/√(2·blocks) keeps it O(1) at any depth (GPT-2, Radford et al. 2019). Other
    parameters (norms, convolutions, a mixer's own biases or kernels) keep the init their module gave them.
    """
    residual_std = std / math.sqrt(2 * max(1, blocks))
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=residual_std if name.endswith(("o_proj", "down_proj")) else std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


def swiglu_hidden(dim: int, ffn_hidden: int, multiple_of: int) -> int:
    """``ffn_hidden``, or when 0 the LLaMA width: 8/3·dim (same parameters as a 4·dim MLP) rounded up."""
    if ffn_hidden:
        return ffn_hidden
    return multiple_of * math.ceil(8 * dim / 3 / multiple_of)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) ⊙ up(x))`` (Shazeer 2020)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def flops_per_token(self) -> float:
        return 3 * 2 * self.gate_proj.in_features * self.gate_proj.out_features
