"""``soft``: SOFT, softmax-free attention (Lu et al. 2021, REFERENCE §6) — vision only, non-causal.

Tied projections (K = Q), scaled by ``d^{-1/4}``; landmarks from a strided ``k×k`` convolution of Q on the image
grid, then LayerNorm and GELU (conv and norm shared across heads); ``ops.soft_attention`` with the Newton–Schulz
pseudo-inverse; plus a depthwise ``conv_size``² convolution of V on the grid. ``forward`` needs ``hw=(H, W)``.

The published landmarks (stride k) number H·W/k², so they grow with the image and the m×m inverse, O(m³), makes
SOFT slower than softmax at high resolution. ``landmark_grid=g`` (ours, not the paper's) average-pools the
strided convolution's output down to at most g×g: m stays ≤ g² at any size, nothing changes where the
convolution already gives ≤ g per side (7 at 224² for the published strides), and the weights carry over.
"""
from typing import ClassVar

import torch.nn.functional as F
from torch import nn

from ..ops import soft_attention
from .common import check_heads, projection_flops, split_heads
from .registry import register


@register("soft")
class SoftAttention(nn.Module):
    supports_causal: ClassVar[bool] = False

    def __init__(self, dim: int, num_heads: int, *, causal: bool = False, landmark_stride: int = 4,
                 landmark_grid: int | None = None, newton_iters: int = 20, symmetric: bool = False,
                 conv_size: int = 3):
        super().__init__()
        if causal:
            raise ValueError("soft has no causal form (its landmarks pool the whole image); use it non-causally")
        self.head_dim = check_heads(dim, num_heads)
        if conv_size % 2 == 0:
            raise ValueError(f"soft: conv_size must be odd; got {conv_size}")
        if landmark_grid is not None and landmark_grid < 1:
            raise ValueError(f"soft: landmark_grid must be ≥ 1 (landmarks per side) or None; got {landmark_grid}")
        self.dim, self.num_heads, self.causal = dim, num_heads, causal
        self.stride, self.grid = landmark_stride, landmark_grid
        self.newton_iters, self.symmetric = newton_iters, symmetric
        self.conv_size = conv_size
        self.q_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.landmark_conv = nn.Conv2d(self.head_dim, self.head_dim, landmark_stride, landmark_stride, bias=False)
        self.landmark_norm = nn.LayerNorm(self.head_dim)
        self.v_conv = nn.Conv2d(dim, dim, conv_size, padding=conv_size // 2, groups=dim, bias=False)

    def forward(self, x, *, cu_seqlens=None, position_ids=None, hw=None):
        """x ``[B, H·W, C]`` on the grid ``hw=(H, W)`` → ``[B, H·W, C]``."""
        batch, tokens, _ = x.shape
        if hw is None or cu_seqlens is not None or hw[0] * hw[1] != tokens:
            raise ValueError(f"soft works on an image grid: pass hw=(H, W) with H·W = {tokens} tokens and no "
                             f"cu_seqlens; got hw={hw}")
        height, width = hw
        if height < self.stride or width < self.stride:
            raise ValueError(f"soft: grid hw={tuple(hw)} is smaller than landmark_stride={self.stride}")
        q = split_heads(self.q_proj(x), self.num_heads, packed=False)
        v = self.v_proj(x)
        out = soft_attention(q * self.head_dim ** -0.25, self._landmarks(q, hw) * self.head_dim ** -0.25,
                             split_heads(v, self.num_heads, packed=False), newton_iters=self.newton_iters,
                             symmetric=self.symmetric)
        grid = v.transpose(1, 2).reshape(batch, self.dim, height, width)
        local = self.v_conv(grid).reshape(batch, self.dim, tokens).transpose(1, 2)
        return self.o_proj(out.reshape(batch, tokens, self.dim) + local)

    def _landmarks(self, q, hw):
        """``[B, n, H, D]`` queries → ``[B, m, H, D]`` landmarks: strided conv per head (pooled to ``landmark_grid``),
        LayerNorm, GELU."""
        batch, _, heads, dim = q.shape
        grid = q.permute(0, 2, 3, 1).reshape(batch * heads, dim, *hw)
        sampled = self.landmark_conv(grid)
        if self.grid is not None and max(sampled.shape[-2:]) > self.grid:
            sampled = F.adaptive_avg_pool2d(sampled, tuple(min(side, self.grid) for side in sampled.shape[-2:]))
        pooled = sampled.flatten(2).transpose(1, 2)  # [B·H, m, D]
        landmarks = F.gelu(self.landmark_norm(pooled))
        return landmarks.reshape(batch, heads, -1, dim).transpose(1, 2)

    def flops_per_token(self, seq_len: int) -> float:
        """Three projections, the landmark conv, ``K1`` and the two ``K1`` products, the depthwise conv; the
        m×m kernel and its Newton–Schulz inverse, shared by all tokens, divided among them. With ``landmark_grid``
        the count is capped at g², exact unless only one side of the grid is pooled (then an upper bound)."""
        landmarks = max(1, seq_len // self.stride ** 2)
        if self.grid is not None:
            landmarks = min(landmarks, self.grid ** 2)
        per_token = 2 * self.dim * self.head_dim + 3 * 2 * landmarks * self.dim + 2 * self.conv_size ** 2 * self.dim
        shared = self.num_heads * (2 * landmarks ** 2 * self.head_dim * 2 + self.newton_iters * 4 * landmarks ** 3)
        return projection_flops(self.dim, 3) + per_token + shared / seq_len
