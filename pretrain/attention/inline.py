"""``inline``: InLine attention (Han et al. 2024) — injective linear attention with subtractive normalisation.

docs/MIXERS.md#inline: ``φ`` = identity with ``q`` scaled by ``d^{-1/2}``,
``o_t = q_tᵀS_t/n_t + (1 − q_t·z_t/n_t)·u_t/n_t`` (``ops.linear_attention(normalize="subtractive")``), plus a local
branch on V added before the output projection:
- vision (non-causal, ``hw=(H, W)`` given to ``forward``): the paper's *dynamic* depthwise 3×3 convolution on the
  image grid, its kernel made per sample from the token mean by two grouped 1×1 convolutions;
- causal LM: a static causal depthwise 1-D convolution of ``conv_size`` taps (a dynamic kernel would see the
  future), which stops at document starts (``ops.short_conv`` without bias or activation).
With ``short_conv`` (off by default, as in every linear-state mixer) q, k, v are convolved before all this, so the
local branch reads the convolved values.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.linear_attention import linear_attention
from ..ops.short_conv import short_conv as causal_conv
from .base import Mixer
from .common import token_positions
from .registry import register
from .sequence_parallel import SliceConvolutions, from_previous_rank, linear_attention_entering


@register("inline")
class InLineAttention(Mixer):
    """On a sequence slice, the state of the earlier slices enters each row's first document, and the causal
    convolution reads the previous slice's last ``conv_size − 1`` values (its halo)."""

    supports_sequence_parallel = True

    def __init__(self, dim: int, num_heads: int, *, causal: bool = True, local: bool = True, conv_size: int = 4,
                 chunk_size: int = 64, impl: str = "auto", short_conv: int = 0, qkv_bias: bool = False,
                 o_bias: bool = False):
        super().__init__(dim, num_heads, causal=causal, qkv_bias=qkv_bias, o_bias=o_bias, short_conv=short_conv)
        if conv_size < 1:
            raise ValueError(f"conv_size must be ≥ 1; got {conv_size}")
        self.local, self.conv_size, self.chunk_size, self.impl = local, conv_size, chunk_size, impl
        if local and causal:  # taps[:, i] weighs v_{t−i}; the default init of a depthwise nn.Conv1d
            bound = 1 / math.sqrt(conv_size)
            self.taps = nn.Parameter(torch.empty(dim, conv_size).uniform_(-bound, bound))
        elif local:
            self.kernel_net = nn.Sequential(nn.Conv1d(dim, dim, 1, groups=num_heads), nn.GELU(),
                                            nn.Conv1d(dim, 9 * dim, 1, groups=num_heads))

    @property
    def halo(self) -> int:
        """How many tokens before a slice its causal convolution reads."""
        return self.conv_size - 1 if self.local and self.causal else 0

    def forward(self, x, *, cu_seqlens=None, position_ids=None, hw=None):
        """``hw=(H, W)``: the image grid of the tokens, needed by the non-causal local branch."""
        batch, seq_len, _ = x.shape
        if self.local and self.causal and position_ids is None:
            # the model's position_ids already say where documents start; deriving them from cu_seqlens would
            # need ops with data-dependent shapes, a graph break under torch.compile
            position_ids = token_positions(batch, seq_len, cu_seqlens, x.device)
        initial, before = None, None
        if self.sequence is None:
            q, k, v = self.qkv(x, cu_seqlens=cu_seqlens, position_ids=position_ids)
        else:
            q, k, v, initial, before = self._on_slice(x, cu_seqlens, position_ids)
        o = linear_attention(q, k, v, causal=self.causal, normalize="subtractive", cu_seqlens=cu_seqlens,
                             initial_state=initial, chunk_size=self.chunk_size, impl=self.impl)
        o = o.reshape(batch, seq_len, self.dim)
        if self.local and self.causal:
            o = o + causal_conv(v.reshape(batch, seq_len, self.dim), self.taps, positions=position_ids, before=before,
                                activation=None)
        elif self.local:
            if hw is None or cu_seqlens is not None:
                raise ValueError("the non-causal inline mixer convolves the image grid: pass hw=(H, W) and no "
                                 "cu_seqlens, or set local=False")
            o = o + self._dynamic_conv2d(x, v.reshape(batch, seq_len, self.dim), hw)
        return self.o_proj(o)

    def _on_slice(self, x, cu_seqlens, position_ids):
        """The op's q, k, v on this rank's slice, the state entering each of its packed documents, and the previous
        rank's last ``conv_size − 1`` values (the halo of the local convolution)."""
        batch, seq_len, _ = x.shape
        self.check_sequence_parallel(self.sequence.size, seq_len)
        convolutions = SliceConvolutions(self, x, position_ids, self.sequence)
        q, k, v = self.features(*self.split(convolutions.early, packed=True))
        values = v.reshape(batch, seq_len, self.dim)  # final from token short_conv − 1 on, where the halo lies
        initial, (halos, *packet) = linear_attention_entering(k, v, position_ids, self.sequence, "subtractive",
                                                              cu_seqlens.numel() - 1,
                                                              shared=[values[:, seq_len - self.halo:]],
                                                              convolutions=convolutions)
        if self.short_conv:  # the first K − 1 tokens again, now with the previous rank's halo
            q, k, v = self.features(*self.split(convolutions.final(packet), packed=True))
        return q, k, v, initial, from_previous_rank(halos, self.sequence)

    def forward_with_state(self, x, state):
        """The state is (the attention state and the last ``conv_size − 1`` values, oldest first) and the short
        convolutions' tails (None without ``short_conv``)."""
        batch, seq_len, _ = x.shape
        (attn_state, recent), tails = state if state is not None else ((None, x.new_zeros(batch, self.halo, self.dim)),
                                                                       None)
        (q, k, v), tails = self.qkv_continuing(x, tails)
        impl = "recurrent" if seq_len == 1 else self.impl
        o, attn_state = linear_attention(q, k, v, causal=True, normalize="subtractive", initial_state=attn_state,
                                         output_final_state=True, chunk_size=self.chunk_size, impl=impl)
        o = o.reshape(batch, seq_len, self.dim)
        if self.local:  # the taps reach back into the values before this piece (zeros before the first token)
            values = v.reshape(batch, seq_len, self.dim)
            o = o + causal_conv(values, self.taps, before=recent, activation=None)
            recent = torch.cat([recent, values], dim=1)[:, seq_len:]
        return self.o_proj(o), ((attn_state, recent), tails)

    def features(self, q, k, v):
        return q * self.head_dim ** -0.5, k, v

    def _dynamic_conv2d(self, x, v, hw):
        """Depthwise 3×3 convolution of V on the grid with a kernel per sample and channel, made from mean(x)."""
        batch, tokens, dim = v.shape
        height, width = hw
        if height * width != tokens:
            raise ValueError(f"inline: hw={tuple(hw)} does not tile the {tokens} tokens")
        kernels = self.kernel_net(x.mean(dim=1)[:, :, None]).reshape(batch * dim, 1, 3, 3)
        grid = v.transpose(1, 2).reshape(1, batch * dim, height, width)
        out = F.conv2d(grid, kernels.to(grid.dtype), padding=1, groups=batch * dim)
        return out.reshape(batch, dim, tokens).transpose(1, 2)

    def flops_per_token(self, seq_len: int) -> float:
        """Four projections (and short convolutions), the recurrent form's d×d state update and read per head, and the
        local convolution."""
        local = 0.0
        if self.local:
            local = 2 * self.conv_size * self.dim if self.causal else 2 * 9 * self.dim
        return self.projection_flops() + 2 * 2 * self.dim * self.head_dim + local
