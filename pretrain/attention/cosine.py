"""``cosine``: the "1 + cos" similarity, ``sim(q, k) = 1 + q̂·k̂``, as divisive linear attention (REFERENCE §2).

The feature map ``φ(x) = [1, x̂]`` (a constant feature before the unit vector) makes ``φ(q)·φ(k) = 1 + q̂·k̂``,
which is never negative, so the chunked linear-attention op does all the work.
"""
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.linear_attention import linear_attention
from .common import check_heads, merge_heads, project_heads, projection_flops
from .registry import register


def one_plus_unit(x: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` → ``[..., 1 + D]``: a constant 1 followed by ``x / ‖x‖``."""
    return torch.cat([torch.ones_like(x[..., :1]), F.normalize(x, dim=-1)], dim=-1)


@register("cosine")
class CosineAttention(nn.Module):
    """q/k/v/o projections around divisive linear attention with ``φ(x) = [1, x̂]``; ``step`` decodes one token."""

    supports_causal: ClassVar[bool] = True

    def __init__(self, dim: int, num_heads: int, *, causal: bool = True, chunk_size: int = 64, impl: str = "auto"):
        super().__init__()
        self.head_dim = check_heads(dim, num_heads)
        self.dim, self.num_heads, self.causal, self.chunk_size, self.impl = dim, num_heads, causal, chunk_size, impl
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x, *, cu_seqlens=None, position_ids=None, hw=None):
        batch, seq_len, _ = x.shape
        q, k, v = self._qkv(x, packed=cu_seqlens is not None)
        o = linear_attention(q, k, v, causal=self.causal, normalize="divisive", cu_seqlens=cu_seqlens,
                             chunk_size=self.chunk_size, impl=self.impl)
        return self.o_proj(merge_heads(o, batch, seq_len))

    def step(self, x_t, state=None):
        """One token ``[B, C]`` with the state of the tokens before it (None at the start) → ``(y_t, state)``."""
        q, k, v = self._qkv(x_t[:, None], packed=False)
        o, state = linear_attention(q, k, v, causal=True, normalize="divisive", initial_state=state,
                                    output_final_state=True, impl="recurrent")
        return self.o_proj(merge_heads(o, x_t.shape[0], 1))[:, 0], state

    def _qkv(self, x, *, packed):
        q, k, v = project_heads(x, (self.q_proj, self.k_proj, self.v_proj), self.num_heads, packed=packed)
        return one_plus_unit(q), one_plus_unit(k), v

    def flops_per_token(self, seq_len: int) -> float:
        """Four projections and a (D+1)×D state update and read per head (the recurrent form's work)."""
        return projection_flops(self.dim, 4) + 2 * 2 * self.num_heads * (self.head_dim + 1) * self.head_dim
