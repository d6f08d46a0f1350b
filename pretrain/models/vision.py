"""Hierarchical vision backbone (PVT/Swin-shaped): four stages on a grid that halves from one to the next.

A strided convolution embeds patches (stride ``patch_size``), and one of stride 2 starts each later stage, so the
last grid is ``patch_size · 8`` times smaller than the image. Each stage runs pre-norm blocks whose token mixer is
named by ``vision.stage_mixers`` (any registered mixer, built non-causal and given the grid ``hw``). Positions come
from a depthwise 3×3 convolution on the grid in every block (CPVT's conditional position encoding), not from a
table, so a model trained at 224² runs at any size that is a multiple of the output stride, square or not.
Classification: mean over the last grid's tokens, norm, linear head.

Options of a mixer (``model.mixer_options.<name>``) hold for every stage that uses it; an option given as a list
holds one value per stage (SOFT's published landmark strides: ``landmark_stride: [8, 4, 2, 1]``).
"""
import math

import torch
from torch import nn

from ..attention import build_mixer
from ..attention.norm import RMSNorm
from ..config import ModelConfig, VisionConfig
from .layers import SwiGLU, init_weights


def tokens_to_grid(x: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
    """``[B, H·W, C]`` row-major tokens → ``[B, C, H, W]``."""
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], *hw)


def grid_to_tokens(x: torch.Tensor) -> torch.Tensor:
    """``[B, C, H, W]`` → ``[B, H·W, C]`` row-major tokens."""
    return x.flatten(2).transpose(1, 2)


def drop_path(x: torch.Tensor, rate: float, training: bool) -> torch.Tensor:
    """Stochastic depth (Huang et al. 2016): drop a residual branch for whole samples, rescale the kept ones."""
    if not training or rate == 0.0:
        return x
    keep = x.new_empty(x.shape[0], *(1,) * (x.dim() - 1)).bernoulli_(1.0 - rate)
    return x * keep / (1.0 - rate)


def mlp_hidden(dim: int, mlp_ratio: float) -> int:
    """SwiGLU width with the parameters of a GELU MLP of ``mlp_ratio · dim`` (2/3 of it), a multiple of 8."""
    return 8 * math.ceil(2 * mlp_ratio * dim / 3 / 8)


class PatchEmbed(nn.Module):
    """Non-overlapping ``stride × stride`` convolution, then a norm: the stem, and the downsampling between stages."""

    def __init__(self, in_channels: int, dim: int, stride: int, norm_eps: float):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, stride, stride)
        self.norm = RMSNorm(dim, eps=norm_eps)

    def forward(self, grid):
        """``[B, C_in, H, W]`` → tokens ``[B, H/s · W/s, dim]`` and their grid ``(H/s, W/s)``."""
        out = self.proj(grid)
        return self.norm(grid_to_tokens(out)), tuple(out.shape[-2:])

    def flops(self, out_tokens: int) -> float:
        return 2.0 * self.proj.in_channels * self.proj.out_channels * self.proj.stride[0] ** 2 * out_tokens


class VisionBlock(nn.Module):
    """``x + pos(x)``, then pre-norm ``x + mixer(norm(x), hw)`` and ``x + mlp(norm(x))``, branches dropped per sample.

    ``pos`` is a depthwise 3×3 convolution on the grid: it tells each token where its neighbours are at any
    resolution, which the (permutation-invariant) mixers cannot tell themselves.
    """

    def __init__(self, mixer: nn.Module, dim: int, mlp_ratio: float, norm_eps: float, drop_path_rate: float):
        super().__init__()
        self.pos_conv = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.mixer_norm = RMSNorm(dim, eps=norm_eps)
        self.mixer = mixer
        self.ffn_norm = RMSNorm(dim, eps=norm_eps)
        self.ffn = SwiGLU(dim, mlp_hidden(dim, mlp_ratio))
        self.drop_path_rate = drop_path_rate

    def forward(self, x, hw):
        x = x + grid_to_tokens(self.pos_conv(tokens_to_grid(x, hw)))
        x = x + drop_path(self.mixer(self.mixer_norm(x), hw=hw), self.drop_path_rate, self.training)
        return x + drop_path(self.ffn(self.ffn_norm(x)), self.drop_path_rate, self.training)

    def flops(self, tokens: int) -> float:
        """Forward FLOPs over a grid of ``tokens``: position conv, mixer, MLP (norms and adds not counted)."""
        pos = 2.0 * 9 * self.pos_conv.out_channels * tokens
        return pos + tokens * (self.mixer.flops_per_token(tokens) + self.ffn.flops_per_token())


