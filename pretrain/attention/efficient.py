"""``efficient``: efficient attention (Shen et al. 2021), softmax on Q and K separately (docs/MIXERS.md#efficient).

Non-causal as published; causal through the derived prefix form of ``ops.efficient_attention``.
"""
import torch

from ..ops import efficient_attention
from ..ops.documents import split_documents
from ..ops.efficient import combine_efficient_states, efficient_state
from .base import Mixer
from .registry import register
from .sequence_parallel import SliceConvolutions, states_entering_slice


@register("efficient")
class EfficientAttention(Mixer):
    """Projections around ``ops.efficient_attention``; ``step`` decodes one token, ``prefill`` a prompt; on a
    sequence slice, each document starts from the state ``(Ŝ, L)`` of its tokens on earlier ranks."""

    supports_sequence_parallel = True

    def __init__(self, dim: int, num_heads: int, *, causal: bool = True, chunk_size: int = 64,
                 short_conv: int = 0, qkv_bias: bool = False, o_bias: bool = False):
        super().__init__(dim, num_heads, causal=causal, qkv_bias=qkv_bias, o_bias=o_bias, short_conv=short_conv)
        self.chunk_size = chunk_size

    def forward(self, x, *, cu_seqlens=None, position_ids=None, hw=None):
        batch, seq_len, _ = x.shape
        if self.sequence is not None:
            o = self._on_slice(x, cu_seqlens, position_ids)
        else:
            q, k, v = self.qkv(x, cu_seqlens=cu_seqlens, position_ids=position_ids)
            o = efficient_attention(q, k, v, causal=self.causal, cu_seqlens=cu_seqlens, chunk_size=self.chunk_size)
        return self.o_proj(o.reshape(batch, seq_len, self.dim))

    def _on_slice(self, x, cu_seqlens, position_ids):
        """Each packed document from the state its tokens on earlier ranks left (the empty state where it begins
        on this rank), one document at a time as the op runs packed documents."""
        convolutions = SliceConvolutions(self, x, position_ids, self.sequence)
        q, k, v = self.split(convolutions.early, packed=True)
        (sums, log_norms), packet = states_entering_slice(
            k, v, position_ids, self.sequence, state_of=lambda k, v, mask: list(efficient_state(k, v, mask)),
            combine=lambda a, b: list(combine_efficient_states(a, b)), empty=[0.0, float("-inf")],
            num_docs=cu_seqlens.numel() - 1, convolutions=convolutions)
        if self.short_conv:  # the first K − 1 tokens again, now with the previous rank's halo
            q, k, v = self.split(convolutions.final(packet), packed=True)
        pieces = [efficient_attention(*qkv, causal=True, chunk_size=self.chunk_size,
                                      initial_state=(sums[i:i + 1], log_norms[i:i + 1]))
                  for i, qkv in enumerate(split_documents(cu_seqlens, q, k, v)) if qkv[0].shape[1] > 0]
        return torch.cat(pieces, dim=1)

    def forward_with_state(self, x, state):
        """The state is ``(Ŝ, L)`` — the softmax-weighted sum of values so far and its log-normalizer — and the short
        convolutions' tails (None without ``short_conv``)."""
        state, tails = state if state is not None else (None, None)
        (q, k, v), tails = self.qkv_continuing(x, tails)
        o, state = efficient_attention(q, k, v, causal=True, initial_state=state, output_final_state=True,
                                       chunk_size=self.chunk_size)
        return self.o_proj(o.reshape(*x.shape[:2], self.dim)), (state, tails)

    def flops_per_token(self, seq_len: int) -> float:
        """Four projections (and short convolutions) and a d×d state update and read per head (the recurrent form's
        work)."""
        return self.projection_flops() + 2 * 2 * self.dim * self.head_dim
