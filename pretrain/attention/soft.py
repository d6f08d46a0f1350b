"""``soft``: SOFT, softmax-free attention (Lu et al. 2021; docs/MIXERS.md#soft) — vision only, non-causal.

The released model's function: tied projections (K = Q) with Q scaled by ``d^{-1/4}`` first; landmarks
``GELU(LayerNorm(conv_{k×k, stride k}(Q)))`` on the image grid from that scaled Q (conv and norm shared across
heads), used as they come in both Gaussian kernels; ``ops.soft_attention`` with the Newton–Schulz inverse; plus a
depthwise ``conv_size``² convolution of V on the grid, one kernel per head shared by its channels
(``conv_kernel="per_head"``, released) or one per channel (``"per_channel"``). ``forward`` needs ``hw=(H, W)``.
A released layer's tensors load with ``pretrain.attention.released.load_released_soft``.

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

CONV_KERNELS = ("per_head", "per_channel")


@register("soft")
class SoftAttention(nn.Module):
    supports_causal: ClassVar[bool] = False

    def __init__(self, dim: int, num_heads: int, *, causal: bool = False, landmark_stride: int = 4,
                 landmark_grid: int | None = None, newton_iters: int = 20, symmetric: bool = False,
                 conv_size: int = 3, conv_kernel: str = "per_head", qkv_bias: bool = False, o_bias: bool = False):
        """``qkv_bias`` puts biases on the Q and V projections (there is no K), ``o_bias`` on the output one; the
        released models have both."""
        super().__init__()
        if causal:
            raise ValueError("soft has no causal form (its landmarks pool the whole image); use it non-causally")
        self.head_dim = check_heads(dim, num_heads)
        if conv_size % 2 == 0:
            raise ValueError(f"soft: conv_size must be odd; got {conv_size}")
        if conv_kernel not in CONV_KERNELS:
            raise ValueError(f"soft: conv_kernel must be one of {CONV_KERNELS}; got {conv_kernel!r}")
        if landmark_grid is not None and landmark_grid < 1:
            raise ValueError(f"soft: landmark_grid must be ≥ 1 (landmarks per side) or None; got {landmark_grid}")
        self.dim, self.num_heads, self.causal = dim, num_heads, causal
        self.stride, self.grid = landmark_stride, landmark_grid
        self.newton_iters, self.symmetric = newton_iters, symmetric
        self.conv_size = conv_size
        self.q_proj = nn.Linear(dim, dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, dim, bias=qkv_bias)
        self.o_proj = nn.Linear(dim, dim, bias=o_bias)
        self.landmark_conv = nn.Conv2d(self.head_dim, self.head_dim, landmark_stride, landmark_stride, bias=False)
        self.landmark_norm = nn.LayerNorm(self.head_dim)
        kernels = num_heads if conv_kernel == "per_head" else dim
        self.v_conv = nn.Conv2d(kernels, kernels, conv_size, padding=conv_size // 2, groups=kernels, bias=False)

    def forward(self, x, *, cu_seqlens=None, position_ids=None, hw=None):
        """x ``[B, H·W, C]`` on the grid ``hw=(H, W)`` → ``[B, H·W, C]``."""
        batch, tokens, _ = x.shape
        if hw is None or cu_seqlens is not None or hw[0] * hw[1] != tokens:
            raise ValueError(f"soft works on an image grid: pass hw=(H, W) with H·W = {tokens} tokens and no "
                             f"cu_seqlens; got hw={hw}")
        height, width = hw
        if height < self.stride or width < self.stride:
            raise ValueError(f"soft: grid hw={tuple(hw)} is smaller than landmark_stride={self.stride}")
        q = split_heads(self.q_proj(x), self.num_heads, packed=False) * self.head_dim ** -0.25
        v = self.v_proj(x)
        out = soft_attention(q, self._landmarks(q, hw), split_heads(v, self.num_heads, packed=False),
                             newton_iters=self.newton_iters, symmetric=self.symmetric)
        return self.o_proj(out.reshape(batch, tokens, self.dim) + self._local(v, hw))

    def _landmarks(self, q, hw):
        """Scaled queries ``[B, n, H, D]`` → ``[B, m, H, D]`` landmarks: strided conv per head (pooled to
        ``landmark_grid``), LayerNorm, GELU."""
        batch, _, heads, dim = q.shape
        grid = q.permute(0, 2, 3, 1).reshape(batch * heads, dim, *hw)
        sampled = self.landmark_conv(grid)
        if self.grid is not None and max(sampled.shape[-2:]) > self.grid:
            sampled = F.adaptive_avg_pool2d(sampled, tuple(min(side, self.grid) for side in sampled.shape[-2:]))
        pooled = sampled.flatten(2).transpose(1, 2)  # [B·H, m, D]
        landmarks = F.gelu(self.landmark_norm(pooled))
        return landmarks.reshape(batch, heads, -1, dim).transpose(1, 2)

    def _local(self, v, hw):
        """Depthwise convolution of ``v [B, n, C]`` on the grid; a per-head kernel serves each of its channels."""
        batch, tokens, _ = v.shape
        weight = self.v_conv.weight
        if weight.shape[0] != self.dim:  # per head: channel h·D + i uses kernel h
            weight = weight.repeat_interleave(self.head_dim, dim=0)
        grid = v.transpose(1, 2).reshape(batch, self.dim, *hw)
        local = F.conv2d(grid, weight, padding=self.conv_size // 2, groups=self.dim)
        return local.reshape(batch, self.dim, tokens).transpose(1, 2)

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

