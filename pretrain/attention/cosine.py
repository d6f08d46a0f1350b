"""``cosine``: the "1 + cos" similarity, ``sim(q, k) = 1 + q̂·k̂``, as divisive linear attention (docs/MIXERS.md#cosine).

The feature map ``φ(x) = [1, x̂]`` (a constant feature before the unit vector) makes ``φ(q)·φ(k) = 1 + q̂·k̂``,
which is never negative, so the chunked linear-attention op does all the work: this is the ``linear`` mixer with
``feature_map="cosine"`` and divisive normalisation.
"""
from .linear import LinearAttention
from .registry import register


@register("cosine")
class CosineAttention(LinearAttention):
    """``linear`` with ``φ(x) = [1, x̂]``, divisive; ``step`` decodes one token, ``prefill`` reads a prompt."""

    def __init__(self, dim: int, num_heads: int, *, causal: bool = True, chunk_size: int = 64, impl: str = "auto",
                 short_conv: int = 0, qkv_bias: bool = False, o_bias: bool = False):
        super().__init__(dim, num_heads, causal=causal, feature_map="cosine", normalize="divisive",
                         chunk_size=chunk_size, impl=impl, short_conv=short_conv, qkv_bias=qkv_bias, o_bias=o_bias)

    def flops_per_token(self, seq_len: int) -> float:
        """Four projections and a (D+1)×D state update and read per head (the recurrent form's work)."""
        return self.projection_flops() + 2 * 2 * self.num_heads * (self.head_dim + 1) * self.head_dim
