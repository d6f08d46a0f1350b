"""``kda``: Kimi Delta Attention (Kimi Linear, Moonshot AI 2025) around ``ops.dplr`` (docs/MIXERS.md#kda).

The gated delta rule with one decay per key channel instead of per head:
``S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t−1} + β_t k_t v_tᵀ``, a diagonal-plus-low-rank transition
(``a = −β k``, ``b = α ⊙ k``, keys ``β k``). Everything else is ``deltanet``'s (SiLU short convolutions on q, k, v,
L2-normalized q and k, ``β = sigmoid(W_β x)``, a per-head RMSNorm of the output, decoding state, sequence
parallelism), whose class this extends. As flash-linear-attention's ``KimiDeltaAttention``: the gate's
``W_α`` and the output gate are low-rank (``dim → rank → dim``, rank = head_dim), the log-decay
``g = −exp(A_log_h) · softplus(x W_α + dt_bias)`` per channel (A per head, dt per channel, Mamba-2's init), and the
output gate is a sigmoid. ``gate_bias`` says where that gate starts: the released code's 0 opens it halfway; −2
starts it nearly shut, as Gated DeltaNet's SiLU gate starts near zero (MIXERS.md#kda: what that is worth at small
budgets).
"""
import torch
import torch.nn.functional as F
from torch import nn

from ..ops.dplr import kda_delta_rule
from ..ops.dplr.state import dplr_transition_of_tokens
from ..ops.precision import upcast
from .common import MAMBA2_A_INIT_RANGE, MAMBA2_DT_INIT_FLOOR, MAMBA2_DT_MAX, MAMBA2_DT_MIN, mamba2_decay_init
from .deltanet import DeltaNet
from .registry import register


def low_rank(dim: int, rank: int, *, bias: bool) -> nn.Sequential:
    """``dim → rank → dim``: KDA's gate projections, a fraction of a full ``dim × dim`` one."""
    return nn.Sequential(nn.Linear(dim, rank, bias=False), nn.Linear(rank, dim, bias=bias))


def kda_transition(k, beta, g):
    """KDA's ``(I − β k kᵀ) Diag(e^g)`` and write ``β k vᵀ`` as the DPLR op's keys, a and b ``[B, T, H, D]`` (for the
    slice's map, which the general op computes)."""
    write = beta[..., None] * k
    return write, -write, g.exp().to(k.dtype) * k


@register("kda")
class KimiDeltaAttention(DeltaNet):
    """``deltanet`` with KDA's per-channel gate, low-rank gate projections and sigmoid output gate."""

    def __init__(self, dim: int, num_heads: int, *, causal: bool = True, short_conv: int = 4, chunk_size: int = 64,
                 impl: str = "auto", qkv_bias: bool = False, o_bias: bool = False, gate_rank: int | None = None,
                 dt_min: float | None = None, dt_max: float | None = None, a_init_range=None,
                 gate_bias: float = 0.0):
        if not causal:
            raise ValueError("kda is causal only (its state is a recurrence); build it with causal=True")
        super().__init__(dim, num_heads, causal=causal, short_conv=short_conv, chunk_size=chunk_size, impl=impl,
                         qkv_bias=qkv_bias, o_bias=o_bias)
        rank = self.head_dim if gate_rank is None else gate_rank
        if rank < 1:
            raise ValueError(f"kda: gate_rank must be ≥ 1; got {gate_rank}")
        self.out_gate_proj = low_rank(dim, rank, bias=True)  # in place of deltanet's full-rank one
        # added to the gate's learned bias, which starts at zero (models.layers.init_weights): its starting point
        self.gate_bias = float(gate_bias)
        self.decay_proj = low_rank(dim, rank, bias=False)
        init = dict(dt_min=MAMBA2_DT_MIN if dt_min is None else dt_min, dt_max=MAMBA2_DT_MAX if dt_max is None
                    else dt_max, a_init_range=MAMBA2_A_INIT_RANGE if a_init_range is None else a_init_range,
                    dt_init_floor=MAMBA2_DT_INIT_FLOOR)
        self.A_log = mamba2_decay_init("kda", num_heads, **init)[0]  # A per head
        self.dt_bias = mamba2_decay_init("kda", dim, **init)[1]  # dt per channel

    def log_decay(self, x):
        """``g [B, T, H, D]``, fp32 at least (the op sums it over a chunk)."""
        decay = upcast(self.decay_proj(x))[0]
        rate = self.A_log.to(decay.dtype).exp().repeat_interleave(self.head_dim)
        g = -rate * F.softplus(decay + self.dt_bias.to(decay.dtype))
        return g.unflatten(-1, (self.num_heads, self.head_dim))

    @staticmethod
    def op(q, k, v, beta, g, **options):
        return kda_delta_rule(q, k, v, beta, g, **options)

    @staticmethod
    def transition_of_tokens(k, v, beta, g, mask, *, chunk_size):
        keys, a, b = kda_transition(k, beta, g)
        return dplr_transition_of_tokens(keys, v, a, b, g, mask, chunk_size=chunk_size)

    def _output(self, o, x):
        gate = torch.sigmoid(self.out_gate_proj(x) + self.gate_bias).reshape(o.shape)
        return self.o_proj((self.out_norm(o) * gate).reshape(*x.shape[:2], self.dim))

    def flops_per_token(self, seq_len: int) -> float:
        """The projections (q, k, v, o; β per head; the two low-rank gates) and short convolutions, and the recurrent
        form's work per head: decay, read along b, write along a and k, read q, each on a D×D state."""
        rank = self.out_gate_proj[0].out_features
        return (self.projection_flops() + 2.0 * self.dim * self.num_heads + 2 * 2 * 2.0 * self.dim * rank
                + 2 * 5 * self.dim * self.head_dim)
