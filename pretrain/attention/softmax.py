"""``softmax``: multi-head softmax attention, the baseline mixer: with 1-D RoPE in the LM, without on an image grid.

On a sequence slice it runs DeepSpeed Ulysses (``deepspeed.sequence.layer.DistributedAttention``): an all-to-all
trades the slice of every head for the whole sequence of ``num_heads / N`` heads, attention runs there with the
whole rows' document boundaries, and a second all-to-all trades back.
"""
import torch
from torch import nn

from ..ops import cu_seqlens_from_position_ids, rope_rotation, softmax_attention
from ..ops.softmax import IMPLS
from ..parallel import gather_positions, slice_layout
from .base import Mixer
from .norm import RMSNorm
from .registry import register


@register("softmax")
class SoftmaxAttention(Mixer):
    """q/k/v/o projections around ``pretrain.ops.softmax_attention``; RoPE on q and k from ``position_ids``.

    On an image grid (``hw=(H, W)`` given to ``forward``) there is no RoPE: a 1-D rotation of the row-major tokens
    would call a pixel's neighbour below it W positions away, and the vision backbone brings its own position
    information (a convolution on the grid).

    ``qk_norm`` RMS-normalizes q and k per head before RoPE, which keeps attention logits bounded in large models.
    ``impl`` is ``softmax_attention``'s (``auto``: the varlen kernels on CUDA after their first-use check).

    Packed documents go to the op as one row of B·T tokens with the row length as ``max_seqlen``: every row starts
    a document (``cu_seqlens_from_position_ids``), so none is longer, and the bound needs nothing read from the GPU.
    """

    supports_sequence_parallel = True

    def __init__(self, dim: int, num_heads: int, *, causal: bool = True, rope_theta: float = 10000.0,
                 qk_norm: bool = False, impl: str = "auto", qkv_bias: bool = False, o_bias: bool = False):
        super().__init__(dim, num_heads, causal=causal, qkv_bias=qkv_bias, o_bias=o_bias)
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension; dim {dim} / num_heads {num_heads} = {self.head_dim}")
        if impl not in IMPLS:
            raise ValueError(f"softmax's impl must be one of {IMPLS}; got {impl!r}")
        self.rope_theta, self.impl = rope_theta, impl
        eps = torch.finfo(torch.float32).eps  # nn.RMSNorm's default for fp32, which these norms used to be
        self.q_norm = RMSNorm(self.head_dim, eps=eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, eps=eps) if qk_norm else nn.Identity()

    def forward(self, x, *, cu_seqlens=None, position_ids=None, hw=None):
        """``hw=(H, W)``: the tokens are an image grid; attend to all of it without RoPE."""
        batch, seq_len, _ = x.shape
        if hw is None and position_ids is None:
            position_ids = torch.arange(seq_len, device=x.device).expand(batch, seq_len)
        q, k, v = self._qkv(x, None if hw is not None else position_ids)
        if self.sequence is not None:
            out = self._across_ranks(q, k, v, position_ids)
        else:
            if cu_seqlens is not None:  # packed documents: one row of B*T tokens
                q, k, v = (t.reshape(1, batch * seq_len, self.num_heads, self.head_dim) for t in (q, k, v))
            out = softmax_attention(q, k, v, causal=self.causal, cu_seqlens=cu_seqlens, max_seqlen=seq_len,
                                    impl=self.impl)
        return self.o_proj(out.reshape(batch, seq_len, self.dim))

    def check_sequence_parallel(self, size: int, slice_len: int) -> None:
        if self.num_heads % size:
            raise ValueError(f"Ulysses splits the {self.num_heads} heads over {size} sequence ranks: they must divide")

    def _across_ranks(self, q, k, v, position_ids):
        """Ulysses: ``[B, T/N, H, D]`` slices in and out, attention over whole rows of ``H/N`` heads between."""
        from deepspeed.sequence.layer import DistributedAttention

        shard = self.sequence
        slice_layout(position_ids)  # refuses a slice without position ids
        whole = cu_seqlens_from_position_ids(gather_positions(position_ids, shard))

        def attend(q, k, v):  # [B, T, H/N, D], whole rows
            packed = (1, q.shape[0] * q.shape[1], *q.shape[2:])
            out = softmax_attention(*(t.reshape(packed) for t in (q, k, v)), causal=self.causal, cu_seqlens=whole,
                                    max_seqlen=q.shape[1], impl=self.impl)
            return out.reshape(q.shape)

        return DistributedAttention(attend, shard.group, scatter_idx=2, gather_idx=1)(q, k, v, 0)

    def step(self, x_t, state=None):
        """One token ``[B, C]`` → ``(y_t, state)``; the state is a KV cache: ``(keys, values, position)``.

        The cache grows by one key and value per token (``[B, t, H, D]``); the new token's q and k are rotated at
        its ``position``, so decoding matches ``forward`` over the whole sequence. ``position`` is an int, or each
        row's own ``[B]`` for prompts of different lengths: a row's keys are then its last ``position + 1``, the
        ones before them left padding (``pretrain.models.left_padded``), masked.
        """
        if not self.causal:
            raise ValueError("step decodes causally; this SoftmaxAttention was built with causal=False")
        batch = x_t.shape[0]
        past_k, past_v, position = state if state is not None else (None, None, 0)
        positions = torch.as_tensor(position, device=x_t.device).expand(batch)
        q, k, v = self._qkv(x_t[:, None], positions[:, None])
        keys = k if past_k is None else torch.cat([past_k, k], dim=1)
        values = v if past_v is None else torch.cat([past_v, v], dim=1)
        scores = torch.einsum("bhd,bshd->bhs", q[:, 0], keys) * self.head_dim ** -0.5
        pads = torch.arange(keys.shape[1], device=x_t.device) < keys.shape[1] - 1 - positions[:, None]
        scores = scores.masked_fill(pads[:, None], float("-inf"))
        out = torch.einsum("bhs,bshd->bhd", scores.softmax(dim=-1), values)
        return self.o_proj(out.reshape(batch, self.dim)), (keys, values, position + 1)

    def prefill(self, x):
        """A whole prompt ``[B, T, C]`` → ``(y, state)``: causal attention over it, its keys and values the cache."""
        if not self.causal:
            raise ValueError("prefill starts causal decoding; this SoftmaxAttention was built with causal=False")
        batch, seq_len, _ = x.shape
        q, k, v = self._qkv(x, torch.arange(seq_len, device=x.device).expand(batch, seq_len))
        out = softmax_attention(q, k, v, causal=True, impl=self.impl)
        return self.o_proj(out.reshape(batch, seq_len, self.dim)), (k, v, seq_len)

    def _qkv(self, x, position_ids):
        """q, k, v ``[B, T, H, D]``, q and k normalized if asked and rotated at ``position_ids`` (None: no RoPE)."""
        heads = (*x.shape[:2], self.num_heads, self.head_dim)
        q = self.q_norm(self.q_proj(x).view(heads))
        k = self.k_norm(self.k_proj(x).view(heads))
        v = self.v_proj(x).view(heads)
        if position_ids is not None:
            rotate = rope_rotation(position_ids, self.head_dim, self.rope_theta, dtype=q.dtype)
            q, k = rotate(q), rotate(k)
        return q, k, v

    def flops_per_token(self, seq_len: int) -> float:
        """Four projections plus q·k and weights·v against ``seq_len`` keys (half of them when causal)."""
        projections = 4 * 2 * self.dim * self.dim
        keys = seq_len / 2 if self.causal else seq_len
        return projections + 2 * 2 * keys * self.dim
