"""The parts of a transformer block that are neither the token mixer nor its norm (``pretrain.attention.norm``):
the SwiGLU feed-forward, and the weight initialization both models share."""
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..scopes import FFN, scope


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
        with scope(FFN):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def flops_per_token(self) -> float:
        return 3 * 2 * self.gate_proj.in_features * self.gate_proj.out_features
