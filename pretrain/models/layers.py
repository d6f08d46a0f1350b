"""The parts of a transformer block that are not the token mixer: the SwiGLU feed-forward and its width."""
import math

import torch.nn.functional as F
from torch import nn


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
