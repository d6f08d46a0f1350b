"""``rwkv7``: RWKV-7 "Goose" time mixing (Peng et al. 2025, arXiv 2503.14456) around ``ops.dplr``
(docs/MIXERS.md#rwkv7).

Per head a state ``S [D, D]`` with a decay per key channel and a rank-one removal along the normalized key κ̂ at an
in-context learning rate η per channel: ``S_t = (Diag(w_t) − (η_t ⊙ κ̂_t) κ̂_tᵀ) S_{t−1} + k̃_t v_tᵀ``, read by the
receptance, ``o_t = S_tᵀ r_t``. Each of the six inputs (r, w, k, v, η, g) reads the token and the one before it
(its token shift: ``x + μ ⊙ (x_{t−1} − x)``, zero before a document's first token). The decay, the learning rate
and the output gate come from low-rank projections; the output is a per-head GroupNorm plus the "bonus"
``(r · (ρ ⊙ k̃)) v`` per head, times the gate.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.dplr import dplr_delta_rule
from ..ops.dplr.state import dplr_transition_of_tokens
from ..ops.precision import upcast
from .base import Mixer
from .common import token_positions
from .registry import register
from .sequence_parallel import SliceConvolutions, transition_entering

SHIFTED = ("r", "w", "k", "v", "a", "g")  # the inputs that mix the token with the one before it, in this order


def lora(dim: int, rank: int, activation: nn.Module | None = None, *, bias: bool = True) -> nn.Sequential:
    """``dim → rank → (activation) → dim``, RWKV-7's low-rank projections; the last one starts at zero where it is
    added to a bias (the decay's and the learning rate's: they start at their base values), and keeps that init in
    a model (``keeps_init``: the model's init would draw it and zero the bias, the decay's base included)."""
    up = nn.Linear(rank, dim, bias=bias)
    if bias:
        nn.init.zeros_(up.weight)
        nn.init.zeros_(up.bias)
        up.keeps_init = True
    return nn.Sequential(nn.Linear(dim, rank, bias=False), *(() if activation is None else (activation,)), up)


def paper_rank(dim: int, factor: float, power: float) -> int:
    """RWKV-7's low-rank widths: ``max(32, round(factor · dim^power / 32) · 32)``."""
    return max(32, round(factor * dim ** power / 32) * 32)


