"""``deltanet`` and ``gated_deltanet``: the (gated) delta rule around ``ops.delta_rule`` (docs/MIXERS.md#deltanet).

One class; ``gate`` chooses Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024), the default of the ``gated_deltanet``
name. As flash-linear-attention's layers: the base class's SiLU short convolutions (``short_conv`` taps) on q, k and
v; q and k L2-normalized per head, q scaled by ``D^{-1/2}``; ``β = sigmoid(W_β x)`` per head; the gate's log-decay
``g = −exp(A_log)·softplus(W_α x + dt_bias)``; the output RMSNorm per head, times ``SiLU(W_g x)``.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.delta_rule import delta_rule
from ..ops.delta_rule.state import transition_of_tokens
from ..ops.precision import upcast
from .base import Mixer
from .common import MAMBA2_A_INIT_RANGE, MAMBA2_DT_INIT_FLOOR, MAMBA2_DT_MAX, MAMBA2_DT_MIN, mamba2_decay_init
from .norm import RMSNorm
from .registry import register
from .sequence_parallel import SliceConvolutions, transition_entering


@register("deltanet")
class DeltaNet(Mixer):
    """On a sequence slice, the state of the earlier slices (composed as maps) enters each row's first document, and
    the short convolutions read the previous slice's last inputs, from the same all-gather. The decoding state is
    ``S`` and the convolutions' last inputs."""

    supports_sequence_parallel = True

    def __init__(self, dim: int, num_heads: int, *, causal: bool = True, gate: bool = False, short_conv: int = 4,
                 chunk_size: int = 64, impl: str = "auto", qkv_bias: bool = False, o_bias: bool = False,
                 dt_min: float | None = None, dt_max: float | None = None, a_init_range=None):
        if not causal:
            raise ValueError("deltanet and gated_deltanet are causal only (their state is a recurrence); build them "
                             "with causal=True")
        super().__init__(dim, num_heads, causal=causal, qkv_bias=qkv_bias, o_bias=o_bias, short_conv=short_conv)
        self.gate, self.chunk_size, self.impl = gate, chunk_size, impl
        self.beta_proj = nn.Linear(dim, num_heads, bias=False)
        self.out_gate_proj = nn.Linear(dim, dim, bias=False)
        self.out_norm = RMSNorm(self.head_dim)
        decay_init = {"dt_min": dt_min, "dt_max": dt_max, "a_init_range": a_init_range}
        if not gate and any(value is not None for value in decay_init.values()):
            raise ValueError(f"deltanet: {', '.join(k for k, v in decay_init.items() if v is not None)} set the "
                             "gate's decay, and this one has no gate (gated_deltanet, or gate: true)")
        if gate:  # Mamba-2's decay parametrisation, as Gated DeltaNet's, with Mamba-2's defaults
            self.decay_proj = nn.Linear(dim, num_heads, bias=False)
            self.A_log, self.dt_bias = mamba2_decay_init(
                "gated_deltanet", num_heads, dt_min=MAMBA2_DT_MIN if dt_min is None else dt_min,
                dt_max=MAMBA2_DT_MAX if dt_max is None else dt_max,
                a_init_range=MAMBA2_A_INIT_RANGE if a_init_range is None else a_init_range,
                dt_init_floor=MAMBA2_DT_INIT_FLOOR)

    def forward(self, x, *, cu_seqlens=None, position_ids=None, hw=None):
        batch, seq_len, _ = x.shape
        beta, g = self._write_and_decay(x)
        initial = None
        if self.sequence is None:
            q, k, v = self.qkv(x, cu_seqlens=cu_seqlens, position_ids=position_ids)
        else:
            q, k, v, initial = self._on_slice(x, beta, g, cu_seqlens, position_ids)
        if cu_seqlens is not None:  # the ops' packed layout, [1, B·T, H, *]
            beta, g = (None if t is None else t.reshape(1, batch * seq_len, *t.shape[2:]) for t in (beta, g))
        o = self.op(q, k, v, beta, g, cu_seqlens=cu_seqlens, initial_state=initial, chunk_size=self.chunk_size,
                    impl=self.impl)
        return self._output(o.reshape(batch, seq_len, self.num_heads, self.head_dim), x)

    def _on_slice(self, x, beta, g, cu_seqlens, position_ids):
        """The op's q, k, v on this rank's slice, and the state entering each of its packed documents."""
        convolutions = SliceConvolutions(self, x, position_ids, self.sequence)
        q, k, v = self.features(*self.split(convolutions.early, packed=True))
        riders = [beta, torch.zeros_like(beta) if g is None else g]
        initial, packet = transition_entering(k, v, riders, position_ids, self.sequence, cu_seqlens.numel() - 1,
                                              chunk_size=self.chunk_size, convolutions=convolutions,
                                              transition=self.transition_of_tokens)
        if self.short_conv:  # the first K − 1 tokens again, now with the previous rank's halo
            q, k, v = self.features(*self.split(convolutions.final(packet), packed=True))
        return q, k, v, initial

    def forward_with_state(self, x, state):
        """The state is ``(S [B, H, D, D], the short convolutions' tails)`` (tails None without ``short_conv``)."""
        S, tails = state if state is not None else (None, None)
        (q, k, v), tails = self.qkv_continuing(x, tails)
        impl = "recurrent" if x.shape[1] == 1 else self.impl  # one decoded token: no chunks to set up
        o, S = self.op(q, k, v, *self._write_and_decay(x), initial_state=S, output_final_state=True,
                       chunk_size=self.chunk_size, impl=impl)
        return self._output(o, x), (S, tails)

    @staticmethod
    def op(q, k, v, beta, g, **options):
        """The op over the mixer's q, k, v, β and log-decay (``ops.delta_rule``'s arguments)."""
        return delta_rule(q, k, v, beta, g, **options)

    @staticmethod
    def transition_of_tokens(k, v, beta, g, mask, *, chunk_size):
        """The map ``(S_run, M)`` of a run of tokens, what a sequence slice hands on (``ops/delta_rule/state.py``)."""
        return transition_of_tokens(k, v, beta, g, mask, chunk_size=chunk_size)

    def features(self, q, k, v):
        return F.normalize(q, dim=-1) * self.head_dim ** -0.5, F.normalize(k, dim=-1), v

    def _write_and_decay(self, x):
        """β and the log-decay ``g`` ``[B, T, H]`` (None without the gate)."""
        return torch.sigmoid(self.beta_proj(x)), self.log_decay(x)

    def log_decay(self, x):
        if not self.gate:
            return None
        decay = upcast(self.decay_proj(x))[0]  # fp32 at least: the op sums g over a chunk, bf16's rounding would add up
        return -self.A_log.to(decay.dtype).exp() * F.softplus(decay + self.dt_bias.to(decay.dtype))

    def _output(self, o, x):
        """Per-head RMSNorm of ``o [B, T, H, D]``, gated by ``SiLU(W_g x)``, then the output projection."""
        gate = F.silu(self.out_gate_proj(x)).reshape(o.shape)
        return self.o_proj((self.out_norm(o) * gate).reshape(*x.shape[:2], self.dim))

    def flops_per_token(self, seq_len: int) -> float:
        """The projections (q, k, v, o, the output gate; β and the decay per head) and short convolutions, and the
        recurrent form's work per head: decay, predict, update and read a D×D state."""
        heads = self.num_heads * (2 if self.gate else 1)
        return self.projection_flops() + 2.0 * self.dim * (self.dim + heads) + 2 * 4 * self.dim * self.head_dim


@register("gated_deltanet")
class GatedDeltaNet(DeltaNet):
    """``deltanet`` with the gate on by default (the name configs use for Gated DeltaNet)."""

    def __init__(self, dim: int, num_heads: int, *, causal: bool = True, gate: bool = True, short_conv: int = 4,
                 chunk_size: int = 64, impl: str = "auto", qkv_bias: bool = False, o_bias: bool = False,
                 dt_min: float | None = None, dt_max: float | None = None, a_init_range=None):
        super().__init__(dim, num_heads, causal=causal, gate=gate, short_conv=short_conv, chunk_size=chunk_size,
                         impl=impl, qkv_bias=qkv_bias, o_bias=o_bias, dt_min=dt_min, dt_max=dt_max,
                         a_init_range=a_init_range)
