"""``mamba2``: the SSD layer of Mamba-2 (Dao & Gu 2024, arXiv 2405.21060) on ``ops.decayed_linear_attention``.

docs/MIXERS.md#mamba2. Per token: projections of x to the values ``x``, the shared key ``B`` and query ``C`` (one
group, all heads), the gate ``z`` and the step ``dt`` per head; a short causal convolution (SiLU) over
``(x, B, C)``; ``dt = softplus(dt + dt_bias)``; per head ``A = −exp(A_log)``, so the state decays by
``exp(dt·A)``; ``h_t = exp(dt_t A) h_{t−1} + B_t (dt_t x_t)ᵀ`` and ``y_t = C_tᵀ h_t + D x_t``, which is the decayed
op with q = C, k = B (broadcast over heads), v = x·dt and the log-decay g = dt·A; then the gated RMSNorm
``norm(y ⊙ silu(z))`` and the output projection.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.decayed_linear_attention import decayed_linear_attention
from .base import Mixer
from .common import token_positions
from .norm import RMSNorm
from .registry import register
from .sequence_parallel import decayed_conv_entering
from .short_conv import ShortConvolution


@register("mamba2")
class Mamba2(Mixer):
    """``q_proj`` makes C, ``k_proj`` B, ``v_proj`` x (``expand·dim`` wide), ``gate_proj`` z, ``dt_proj`` dt: the
    five pieces of Mamba-2's one input projection. On a sequence slice the decayed state of the earlier slices
    enters each row's first document, and the previous slice's last inputs (its halo, in the same exchange) feed the
    convolution's first outputs."""

    supports_sequence_parallel = True

    def __init__(self, dim: int, num_heads: int, *, causal: bool = True, expand: int = 2, state_size: int = 64,
                 conv_size: int = 4, dt_min: float = 0.001, dt_max: float = 0.1, dt_init_floor: float = 1e-4,
                 a_init_range: tuple[float, float] = (1.0, 16.0), norm_eps: float = 1e-5, chunk_size: int = 64,
                 impl: str = "auto", qkv_bias: bool = False, o_bias: bool = False):
        super().__init__(dim, num_heads, causal=causal, qkv_bias=qkv_bias, o_bias=o_bias)
        if not causal:
            raise ValueError("mamba2 is a causal recurrence; it has no non-causal form (build it with causal=True)")
        if expand < 1 or (expand * dim) % num_heads:
            raise ValueError(f"mamba2: expand·dim = {expand}·{dim} must split into num_heads = {num_heads} heads")
        if not 0 < dt_min <= dt_max:
            raise ValueError(f"mamba2: need 0 < dt_min ≤ dt_max; got dt_min={dt_min}, dt_max={dt_max}")
        low, high = a_init_range
        if not 0 < low <= high:
            raise ValueError(f"mamba2: a_init_range must be 0 < low ≤ high; got {tuple(a_init_range)}")
        self.inner, self.state_size, self.chunk_size, self.impl = expand * dim, state_size, chunk_size, impl
        self.head_dim = self.inner // num_heads  # the values' width per head, P
        self.q_proj = nn.Linear(dim, state_size, bias=qkv_bias)   # C
        self.k_proj = nn.Linear(dim, state_size, bias=qkv_bias)   # B
        self.v_proj = nn.Linear(dim, self.inner, bias=qkv_bias)   # x
        self.gate_proj = nn.Linear(dim, self.inner, bias=False)   # z
        self.dt_proj = nn.Linear(dim, num_heads, bias=False)      # dt, before its bias
        self.o_proj = nn.Linear(self.inner, dim, bias=o_bias)
        self.conv = ShortConvolution(self.inner + 2 * state_size, conv_size, activation="silu", bias=True)
        # Mamba-2's init: dt log-uniform in [dt_min, dt_max] through softplus's inverse, A uniform in the range
        dt = torch.exp(torch.rand(num_heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_init_floor)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.A_log = nn.Parameter(torch.empty(num_heads).uniform_(low, high).log())
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = RMSNorm(self.inner, eps=norm_eps)

    @property
    def halo(self) -> int:
        """How many tokens before a slice its convolution reads."""
        return self.conv.halo

    def check_sequence_parallel(self, size: int, slice_len: int) -> None:
        if slice_len < self.halo:
            raise ValueError(f"a slice of {slice_len} tokens is shorter than mamba2's convolution reach "
                             f"({self.halo} tokens): use fewer sequence ranks or a smaller conv_size")

    def forward(self, x, *, cu_seqlens=None, position_ids=None, hw=None):
        batch, seq_len, _ = x.shape
        packed = cu_seqlens is not None
        if position_ids is None:
            position_ids = token_positions(batch, seq_len, cu_seqlens, x.device)
        features, dt = self._features(x), self._dt(x)
        convolved = self.conv(features, position_ids=position_ids)  # zeros before a slice: see below
        values, q, k, v, g = self._heads(convolved, dt, packed=packed)
        initial = None
        if self.sequence is not None:  # the earlier slices' state, and their last features for the first tokens
            self.check_sequence_parallel(self.sequence.size, seq_len)
            initial, before = decayed_conv_entering(k, v, g, features, position_ids, self.sequence,
                                                    cu_seqlens.numel() - 1, halo=self.halo,
                                                    head_keys_values=self._head_keys_values, head_extras=[dt])
            first = self.conv(features[:, :self.halo], position_ids=position_ids[:, :self.halo], before=before)
            values, q, k, v, g = self._heads(torch.cat([first, convolved[:, self.halo:]], dim=1), dt, packed=packed)
        y = decayed_linear_attention(q, k, v, g, cu_seqlens=cu_seqlens, initial_state=initial,
                                     chunk_size=self.chunk_size, impl=self.impl)
        return self._output(x, y.view(batch, seq_len, *y.shape[2:]), values)

    def forward_with_state(self, x, state):
        """The state is the op's ``S [B, H, N, P]`` and the convolution's last ``conv_size − 1`` inputs."""
        attn_state, before = state if state is not None else (None, None)
        features = self._features(x)
        values, q, k, v, g = self._heads(self.conv(features, before=before), self._dt(x))
        impl = "recurrent" if x.shape[1] == 1 else self.impl  # one decoded token: no chunks to set up
        y, attn_state = decayed_linear_attention(q, k, v, g, initial_state=attn_state, output_final_state=True,
                                                 chunk_size=self.chunk_size, impl=impl)
        return self._output(x, y, values), (attn_state, self.conv.tail(features, before))

    def _features(self, x):
        """The convolution's inputs ``(x, B, C)`` side by side, ``[B, T, inner + 2N]``."""
        return torch.cat([self.v_proj(x), self.k_proj(x), self.q_proj(x)], dim=-1)

    def _dt(self, x):
        """The step per token and head, ``softplus(x W_dt + dt_bias)``, ``[B, T, H]``."""
        return F.softplus(self.dt_proj(x) + self.dt_bias)

    def _heads(self, convolved, dt, *, packed=False):
        """From the convolved ``(x, B, C)`` and ``dt``: the values ``[B, T, H, P]`` and the op's q, k, v, g
        (``[1, B·T, ...]`` when ``packed``)."""
        batch, seq_len, _ = convolved.shape
        values, keys, queries = convolved.split([self.inner, self.state_size, self.state_size], dim=-1)
        values = values.view(batch, seq_len, self.num_heads, self.head_dim)
        g = dt * -self.A_log.exp()  # log-decay dt·A ≤ 0
        shape = (1, batch * seq_len) if packed else (batch, seq_len)
        heads = (*shape, self.num_heads, self.state_size)
        q, k = (t.reshape(*shape, 1, self.state_size).expand(heads) for t in (queries, keys))
        v = (values * dt[..., None]).reshape(*shape, self.num_heads, self.head_dim)
        return values, q, k, v, g.reshape(*shape, self.num_heads)

    def _head_keys_values(self, features, before, positions, dt):
        """k, v of a slice's first tokens from their features, the halo ``before`` them, positions and dt."""
        _, _, k, v, _ = self._heads(self.conv(features, position_ids=positions, before=before), dt)
        return k, v

    def _output(self, x, y, values):
        """The D skip, the gated RMSNorm and the output projection."""
        y = (y + self.D[:, None] * values).flatten(2)
        return self.o_proj(self.norm(y * F.silu(self.gate_proj(x))))

    def flops_per_token(self, seq_len: int) -> float:
        """The projections, the convolution, and the recurrent form's state update and read (N·P per head each)."""
        projections = 2 * self.dim * (2 * self.inner + 2 * self.state_size + self.num_heads) + 2 * self.inner * self.dim
        return projections + self.conv.flops_per_token() + 2 * 2 * self.state_size * self.inner
