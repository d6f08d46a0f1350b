"""``retnet``: multi-scale retention (Sun et al. 2023, "Retentive Network", arXiv 2307.08621) on
``ops.decayed_linear_attention``.

docs/MIXERS.md#retnet. Per head h a fixed decay γ_h: ``S_t = γ_h S_{t−1} + k_t v_tᵀ``, ``o_t = q_tᵀ S_t`` with k
scaled by ``D^{−1/2}`` and q, k rotated by RoPE at their in-document positions (the paper's xPos without its
scaling, as the released code later did); a per-head RMSNorm (the paper's GroupNorm), the swish gate
``silu(x W_g) ⊙ o``, the output projection. ``decay``: ``retnet`` (``γ_h = 1 − 2^{−5−h}``) or ``lightning``
(Lightning Attention's, MiniMax-01: ALiBi slopes ``s_h`` scaled per layer, ``γ_h = exp(−s_h·(1 − l/(L−1) + 1e−5))``).
``short_conv: K`` (the base class's option, 4 here) puts a causal depthwise convolution (SiLU) on each of q, k and v
(0: none, the paper's layer).
"""
import math

import torch
from torch import nn

from ..ops import rope_rotation
from ..ops.decayed_linear_attention import decayed_linear_attention
from .base import Mixer
from .common import token_positions
from .norm import RMSNorm
from .registry import register
from .sequence_parallel import SliceConvolutions, decayed_linear_attention_entering

DECAYS = ("retnet", "lightning")


def retnet_log_decay(heads: int) -> torch.Tensor:
    """``log γ_h = log(1 − 2^{−5−h})``, fp64 (the last heads sit within 2^{−5−h} of 1)."""
    return torch.log1p(-torch.pow(2.0, -5.0 - torch.arange(heads, dtype=torch.float64)))


def alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi's head slopes (Press et al. 2022): ``2^{−8(h+1)/H}`` for H a power of two, interleaved otherwise."""
    closest = 2 ** math.floor(math.log2(heads))
    slopes = torch.pow(2.0, -8.0 * torch.arange(1, closest + 1, dtype=torch.float64) / closest)
    if closest == heads:
        return slopes
    return torch.cat([slopes, alibi_slopes(2 * closest)[0::2][: heads - closest]])


def lightning_log_decay(heads: int, layer_index: int, num_layers: int) -> torch.Tensor:
    """Lightning Attention's per-layer decay: ALiBi slopes, weaker in deeper layers (near 0 in the last)."""
    depth = layer_index / (num_layers - 1) if num_layers > 1 else 0.0
    return -alibi_slopes(heads) * (1 - depth + 1e-5)


