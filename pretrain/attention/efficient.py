"""``efficient``: efficient attention (Shen et al. 2021), softmax on Q and K separately (REFERENCE §3).

Non-causal as published; causal through the derived prefix form of ``ops.efficient_attention``.
"""
from ..ops import efficient_attention
from .base import Mixer
from .registry import register


@register("efficient")
class EfficientAttention(Mixer):
    """Projections around ``ops.efficient_attention``; ``step`` decodes one token, ``prefill`` a prompt."""

    def __init__(self, dim: int, num_heads: int, *, causal: bool = True, chunk_size: int = 64,
                 qkv_bias: bool = False, o_bias: bool = False):
        super().__init__(dim, num_heads, causal=causal, qkv_bias=qkv_bias, o_bias=o_bias)
        self.chunk_size = chunk_size

    def forward(self, x, *, cu_seqlens=None, position_ids=None, hw=None):
        batch, seq_len, _ = x.shape
        q, k, v = self.qkv(x, packed=cu_seqlens is not None)
        o = efficient_attention(q, k, v, causal=self.causal, cu_seqlens=cu_seqlens, chunk_size=self.chunk_size)
        return self.o_proj(o.reshape(batch, seq_len, self.dim))

    def forward_with_state(self, x, state):
        """The state is ``(Ŝ, L)``: the softmax-weighted sum of values so far and its log-normalizer."""
        q, k, v = self.qkv(x)
        o, state = efficient_attention(q, k, v, causal=True, initial_state=state, output_final_state=True,
                                       chunk_size=self.chunk_size)
        return self.o_proj(o.reshape(*x.shape[:2], self.dim)), state

    def flops_per_token(self, seq_len: int) -> float:
        """Four projections and a d×d state update and read per head (the recurrent form's work)."""
        return self.projection_flops() + 2 * 2 * self.dim * self.head_dim
