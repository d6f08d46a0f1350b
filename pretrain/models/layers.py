"""The parts of a transformer block that are neither the token mixer nor its norm (``pretrain.attention.norm``):
the feed-forwards (SwiGLU; RWKV's channel mixing), and the weight initialization both models share."""
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
    parameters (norms, convolutions, a mixer's own biases or kernels) keep the init their module gave them, as do
    linear layers marked ``keeps_init`` (RWKV-7's low-rank projections, which start at zero on their base values).
    """
    residual_std = std / math.sqrt(2 * max(1, blocks))
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) and not getattr(module, "keeps_init", False):
            nn.init.normal_(module.weight, std=residual_std if name.endswith(("o_proj", "down_proj")) else std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


def ffn_width(ffn: str, dim: int, ffn_hidden: int, multiple_of: int) -> int:
    """``ffn_hidden``, or when 0 the paper's width, rounded up: the parameters of a 4·dim MLP either way, SwiGLU's
    three matrices 8/3·dim wide (LLaMA's), RWKV's channel mixing's two 4·dim."""
    if ffn_hidden:
        return ffn_hidden
    return multiple_of * math.ceil((8 * dim / 3 if ffn == "swiglu" else 4 * dim) / multiple_of)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) ⊙ up(x))`` (Shazeer 2020)."""

    shifts = False  # token-wise: reads no other token

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


class RWKVChannelMix(nn.Module):
    """RWKV's channel mixing (RWKV-7, Peng et al. 2025, arXiv 2503.14456; docs/MIXERS.md#rwkv7):
    ``down(relu(up(x + μ ⊙ (x_{t−1} − x)))²)``, ``up`` and ``down`` its ``W_k`` and ``W_v``.

    Token-wise but for its token shift: ``forward(x, previous)`` takes the token before each one (zeros before a
    document's first token), which the block makes (``shifts``)."""

    shifts = True

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.shift_mix = nn.Parameter(torch.full((dim,), 0.5))  # μ per channel
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x, previous):
        with scope(FFN):
            return self.down_proj(F.relu(self.up_proj(x + self.shift_mix * (previous - x))).square())

    def flops_per_token(self) -> float:
        """The two matrices (the shift and the square: a few per channel, not counted, as SwiGLU's product)."""
        return 2 * 2 * self.up_proj.in_features * self.up_proj.out_features