@register("retnet")
class Retention(Mixer):
    """Projections q, k, v, the gate ``gate_proj``; on a sequence slice the decayed state of the earlier slices enters
    each row's first document, and the previous slice's last inputs (its halo, in the same exchange) feed the
    convolution's first outputs."""

    supports_sequence_parallel = True

    def __init__(self, dim: int, num_heads: int, *, causal: bool = True, decay: str = "retnet", layer_index: int = 0,
                 num_layers: int = 1, rope: bool = True, rope_theta: float = 10000.0, short_conv: int = 4,
                 norm_eps: float = 1e-6, chunk_size: int = 64, impl: str = "auto", qkv_bias: bool = False,
                 o_bias: bool = False):
        if not causal:
            raise ValueError("retnet is built causal here (retention's non-causal form is not implemented)")
        super().__init__(dim, num_heads, causal=causal, qkv_bias=qkv_bias, o_bias=o_bias, short_conv=short_conv)
        if decay not in DECAYS:
            raise ValueError(f"retnet: decay must be one of {DECAYS}; got {decay!r}")
        if not 0 <= layer_index < num_layers:
            raise ValueError(f"retnet: layer_index must lie in [0, num_layers = {num_layers}); got {layer_index}")
        self.rope, self.rope_theta, self.chunk_size, self.impl = rope, rope_theta, chunk_size, impl
        self.decay, self.layer_index, self.num_layers = decay, layer_index, num_layers
        self.gate_proj = nn.Linear(dim, dim, bias=False)
        self.group_norm = RMSNorm(self.head_dim, eps=norm_eps)

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """The fixed per-head log-decay ``[H]`` on ``x``'s device, fp32 at least. Made from the options at each call
        (H numbers), never held: a tensor attribute is neither in the state dict nor moved with the module, and a
        model built on the meta device (transformers' ``from_pretrained``) would keep it there."""
        heads = self.num_heads
        g = retnet_log_decay(heads) if self.decay == "retnet" else lightning_log_decay(heads, self.layer_index,
                                                                                      self.num_layers)
        return g.to(device=x.device, dtype=torch.promote_types(x.dtype, torch.float32))

    def forward(self, x, *, cu_seqlens=None, position_ids=None, hw=None):
        batch, seq_len, _ = x.shape
        if position_ids is None:
            position_ids = token_positions(batch, seq_len, cu_seqlens, x.device)
        g = self.log_decay(x)
        initial = None
        if self.sequence is None:
            q, k, v = self._rotated(*self.qkv(x, position_ids=position_ids), position_ids)
        else:
            q, k, v, initial = self._on_slice(x, g, cu_seqlens, position_ids)
        if cu_seqlens is not None:
            q, k, v = (t.reshape(1, batch * seq_len, *t.shape[2:]) for t in (q, k, v))
        o = decayed_linear_attention(q, k, v, g, cu_seqlens=cu_seqlens, initial_state=initial,
                                     chunk_size=self.chunk_size, impl=self.impl)
        return self._output(x, o.view(batch, seq_len, *o.shape[2:]))

    def _on_slice(self, x, g, cu_seqlens, position_ids):
        """The op's q, k, v ``[B, T, H, D]`` on this rank's slice, and the state entering each of its packed
        documents."""
        self.check_sequence_parallel(self.sequence.size, x.shape[1])
        convolutions = SliceConvolutions(self, x, position_ids, self.sequence)
        q, k, v = self._rotated(*self.split(convolutions.early), position_ids)
        initial, packet = decayed_linear_attention_entering(k, v, g.expand(*k.shape[:3]), position_ids,
                                                            self.sequence, cu_seqlens.numel() - 1,
                                                            convolutions=convolutions)
        if self.short_conv:  # the first K − 1 tokens again, now with the previous rank's halo
            q, k, v = self._rotated(*self.split(convolutions.final(packet)), position_ids)
        return q, k, v, initial

    def forward_with_state(self, x, state):
        """The state is the op's ``S [B, H, D, D]``, the short convolutions' tails (None without ``short_conv``) and
        the number of tokens seen (RoPE's next position): an int, or each row's own ``[B]`` for prompts of different
        lengths (``pretrain.models.left_padded``)."""
        batch, seq_len, _ = x.shape
        attn_state, tails, seen = state if state is not None else (None, None, 0)
        seen_by_row = torch.as_tensor(seen, device=x.device).reshape(-1, 1)
        positions = (seen_by_row + torch.arange(seq_len, device=x.device)).expand(batch, seq_len)
        (q, k, v), tails = self.qkv_continuing(x, tails)
        q, k, v = self._rotated(q, k, v, positions)
        impl = "recurrent" if seq_len == 1 else self.impl  # one decoded token: no chunks to set up
        o, attn_state = decayed_linear_attention(q, k, v, self.log_decay(x), initial_state=attn_state,
                                                 output_final_state=True, chunk_size=self.chunk_size, impl=impl)
        return self._output(x, o), (attn_state, tails, seen + seq_len)

    def keys_values(self, convolved, position_ids):
        _, k, v = self._rotated(*self.split(convolved), position_ids)
        return k, v

    def _rotated(self, q, k, v, position_ids):
        """q, k, v ``[B, T, H, D]`` as the op reads them: k scaled by ``D^{−1/2}``, q and k rotated at their positions
        (if asked)."""
        k = k * self.head_dim ** -0.5
        if self.rope:
            rotate = rope_rotation(position_ids, self.head_dim, self.rope_theta, dtype=q.dtype)
            q, k = rotate(q), rotate(k)
        return q, k, v

    def _output(self, x, o):
        """The per-head norm, the swish gate and the output projection."""
        o = self.group_norm(o).flatten(2)
        return self.o_proj(nn.functional.silu(self.gate_proj(x)) * o)

    def flops_per_token(self, seq_len: int) -> float:
        """Four projections and the short convolutions, the gate, and the recurrent form's state update and read
        per head."""
        return self.projection_flops() + 2 * self.dim * self.dim + 2 * 2 * self.dim * self.head_dim
