"""``deltanet`` and ``gated_deltanet``: the (gated) delta rule around ``ops.delta_rule`` (docs/MIXERS.md#deltanet).

One class; ``gate`` chooses Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024), the default of the ``gated_deltanet``
name. As flash-linear-attention's layers: a SiLU short convolution (``conv_size`` taps) on q, k and v; q and k
L2-normalized per head, q scaled by ``D^{-1/2}``; ``β = sigmoid(W_β x)`` per head; the gate's log-decay
``g = −exp(A_log)·softplus(W_α x + dt_bias)``; the output RMSNorm per head, times ``SiLU(W_g x)``.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.delta_rule import delta_rule
from ..ops.precision import upcast
from .base import Mixer
from .common import token_positions
from .norm import RMSNorm
from .registry import register
from .sequence_parallel import delta_rule_entering
from .short_conv import ShortConvolution


@register("deltanet")
class DeltaNet(Mixer):
    """On a sequence slice, the state of the earlier slices (composed as maps) enters each row's first document, and
    the convolution reads the previous slice's last ``conv_size − 1`` inputs, from the same all-gather. The decoding
    state is ``S`` and the convolution's last inputs."""

    supports_sequence_parallel = True

    def __init__(self, dim: int, num_heads: int, *, causal: bool = True, gate: bool = False, conv_size: int = 4,
                 chunk_size: int = 64, impl: str = "auto", qkv_bias: bool = False, o_bias: bool = False):
        super().__init__(dim, num_heads, causal=causal, qkv_bias=qkv_bias, o_bias=o_bias)
        if not causal:
            raise ValueError(f"{type(self).__name__} is causal only (its state is a recurrence); build it with "
                             "causal=True")
        self.gate, self.chunk_size, self.impl = gate, chunk_size, impl
        self.conv = ShortConvolution(3 * dim, conv_size)  # depthwise: q, k and v each their own taps
        self.beta_proj = nn.Linear(dim, num_heads, bias=False)
        self.out_gate_proj = nn.Linear(dim, dim, bias=False)
        self.out_norm = RMSNorm(self.head_dim)
        if gate:  # Mamba-2's decay parametrisation, as Gated DeltaNet's: A in [1, 16], dt in [0.001, 0.1]
            self.decay_proj = nn.Linear(dim, num_heads, bias=False)
            self.A_log = nn.Parameter(torch.empty(num_heads).uniform_(1, 16).log())
            dt = torch.empty(num_heads).uniform_(math.log(0.001), math.log(0.1)).exp().clamp(min=1e-4)
            self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt

    def check_sequence_parallel(self, size: int, slice_len: int) -> None:
        if slice_len < self.conv.halo:
            raise ValueError(f"a slice of {slice_len} tokens is shorter than the short convolution's reach "
                             f"({self.conv.halo} tokens): use fewer sequence ranks or a smaller conv_size")

    def forward(self, x, *, cu_seqlens=None, position_ids=None, hw=None):
        batch, seq_len, _ = x.shape
        inputs, beta, g = self._projections(x)
        if position_ids is None:
            position_ids = token_positions(batch, seq_len, cu_seqlens, x.device)
        initial = before = None
        if self.sequence is not None:
            self.check_sequence_parallel(self.sequence.size, seq_len)
            _, k, v = self._features(inputs, None, position_ids)
            initial, before = delta_rule_entering(
                k, v, beta, g, position_ids, self.sequence, cu_seqlens.numel() - 1, inputs=inputs,
                halo=self.conv.halo, features=lambda *args: self._features(*args)[1:], chunk_size=self.chunk_size)
        q, k, v = self._features(inputs, before, position_ids)
        if cu_seqlens is not None:  # the ops' packed layout, [1, B·T, ...]
            q, k, v, beta = (t.reshape(1, batch * seq_len, *t.shape[2:]) for t in (q, k, v, beta))
            g = None if g is None else g.reshape(1, batch * seq_len, -1)
        o = delta_rule(q, k, v, beta, g, cu_seqlens=cu_seqlens, initial_state=initial, chunk_size=self.chunk_size,
                       impl=self.impl)
        return self._output(o.reshape(batch, seq_len, self.num_heads, self.head_dim), x)

    def forward_with_state(self, x, state):
        """The state is ``(S [B, H, D, D], the convolution's last conv_size − 1 inputs [B, ·, 3·dim])``."""
        S, recent = state if state is not None else (None, None)
        inputs, beta, g = self._projections(x)
        q, k, v = self._features(inputs, recent, None)
        impl = "recurrent" if x.shape[1] == 1 else self.impl  # one decoded token: no chunks to set up
        o, S = delta_rule(q, k, v, beta, g, initial_state=S, output_final_state=True, chunk_size=self.chunk_size,
                          impl=impl)
        return self._output(o, x), (S, self.conv.tail(inputs, recent))

    def _projections(self, x):
        """The convolution's inputs ``[B, T, 3·dim]`` (q, k, v side by side), β and the log-decay ``g [B, T, H]``
        (None without the gate)."""
        inputs = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        beta = torch.sigmoid(self.beta_proj(x))
        g = None
        if self.gate:  # in fp32 at least: the op sums it over a chunk, where bf16's rounding would add up
            decay = upcast(self.decay_proj(x))[0]
            g = -self.A_log.to(decay.dtype).exp() * F.softplus(decay + self.dt_bias.to(decay.dtype))
        return inputs, beta, g

    def _features(self, inputs, before, positions):
        """q, k, v ``[B, T, H, D]`` from the convolution of ``inputs`` (reaching into ``before``)."""
        mixed = self.conv(inputs, position_ids=positions, before=before)
        q, k, v = (t.reshape(*t.shape[:2], self.num_heads, self.head_dim) for t in mixed.chunk(3, dim=-1))
        return F.normalize(q, dim=-1) * self.head_dim ** -0.5, F.normalize(k, dim=-1), v

    def _output(self, o, x):
        """Per-head RMSNorm of ``o [B, T, H, D]``, gated by ``SiLU(W_g x)``, then the output projection."""
        gate = F.silu(self.out_gate_proj(x)).reshape(o.shape)
        return self.o_proj((self.out_norm(o) * gate).reshape(*x.shape[:2], self.dim))

    def flops_per_token(self, seq_len: int) -> float:
        """The projections (q, k, v, o, the output gate; β and the decay per head), the convolution, and the
        recurrent form's work per head: decay, predict, update and read a D×D state."""
        heads = self.num_heads * (2 if self.gate else 1)
        small = 2.0 * self.dim * (self.dim + heads)
        return self.projection_flops() + small + self.conv.flops_per_token() + 2 * 4 * self.dim * self.head_dim


@register("gated_deltanet")
class GatedDeltaNet(DeltaNet):
    """``deltanet`` with the gate on by default (the name configs use for Gated DeltaNet)."""

    def __init__(self, dim: int, num_heads: int, *, causal: bool = True, gate: bool = True, conv_size: int = 4,
                 chunk_size: int = 64, impl: str = "auto", qkv_bias: bool = False, o_bias: bool = False):
        super().__init__(dim, num_heads, causal=causal, gate=gate, conv_size=conv_size, chunk_size=chunk_size,
                         impl=impl, qkv_bias=qkv_bias, o_bias=o_bias)