@register("rwkv7")
class RWKV7(Mixer):
    """The token shift is a two-tap convolution of the input x, the short convolutions (when on) read what it makes:
    together they read ``conv_reach`` inputs x before a token. On a sequence slice those are the previous slice's
    last ones, which ``SliceConvolutions`` carries in the one all-gather beside the state's map (the delta rule's
    pair, on RWKV-7's transitions). The decoding state is ``(S, the last token's input, short_conv tails)``."""

    supports_sequence_parallel = True

    def __init__(self, dim: int, num_heads: int, *, causal: bool = True, short_conv: int = 0, chunk_size: int = 64,
                 impl: str = "auto", qkv_bias: bool = False, o_bias: bool = False, decay_rank: int | None = None,
                 rate_rank: int | None = None, gate_rank: int | None = None):
        if not causal:
            raise ValueError("rwkv7 is causal only (its state is a recurrence); build it with causal=True")
        super().__init__(dim, num_heads, causal=causal, qkv_bias=qkv_bias, o_bias=o_bias, short_conv=short_conv)
        self.chunk_size, self.impl = chunk_size, impl
        self.shift_mix = nn.Parameter(torch.full((len(SHIFTED), dim), 0.5))  # μ per input and channel
        self.decay_lora = lora(dim, decay_rank or paper_rank(dim, 1.8, 0.5), nn.Tanh())
        self.rate_lora = lora(dim, rate_rank or paper_rank(dim, 1.8, 0.5))
        self.gate_lora = lora(dim, gate_rank or paper_rank(dim, 0.6, 0.8), nn.Sigmoid(), bias=False)
        with torch.no_grad():  # the decay's base from slow (log w ≈ −0.0015) to fast (≈ −0.16) over each head
            ramp = torch.linspace(-6.0, -1.0, self.head_dim).repeat(num_heads)
            self.decay_lora[-1].bias.copy_(ramp)
        self.key_scale = nn.Parameter(torch.full((dim,), 0.85))  # k_k: κ = k ⊙ k_k before it is normalized
        self.key_rate_mix = nn.Parameter(torch.ones(dim))  # k_a: k̃ = k ⊙ (1 + (η − 1) ⊙ k_a)
        self.bonus = nn.Parameter(torch.zeros(num_heads, self.head_dim))  # ρ (r_k)
        self.out_norm = nn.GroupNorm(num_heads, dim, eps=64e-5)

    def forward(self, x, *, cu_seqlens=None, position_ids=None, hw=None):
        batch, seq_len, _ = x.shape
        if position_ids is None:
            position_ids = token_positions(batch, seq_len, cu_seqlens, x.device)
        initial = None
        if self.sequence is None:
            parts = self.convolved([x], position_ids)
        else:
            parts, initial = self._on_slice(x, cu_seqlens, position_ids)
        o, _ = self._mix(parts, packed=cu_seqlens is not None, cu_seqlens=cu_seqlens, initial_state=initial)
        return o

    def _on_slice(self, x, cu_seqlens, position_ids):
        """The per-token parts on this rank's slice, and the state entering each of its packed documents."""
        self.check_sequence_parallel(self.sequence.size, x.shape[1])
        convolutions = SliceConvolutions(self, x, position_ids, self.sequence, remade_riders=True)
        key, v, *riders = self.keys_values(convolutions.early, position_ids)
        initial, packet = transition_entering(key, v, riders, position_ids, self.sequence, cu_seqlens.numel() - 1,
                                              chunk_size=self.chunk_size, convolutions=convolutions,
                                              transition=dplr_transition_of_tokens)
        return convolutions.final(packet), initial  # the first conv_reach tokens again, with the previous rank's x

    def forward_with_state(self, x, state):
        """The state is ``(S [B, H, D, D], the input of the token before x [B, C], short_conv tails)``."""
        S, last, tails = state if state is not None else (None, x.new_zeros(x.shape[0], x.shape[2]), None)
        inputs = self._shifted(x, torch.cat([last[:, None], x[:, :-1]], dim=1))
        projected = self.projections_of(inputs)
        r, k, v = super().convolved(projected, None, tails)  # the base's: the short convolutions alone
        if self.short_conv:
            tails = [conv.tail(p, b) for conv, p, b in zip(self.convolutions(), projected, tails or [None] * 3)]
        impl = "recurrent" if x.shape[1] == 1 else self.impl  # one decoded token: no chunks to set up
        y, S = self._mix(self._parts(inputs, r, k, v), packed=False, initial_state=S, output_final_state=True,
                         impl=impl)
        return y, (S, x[:, -1], tails)

    @property
    def conv_reach(self) -> int:
        """How many inputs x before a token it reads: one for the token shift, ``short_conv − 1`` more for the short
        convolutions of the shifted tokens' projections."""
        return super().conv_reach + 1

    def check_sequence_parallel(self, size: int, slice_len: int) -> None:
        if slice_len < self.conv_reach:
            raise ValueError(f"a slice of {slice_len} tokens is shorter than the {self.conv_reach} tokens before it "
                             f"that rwkv7 reads (1 for its token shift, {self.conv_reach - 1} for short_conv): use "
                             "fewer sequence ranks or a smaller short_conv")

    def projections(self, x):
        """``[x]``: what the token shift reads, so what a sequence slice's halo carries."""
        return [x]

    def convolved(self, inputs, position_ids=None, before=None):
        """The per-token parts (``_parts``) of ``inputs = [x [B, T, C]]`` at ``position_ids`` (a token shift never
        crosses into an earlier document), reaching into ``before = [the conv_reach inputs x just before these]``
        (a sequence slice's halo; None: zeros). The tokens of ``before`` that a tap reads are in the first token's
        document, so their positions continue back from it; the others' are negative and never read."""
        (x,) = inputs
        reach = 0 if before is None else before[0].shape[1]
        if reach:
            x = torch.cat([before[0], x], dim=1)
            back = torch.arange(-reach, 0, device=x.device)
            position_ids = torch.cat([position_ids[:, :1] + back, position_ids], dim=1)
        previous = F.pad(x[:, :-1], (0, 0, 1, 0)) * (position_ids > 0)[..., None].to(x.dtype)
        inputs = self._shifted(x, previous)
        r, k, v = super().convolved(self.projections_of(inputs), position_ids)
        return self._parts({name: t[:, reach:] for name, t in inputs.items()}, *(t[:, reach:] for t in (r, k, v)))

    def keys_values(self, convolved, position_ids):
        """What the state reads per token: the keys k̃ and values, and (remade from the halo) a, b and log w."""
        _, key, v, a, b, log_decay, _ = convolved
        return key, v, a, b, log_decay

    def _shifted(self, x, previous) -> dict[str, torch.Tensor]:
        """Each input's mix of the token and the one before it, ``x + μ ⊙ (x_{t−1} − x)``."""
        delta = previous - x
        return {name: x + delta * mix for name, mix in zip(SHIFTED, self.shift_mix)}

    def projections_of(self, inputs):
        """r, k, v ``[B, T, C]``: the short convolutions' inputs."""
        return [self.q_proj(inputs["r"]), self.k_proj(inputs["k"]), self.v_proj(inputs["v"])]

    def _parts(self, inputs, r, k, v) -> list[torch.Tensor]:
        """What the op and the output read per token, from the shifted inputs and the (convolved) r, k, v: r, k̃, v,
        the op's a = −η ⊙ κ̂ and b = κ̂, log w ``[B, T, H, D]`` (log w fp32 at least) and the output gate
        ``[B, T, C]``."""
        batch, seq_len, _ = r.shape
        heads = (batch, seq_len, self.num_heads, self.head_dim)
        log_decay = -math.exp(-0.5) * torch.sigmoid(upcast(self.decay_lora(inputs["w"]))[0])
        rate = torch.sigmoid(self.rate_lora(inputs["a"]))
        kappa = F.normalize((k * self.key_scale).reshape(heads), dim=-1)
        key = k * (1 + (rate - 1) * self.key_rate_mix)
        rate, key, r, v, log_decay = (t.reshape(heads) for t in (rate, key, r, v, log_decay))
        return [r, key, v, -rate * kappa, kappa, log_decay, self.gate_lora(inputs["g"])]

    def _mix(self, parts, *, packed, impl=None, **options):
        """The op over the per-token parts, then the norm, bonus and gate → ``(y, state or None)``."""
        r, key, v, a, b, log_decay, gate = parts
        batch, seq_len, heads, head_dim = r.shape
        if packed:  # the op's cu_seqlens layout, [1, B·T, H, D]
            r, key, v, a, b, log_decay = (t.reshape(1, batch * seq_len, heads, head_dim)
                                          for t in (r, key, v, a, b, log_decay))
        result = dplr_delta_rule(r, key, v, a, b, log_decay, chunk_size=self.chunk_size, impl=impl or self.impl,
                                 **options)
        o, state = result if isinstance(result, tuple) else (result, None)
        bonus = (r * self.bonus * key).sum(-1, keepdim=True) * v
        normed = self.out_norm(o.reshape(-1, self.dim)).reshape(o.shape)
        y = (normed + bonus).reshape(batch, seq_len, self.dim) * gate
        return self.o_proj(y), state

    def flops_per_token(self, seq_len: int) -> float:
        """The projections (r, k, v, o; the three low-rank ones) and short convolutions, and the recurrent form's
        work per head: decay, read along κ̂, write along η ⊙ κ̂ and k̃, read r, each on a D×D state."""
        ranks = sum(module[0].out_features for module in (self.decay_lora, self.rate_lora, self.gate_lora))
        return self.projection_flops() + 2 * 2.0 * self.dim * ranks + 2 * 5 * self.dim * self.head_dim
