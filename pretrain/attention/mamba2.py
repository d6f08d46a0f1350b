"""``mamba2``: the SSD layer of Mamba-2 (Dao & Gu 2024, arXiv 2405.21060) on ``ops.decayed_linear_attention``.

docs/MIXERS.md#mamba2. Per token: projections of x to the values ``x``, the shared key ``B`` and query ``C`` (one
group, all heads), the gate ``z`` and the step ``dt`` per head; a short causal convolution (SiLU) over
``(x, B, C)``; ``dt = softplus(dt + dt_bias)``; per head ``A = −exp(A_log)``, so the state decays by
``exp(dt·A)``; ``h_t = exp(dt_t A) h_{t−1} + B_t (dt_t x_t)ᵀ`` and ``y_t = C_tᵀ h_t + D x_t``, which is the decayed
op with q = C, k = B (broadcast over heads), v = x·dt and the log-decay g = dt·A; then the gated RMSNorm
``norm(y ⊙ silu(z))`` and the output projection.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.decayed_linear_attention import decayed_linear_attention
from .base import Mixer
from .common import (
    MAMBA2_A_INIT_RANGE,
    MAMBA2_DT_INIT_FLOOR,
    MAMBA2_DT_MAX,
    MAMBA2_DT_MIN,
    mamba2_decay_init,
    token_positions,
)
from .norm import RMSNorm
from .registry import register
from .sequence_parallel import SliceConvolutions, decayed_linear_attention_entering
from .short_conv import ShortConvolution


@register("mamba2")
class Mamba2(Mixer):
    """``q_proj`` makes C, ``k_proj`` B, ``v_proj`` x (``expand·dim`` wide), ``gate_proj`` z, ``dt_proj`` dt: the
    five pieces of Mamba-2's one input projection. On a sequence slice the decayed state of the earlier slices
    enters each row's first document, and the previous slice's last inputs (its halo, in the same exchange) feed the
    convolution's first outputs."""

    supports_sequence_parallel = True

    def __init__(self, dim: int, num_heads: int, *, causal: bool = True, expand: int = 2, state_size: int = 64,
                 conv_size: int = 4, dt_min: float = MAMBA2_DT_MIN, dt_max: float = MAMBA2_DT_MAX,
                 dt_init_floor: float = MAMBA2_DT_INIT_FLOOR,
                 a_init_range: tuple[float, float] = MAMBA2_A_INIT_RANGE, norm_eps: float = 1e-5, chunk_size: int = 64,
                 impl: str = "auto", qkv_bias: bool = False, o_bias: bool = False):
        super().__init__(dim, num_heads, causal=causal, qkv_bias=qkv_bias, o_bias=o_bias)
        if not causal:
            raise ValueError("mamba2 is a causal recurrence; it has no non-causal form (build it with causal=True)")
        if expand < 1 or (expand * dim) % num_heads:
            raise ValueError(f"mamba2: expand·dim = {expand}·{dim} must split into num_heads = {num_heads} heads")
        self.inner, self.state_size, self.chunk_size, self.impl = expand * dim, state_size, chunk_size, impl
        self.head_dim = self.inner // num_heads  # the values' width per head, P
        self.q_proj = nn.Linear(dim, state_size, bias=qkv_bias)   # C
        self.k_proj = nn.Linear(dim, state_size, bias=qkv_bias)   # B
        self.v_proj = nn.Linear(dim, self.inner, bias=qkv_bias)   # x
        self.gate_proj = nn.Linear(dim, self.inner, bias=False)   # z
        self.dt_proj = nn.Linear(dim, num_heads, bias=False)      # dt, before its bias
        self.o_proj = nn.Linear(self.inner, dim, bias=o_bias)
        self.conv = ShortConvolution(self.inner + 2 * state_size, conv_size, activation="silu", bias=True)
        self.A_log, self.dt_bias = mamba2_decay_init("mamba2", num_heads, dt_min=dt_min, dt_max=dt_max,
                                                     a_init_range=a_init_range, dt_init_floor=dt_init_floor)
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = RMSNorm(self.inner, eps=norm_eps)

    @property
    def conv_reach(self) -> int:
        """How many inputs before a token its one convolution reads (``conv_size − 1``)."""
        return self.conv.halo

    def check_sequence_parallel(self, size: int, slice_len: int) -> None:
        if slice_len < self.conv_reach:
            raise ValueError(f"a slice of {slice_len} tokens is shorter than mamba2's convolution reach "
                             f"({self.conv_reach} tokens): use fewer sequence ranks or a smaller conv_size")

    def forward(self, x, *, cu_seqlens=None, position_ids=None, hw=None):
        batch, seq_len, _ = x.shape
        if position_ids is None:
            position_ids = token_positions(batch, seq_len, cu_seqlens, x.device)
        dt = self._dt(x)
        initial = None
        if self.sequence is None:
            values, q, k, v, g = self._op_inputs(self.convolved(self.projections(x), position_ids), dt)
        else:
            values, q, k, v, g, initial = self._on_slice(x, dt, cu_seqlens, position_ids)
        if cu_seqlens is not None:  # the op's packed layout, [1, B·T, ...]
            q, k, v, g = (t.reshape(1, batch * seq_len, *t.shape[2:]) for t in (q, k, v, g))
        y = decayed_linear_attention(q, k, v, g, cu_seqlens=cu_seqlens, initial_state=initial,
                                     chunk_size=self.chunk_size, impl=self.impl)
        return self._output(x, y.view(batch, seq_len, *y.shape[2:]), values)

    def _on_slice(self, x, dt, cu_seqlens, position_ids):
        """``_op_inputs`` on this rank's slice, and the state entering each of its packed documents. The state reads the
        values before Δ (``keys_values``): Δ rides beside them, as it does not depend on the previous slice."""
        self.check_sequence_parallel(self.sequence.size, x.shape[1])
        convolutions = SliceConvolutions(self, x, position_ids, self.sequence)
        values, q, k, v, g = self._op_inputs(convolutions.early, dt)
        initial, packet = decayed_linear_attention_entering(k, values, g, position_ids, self.sequence,
                                                            cu_seqlens.numel() - 1, value_scale=dt,
                                                            convolutions=convolutions)
        # the first conv_size − 1 tokens again, now with the previous rank's halo
        return *self._op_inputs(convolutions.final(packet), dt), initial

    def forward_with_state(self, x, state):
        """The state is the op's ``S [B, H, N, P]`` and the convolution's last ``conv_size − 1`` inputs."""
        attn_state, before = state if state is not None else (None, None)
        (features,) = self.projections(x)
        convolved = self.conv(features, before=before)
        values, q, k, v, g = self._op_inputs([convolved], self._dt(x))
        impl = "recurrent" if x.shape[1] == 1 else self.impl  # one decoded token: no chunks to set up
        y, attn_state = decayed_linear_attention(q, k, v, g, initial_state=attn_state, output_final_state=True,
                                                 chunk_size=self.chunk_size, impl=impl)
        return self._output(x, y, values), (attn_state, self.conv.tail(features, before))

    def projections(self, x):
        """The convolution's one input, ``(x, B, C)`` side by side ``[B, T, inner + 2N]``."""
        return [torch.cat([self.v_proj(x), self.k_proj(x), self.q_proj(x)], dim=-1)]

    def convolved(self, inputs, position_ids=None, before=None):
        return [self.conv(inputs[0], position_ids=position_ids, before=None if before is None else before[0])]

    def keys_values(self, convolved, position_ids):
        """The keys B per head and the values x before Δ scales them (Δ rides beside them on a sequence slice)."""
        values, k, _ = self._heads(convolved)
        return k, values

    def _dt(self, x):
        """The step per token and head, ``softplus(x W_dt + dt_bias)``, ``[B, T, H]``."""
        return F.softplus(self.dt_proj(x) + self.dt_bias)

    def _heads(self, convolved):
        """From the convolved ``[(x, B, C)]``: the values ``[B, T, H, P]``, the keys B and the queries C per head
        ``[B, T, H, N]``."""
        (convolved,) = convolved
        batch, seq_len, _ = convolved.shape
        values, keys, queries = convolved.split([self.inner, self.state_size, self.state_size], dim=-1)
        heads = (batch, seq_len, self.num_heads, self.state_size)
        k, q = (t.reshape(batch, seq_len, 1, self.state_size).expand(heads) for t in (keys, queries))
        return values.view(batch, seq_len, self.num_heads, self.head_dim), k, q

    def _op_inputs(self, convolved, dt):
        """The values (for D's skip) and the op's q, k, v = x·Δ and log-decay g = Δ·A ≤ 0."""
        values, k, q = self._heads(convolved)
        return values, q, k, values * dt[..., None], self._log_decay_of(dt)

    def log_decay(self, x):
        return self._log_decay_of(self._dt(x))

    def _log_decay_of(self, dt):
        """``g = Δ·A``, ``A = −exp(A_log)`` per head."""
        return dt * -self.A_log.exp()

    def _output(self, x, y, values):
        """The D skip, the gated RMSNorm and the output projection."""
        y = (y + self.D[:, None] * values).flatten(2)
        return self.o_proj(self.norm(y * F.silu(self.gate_proj(x))))

    def flops_per_token(self, seq_len: int) -> float:
        """The projections, the convolution, and the recurrent form's state update and read (N·P per head each)."""
        projections = 2 * self.dim * (2 * self.inner + 2 * self.state_size + self.num_heads) + 2 * self.inner * self.dim
        return projections + self.conv.flops_per_token() + 2 * 2 * self.state_size * self.inner
