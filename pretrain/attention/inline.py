"""``inline``: InLine attention (Han et al. 2024) — injective linear attention with subtractive normalisation.

REFERENCE §4: ``φ`` = identity with ``q`` scaled by ``d^{-1/2}``, ``o_t = q_tᵀS_t/n_t + (1 − q_t·z_t/n_t)·u_t/n_t``
(``ops.linear_attention(normalize="subtractive")``), plus a local branch on V added before the output projection:
- vision (non-causal, ``hw=(H, W)`` given to ``forward``): the paper's *dynamic* depthwise 3×3 convolution on the
  image grid, its kernel made per sample from the token mean by two grouped 1×1 convolutions;
- causal LM: a static causal depthwise 1-D convolution of ``conv_size`` taps (a dynamic kernel would see the
  future), which stops at document starts.
"""
from typing import ClassVar

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.linear_attention import linear_attention
from .common import check_heads, merge_heads, project_heads, projection_flops, token_positions
from .registry import register


@register("inline")
class InLineAttention(nn.Module):
    supports_causal: ClassVar[bool] = True

    def __init__(self, dim: int, num_heads: int, *, causal: bool = True, local: bool = True, conv_size: int = 4,
                 chunk_size: int = 64, impl: str = "auto"):
        super().__init__()
        self.head_dim = check_heads(dim, num_heads)
        if conv_size < 1:
            raise ValueError(f"conv_size must be ≥ 1; got {conv_size}")
        self.dim, self.num_heads, self.causal, self.local = dim, num_heads, causal, local
        self.conv_size, self.chunk_size, self.impl = conv_size, chunk_size, impl
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        if local and causal:  # taps[:, i] weighs v_{t−i}; the default init of a depthwise nn.Conv1d
            bound = 1 / math.sqrt(conv_size)
            self.taps = nn.Parameter(torch.empty(dim, conv_size).uniform_(-bound, bound))
        elif local:
            self.kernel_net = nn.Sequential(nn.Conv1d(dim, dim, 1, groups=num_heads), nn.GELU(),
                                            nn.Conv1d(dim, 9 * dim, 1, groups=num_heads))

    def forward(self, x, *, cu_seqlens=None, position_ids=None, hw=None):
        """``hw=(H, W)``: the image grid of the tokens, needed by the non-causal local branch."""
        batch, seq_len, _ = x.shape
        packed = cu_seqlens is not None
        q, k, v = self._qkv(x, packed=packed)
        o = merge_heads(linear_attention(q, k, v, causal=self.causal, normalize="subtractive", cu_seqlens=cu_seqlens,
                                         chunk_size=self.chunk_size, impl=self.impl), batch, seq_len)
        if self.local and self.causal:
            # the model's position_ids already say where documents start; deriving them from cu_seqlens would
            # need ops with data-dependent shapes, a graph break under torch.compile
            if position_ids is None:
                position_ids = token_positions(batch, seq_len, cu_seqlens, x.device)
            positions = position_ids
            flat = (1, batch * seq_len, self.dim) if packed else (batch, seq_len, self.dim)
            o = o + self._causal_conv(v.reshape(flat), positions.reshape(flat[:2])).view_as(o)
        elif self.local:
            if hw is None or cu_seqlens is not None:
                raise ValueError("the non-causal inline mixer convolves the image grid: pass hw=(H, W) and no "
                                 "cu_seqlens, or set local=False")
            o = o + self._dynamic_conv2d(x, v.reshape(batch, seq_len, self.dim), hw)
        return self.o_proj(o)

    def step(self, x_t, state=None):
        """One token ``[B, C]`` → ``(y_t, state)``; the state is the attention state and the last ``conv_size − 1``
        values, oldest first (None at the start)."""
        y, state = self._with_state(x_t[:, None], state, impl="recurrent")
        return y[:, 0], state

    def prefill(self, x):
        """A whole prompt ``[B, T, C]`` in chunks → ``(y, state)``, the state ``step`` goes on from."""
        return self._with_state(x, None, impl=self.impl)

    def _with_state(self, x, state, *, impl):
        batch, seq_len, _ = x.shape
        attn_state, recent = state if state is not None else (None, x.new_zeros(batch, self.conv_size - 1, self.dim))
        q, k, v = self._qkv(x, packed=False)
        o, attn_state = linear_attention(q, k, v, causal=True, normalize="subtractive", initial_state=attn_state,
                                         output_final_state=True, chunk_size=self.chunk_size, impl=impl)
        o = merge_heads(o, batch, seq_len)
        if self.local:  # the taps reach back into the values before this piece (zeros before the first token)
            values = torch.cat([recent, v.reshape(batch, seq_len, self.dim)], dim=1)
            o = o + self._causal_conv(values)[:, -seq_len:]
            recent = values[:, values.shape[1] - recent.shape[1]:]
        return self.o_proj(o), (attn_state, recent)

    def _qkv(self, x, *, packed):
        q, k, v = project_heads(x, (self.q_proj, self.k_proj, self.v_proj), self.num_heads, packed=packed)
        return q * self.head_dim ** -0.5, k, v

    def _causal_conv(self, v, positions=None):
        """``Σ_i taps[:, i] · v_{t−i}`` over taps that stay inside the token's document (``positions``: each token's
        position in its document; None: the row is one document)."""
        out = v * self.taps[:, 0]
        for i in range(1, self.conv_size):
            earlier = F.pad(v, (0, 0, i, 0))[:, : v.shape[1]] * self.taps[:, i]
            out = out + (earlier if positions is None else earlier * (positions >= i)[..., None])
        return out

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
        """Four projections, the recurrent form's d×d state update and read per head, and the local convolution."""
        local = 0.0
        if self.local:
            local = 2 * self.conv_size * self.dim if self.causal else 2 * 9 * self.dim
        return projection_flops(self.dim, 4) + 2 * 2 * self.dim * self.head_dim + local
