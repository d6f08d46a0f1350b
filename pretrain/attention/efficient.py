"""``efficient``: efficient attention (Shen et al. 2021), softmax on Q and K separately (REFERENCE §3).

Non-causal as published; causal through the derived prefix form of ``ops.efficient_attention``.
"""
from typing import ClassVar

from torch import nn

from ..ops import efficient_attention
from .common import check_heads, merge_heads, project_heads, projection_flops
from .registry import register


@register("efficient")
class EfficientAttention(nn.Module):
    """q/k/v/o projections around ``ops.efficient_attention``; ``step`` decodes one token, ``prefill`` a prompt."""

    supports_causal: ClassVar[bool] = True

    def __init__(self, dim: int, num_heads: int, *, causal: bool = True, chunk_size: int = 64):
        super().__init__()
        self.head_dim = check_heads(dim, num_heads)
        self.dim, self.num_heads, self.causal, self.chunk_size = dim, num_heads, causal, chunk_size
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x, *, cu_seqlens=None, position_ids=None, hw=None):
        batch, seq_len, _ = x.shape
        q, k, v = self._qkv(x, packed=cu_seqlens is not None)
        o = efficient_attention(q, k, v, causal=self.causal, cu_seqlens=cu_seqlens, chunk_size=self.chunk_size)
        return self.o_proj(merge_heads(o, batch, seq_len))

    def step(self, x_t, state=None):
        """One token ``[B, C]`` with the state ``(Ŝ, L)`` of the tokens before it (None at the start)."""
        y, state = self._with_state(x_t[:, None], state)
        return y[:, 0], state

    def prefill(self, x):
        """A whole prompt ``[B, T, C]`` in chunks → ``(y, state)``, the state ``step`` goes on from."""
        return self._with_state(x, None)

    def _with_state(self, x, state):
        q, k, v = self._qkv(x, packed=False)
        o, state = efficient_attention(q, k, v, causal=True, initial_state=state, output_final_state=True,
                                       chunk_size=self.chunk_size)
        return self.o_proj(merge_heads(o, *x.shape[:2])), state

    def _qkv(self, x, *, packed):
        return project_heads(x, (self.q_proj, self.k_proj, self.v_proj), self.num_heads, packed=packed)

    def flops_per_token(self, seq_len: int) -> float:
        """Four projections and a d×d state update and read per head (the recurrent form's work)."""
        return projection_flops(self.dim, 4) + 2 * 2 * self.dim * self.head_dim
