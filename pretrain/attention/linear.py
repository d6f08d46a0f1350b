"""``linear``: kernelized linear attention (Katharopoulos et al. 2020) around ``ops.linear_attention``.

REFERENCE §1. ``φ(x) = elu(x) + 1`` by default (or relu, identity, or ``[1, x̂]``: the ``cosine`` mixer's);
divisive normalisation or none, usually then with an output norm (a per-head RMSNorm before the output projection).
"""
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.linear_attention import linear_attention
from .common import check_heads, merge_heads, project_heads, projection_flops
from .registry import register


def one_plus_unit(x: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` → ``[..., 1 + D]``: a constant 1 followed by ``x / ‖x‖``, so ``φ(q)·φ(k) = 1 + q̂·k̂``."""
    return torch.cat([torch.ones_like(x[..., :1]), F.normalize(x, dim=-1)], dim=-1)


FEATURE_MAPS = {"elu": lambda x: F.elu(x) + 1, "relu": F.relu, "identity": lambda x: x, "cosine": one_plus_unit}


@register("linear")
class LinearAttention(nn.Module):
    """q/k/v/o projections, a feature map on q and k, and the chunked op; ``step`` decodes one token, ``prefill``
    reads a prompt."""

    supports_causal: ClassVar[bool] = True

    def __init__(self, dim: int, num_heads: int, *, causal: bool = True, feature_map: str = "elu",
                 normalize: str = "divisive", output_norm: bool = False, chunk_size: int = 64, impl: str = "auto"):
        super().__init__()
        self.head_dim = check_heads(dim, num_heads)
        if feature_map not in FEATURE_MAPS:
            raise ValueError(f"feature_map must be one of {sorted(FEATURE_MAPS)}; got {feature_map!r}")
        if normalize not in ("none", "divisive"):
            raise ValueError(f"normalize must be 'none' or 'divisive' for the linear mixer; got {normalize!r}")
        if feature_map == "identity" and normalize == "divisive":
            raise ValueError("feature_map='identity' can make the divisive denominator vanish; "
                             "use normalize='none' (with output_norm=True)")
        self.dim, self.num_heads, self.causal = dim, num_heads, causal
        self.feature_map, self.normalize, self.chunk_size, self.impl = feature_map, normalize, chunk_size, impl
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.out_norm = nn.RMSNorm(self.head_dim) if output_norm else nn.Identity()

    def forward(self, x, *, cu_seqlens=None, position_ids=None, hw=None):
        batch, seq_len, _ = x.shape
        q, k, v = self._qkv(x, packed=cu_seqlens is not None)
        o = linear_attention(q, k, v, causal=self.causal, normalize=self.normalize, cu_seqlens=cu_seqlens,
                             chunk_size=self.chunk_size, impl=self.impl)
        return self.o_proj(merge_heads(self.out_norm(o), batch, seq_len))

    def step(self, x_t, state=None):
        """One token ``[B, C]`` with the state of the tokens before it (None at the start) → ``(y_t, state)``."""
        y, state = self._with_state(x_t[:, None], state, impl="recurrent")
        return y[:, 0], state

    def prefill(self, x):
        """A whole prompt ``[B, T, C]`` in chunks → ``(y, state)``, the state ``step`` goes on from."""
        return self._with_state(x, None, impl=self.impl)

    def _with_state(self, x, state, *, impl):
        q, k, v = self._qkv(x, packed=False)
        o, state = linear_attention(q, k, v, causal=True, normalize=self.normalize, initial_state=state,
                                    output_final_state=True, chunk_size=self.chunk_size, impl=impl)
        return self.o_proj(merge_heads(self.out_norm(o), *x.shape[:2])), state

    def _qkv(self, x, *, packed):
        phi = FEATURE_MAPS[self.feature_map]
        q, k, v = project_heads(x, (self.q_proj, self.k_proj, self.v_proj), self.num_heads, packed=packed)
        return phi(q), phi(k), v

    def flops_per_token(self, seq_len: int) -> float:
        """Four projections and the recurrent form's work: a d×d state update and read per head (seq_len-free)."""
        return projection_flops(self.dim, 4) + 2 * 2 * self.dim * self.head_dim
