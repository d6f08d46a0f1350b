"""``linear``: kernelized linear attention (Katharopoulos et al. 2020) around ``ops.linear_attention``.

docs/MIXERS.md#linear. ``φ(x) = elu(x) + 1`` by default (or relu, identity, or ``[1, x̂]``: the ``cosine`` mixer's);
divisive normalisation or none, usually then with an output norm (a per-head RMSNorm before the output projection).
"""
import torch
import torch.nn.functional as F
from torch import nn

from ..ops.linear_attention import linear_attention
from .base import Mixer
from .norm import RMSNorm
from .registry import register
from .sequence_parallel import SliceConvolutions, linear_attention_entering


def one_plus_unit(x: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` → ``[..., 1 + D]``: a constant 1 followed by ``x / ‖x‖``, so ``φ(q)·φ(k) = 1 + q̂·k̂``."""
    return torch.cat([torch.ones_like(x[..., :1]), F.normalize(x, dim=-1)], dim=-1)


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """``elu(x) + 1``, keeping only its output for backward (``_EluPlusOne``)."""
    return _EluPlusOne.apply(x)


class _EluPlusOne(torch.autograd.Function):
    """``φ(x) = elu(x) + 1``, whose derivative its output gives: 1 where φ > 1 (x > 0), φ itself elsewhere
    (``d eˣ/dx = eˣ``). The op keeps φ(q) and φ(k) anyway, so backward needs no pre-activation q and k: autograd
    through ``F.elu`` would keep them, 2·dim values per token and layer."""

    @staticmethod
    def forward(ctx, x):
        phi = F.elu(x).add_(1)
        ctx.save_for_backward(phi)
        return phi

    @staticmethod
    def backward(ctx, grad):
        phi, = ctx.saved_tensors
        return grad * torch.where(phi > 1, 1, phi)


FEATURE_MAPS = {"elu": elu_plus_one, "relu": F.relu, "identity": lambda x: x, "cosine": one_plus_unit}


@register("linear")
class LinearAttention(Mixer):
    """Projections, a feature map on q and k, and the chunked op; on a sequence slice, the state of the earlier
    slices enters each row's first document."""

    supports_sequence_parallel = True

    def __init__(self, dim: int, num_heads: int, *, causal: bool = True, feature_map: str = "elu",
                 normalize: str = "divisive", output_norm: bool = False, chunk_size: int = 64, impl: str = "auto",
                 short_conv: int = 0, qkv_bias: bool = False, o_bias: bool = False):
        super().__init__(dim, num_heads, causal=causal, qkv_bias=qkv_bias, o_bias=o_bias, short_conv=short_conv)
        if feature_map not in FEATURE_MAPS:
            raise ValueError(f"feature_map must be one of {sorted(FEATURE_MAPS)}; got {feature_map!r}")
        if normalize not in ("none", "divisive"):
            raise ValueError(f"normalize must be 'none' or 'divisive' for the linear mixer; got {normalize!r}")
        if feature_map == "identity" and normalize == "divisive":
            raise ValueError("feature_map='identity' can make the divisive denominator vanish; "
                             "use normalize='none' (with output_norm=True)")
        self.feature_map, self.normalize, self.chunk_size, self.impl = feature_map, normalize, chunk_size, impl
        eps = torch.finfo(torch.float32).eps  # nn.RMSNorm's default for fp32, which this norm used to be
        self.out_norm = RMSNorm(self.head_dim, eps=eps) if output_norm else nn.Identity()

    def forward(self, x, *, cu_seqlens=None, position_ids=None, hw=None):
        batch, seq_len, _ = x.shape
        initial = None
        if self.sequence is None:
            q, k, v = self.qkv(x, cu_seqlens=cu_seqlens, position_ids=position_ids)
        else:
            q, k, v, initial = self._on_slice(x, cu_seqlens, position_ids)
        o = linear_attention(q, k, v, causal=self.causal, normalize=self.normalize, cu_seqlens=cu_seqlens,
                             initial_state=initial, chunk_size=self.chunk_size, impl=self.impl)
        return self.o_proj(self.out_norm(o).reshape(batch, seq_len, self.dim))

    def _on_slice(self, x, cu_seqlens, position_ids):
        """The op's q, k, v on this rank's slice, and the state entering each of its packed documents."""
        convolutions = SliceConvolutions(self, x, position_ids, self.sequence)
        q, k, v = self.features(*self.split(convolutions.early, packed=True))
        initial, packet = linear_attention_entering(k, v, position_ids, self.sequence, self.normalize,
                                                    cu_seqlens.numel() - 1, convolutions=convolutions)
        if self.short_conv:  # the first K − 1 tokens again, now with the previous rank's halo
            q, k, v = self.features(*self.split(convolutions.final(packet), packed=True))
        return q, k, v, initial

    def forward_with_state(self, x, state):
        """The state is the op's and the short convolutions' tails (None without ``short_conv``)."""
        state, tails = state if state is not None else (None, None)
        (q, k, v), tails = self.qkv_continuing(x, tails)
        impl = "recurrent" if x.shape[1] == 1 else self.impl  # one decoded token: no chunks to set up
        o, state = linear_attention(q, k, v, causal=True, normalize=self.normalize, initial_state=state,
                                    output_final_state=True, chunk_size=self.chunk_size, impl=impl)
        return self.o_proj(self.out_norm(o).reshape(*x.shape[:2], self.dim)), (state, tails)

    def features(self, q, k, v):
        phi = FEATURE_MAPS[self.feature_map]
        return phi(q), phi(k), v

    def flops_per_token(self, seq_len: int) -> float:
        """Four projections (and short convolutions) and the recurrent form's work: a d×d state update and read per
        head (seq_len-free)."""
        return self.projection_flops() + 2 * 2 * self.dim * self.head_dim