class VisionBackbone(nn.Module):
    """Images ``[B, C, H, W]`` → logits ``[B, num_classes]``; ``layers`` is every block of every stage, in order."""

    def __init__(self, vision: VisionConfig, model: ModelConfig):
        super().__init__()
        dims, depths = list(vision.stage_dims), list(vision.stage_depths)
        heads, mixers = list(vision.stage_heads), list(vision.stage_mixers)
        lengths = {"stage_dims": len(dims), "stage_depths": len(depths), "stage_heads": len(heads),
                   "stage_mixers": len(mixers)}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"vision: one entry per stage in each of {lengths}")
        if vision.num_classes <= 0:
            raise ValueError(f"vision.num_classes must be resolved (> 0), got {vision.num_classes}: set it, or "
                             "load the config with pretrain.tasks.config_checks.load_run_config to take it from the "
                             "shards' manifest")
        self.patch_size = vision.patch_size
        self.output_stride = vision.patch_size * 2 ** (len(dims) - 1)
        self.depths = depths
        self.embeds = nn.ModuleList(
            PatchEmbed(vision.in_channels if i == 0 else dims[i - 1], dims[i],
                       vision.patch_size if i == 0 else 2, model.norm_eps)
            for i in range(len(dims))
        )
        total_depth = sum(depths)
        rates = [vision.drop_path * i / max(1, total_depth - 1) for i in range(total_depth)]  # 0 → drop_path
        blocks = []
        for stage, (dim, depth, num_heads, name) in enumerate(zip(dims, depths, heads, mixers)):
            options = stage_options(model, name, stage, len(dims))
            for _ in range(depth):
                mixer = build_mixer(name, dim, num_heads, causal=False, options=options)
                blocks.append(VisionBlock(mixer, dim, vision.mlp_ratio, model.norm_eps, rates[len(blocks)]))
        self.layers = nn.ModuleList(blocks)
        self.norm = RMSNorm(dims[-1], eps=model.norm_eps)
        self.head = nn.Linear(dims[-1], vision.num_classes)
        init_weights(self, model.init_std, blocks=len(self.layers))

    def check_image_size(self, height: int, width: int) -> None:
        if height % self.output_stride or width % self.output_stride:
            raise ValueError(f"image size {height}x{width} is not a multiple of the output stride "
                             f"{self.output_stride} (vision.patch_size {self.patch_size} × 2 per later stage)")

    def forward(self, images):
        """``images`` ``[B, C, H, W]`` (H, W multiples of ``output_stride``) → logits ``[B, num_classes]``."""
        self.check_image_size(*images.shape[-2:])
        grid, start = images, 0
        for embed, depth in zip(self.embeds, self.depths):
            x, hw = embed(grid)
            for block in self.layers[start:start + depth]:
                x = block(x, hw)
            grid, start = tokens_to_grid(x, hw), start + depth
        return self.head(self.norm(x.mean(1)))

    def flops_per_image(self, height: int, width: int) -> float:
        """Forward FLOPs for one ``height × width`` image (a multiply-add = 2); training ≈ 3×.

        Convolutions, mixers (``flops_per_token`` at each stage's token count), MLPs and the head; norms,
        activations and residual adds are not counted.
        """
        self.check_image_size(height, width)
        total, start = 0.0, 0
        for stage, (embed, depth) in enumerate(zip(self.embeds, self.depths)):
            stride = self.patch_size * 2 ** stage
            tokens = (height // stride) * (width // stride)
            total += embed.flops(tokens) + sum(block.flops(tokens) for block in self.layers[start:start + depth])
            start += depth
        return total + 2.0 * self.head.in_features * self.head.out_features


def stage_options(model_cfg: ModelConfig, name: str, stage: int, num_stages: int) -> dict:
    """``model.mixer_options.<name>`` for one stage: a list value holds one entry per stage."""
    options = dict(model_cfg.mixer_options.get(name) or {})
    for key, value in options.items():
        if isinstance(value, (list, tuple)):
            if len(value) != num_stages:
                raise ValueError(f"model.mixer_options.{name}.{key}: a per-stage list needs {num_stages} entries, "
                                 f"got {len(value)}")
            options[key] = value[stage]
    return options


def build_vision_model(vision: VisionConfig, model: ModelConfig) -> VisionBackbone:
    """The backbone of a run's ``vision`` section (``num_classes`` resolved) and the ``model`` keys it reads
    (``init_std``, ``norm_eps``, ``mixer_options``). A loaded config's nodes convert with ``OmegaConf.to_object``:
    the model takes plain values, never OmegaConf nodes."""
    if not isinstance(vision, VisionConfig) or not isinstance(model, ModelConfig):
        raise TypeError(f"build_vision_model takes pretrain.config's VisionConfig and ModelConfig, got "
                        f"{type(vision).__name__} and {type(model).__name__}; convert a loaded config with "
                        "OmegaConf.to_object(cfg.vision), OmegaConf.to_object(cfg.model)")
    return VisionBackbone(vision, model)
