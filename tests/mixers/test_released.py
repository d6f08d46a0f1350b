"""``soft`` and ``inline`` compute the authors' released attention layers (fudan-zvg/SOFT, LeapLabTHU/InLine).

Each reference below is written here from the released layer's formula, in fp64, from tensors given explicitly
under the released names; our mixer gets the same tensors through its loader and must agree to 1e-10.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from pretrain.attention import build_mixer
from pretrain.attention.released import load_released_inline, load_released_soft

DIM, HEADS = 12, 3


def tensors(shapes: dict[str, tuple], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=gen, dtype=torch.float64) / math.sqrt(shape[-1] if len(shape) > 1
                                                                                      else 4)
            for name, shape in shapes.items()}


def released_soft_tensors(dim, heads, stride, conv_size, seed=0):
    d = dim // heads
    return tensors({"W_q.weight": (dim, dim), "W_q.bias": (dim,), "W_v.weight": (dim, dim), "W_v.bias": (dim,),
                    "attn.Qlandmark_op.weight": (d, d, stride, stride),
                    "attn.Qnorm_act.0.weight": (d,), "attn.Qnorm_act.0.bias": (d,),
                    "attn.conv.weight": (heads, 1, conv_size, conv_size),
                    "ff.weight": (dim, dim), "ff.bias": (dim,)}, seed)


def released_inline_tensors(dim, heads, seed=0):
    group = dim // heads
    return tensors({"q.weight": (dim, dim), "q.bias": (dim,), "kv.weight": (2 * dim, dim), "kv.bias": (2 * dim,),
                    "residual.0.weight": (dim, group, 1), "residual.0.bias": (dim,),
                    "residual.2.weight": (9 * dim, group, 1), "residual.2.bias": (9 * dim,),
                    "proj.weight": (dim, dim), "proj.bias": (dim,)}, seed)


def heads_first(x, heads):  # [B, N, C] -> [B, h, N, d]
    return x.reshape(*x.shape[:2], heads, -1).transpose(1, 2)


def gelu(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def gaussian(a, b):  # [..., n, d], [..., m, d] -> exp(-|a_i - b_j|^2 / 2), from the differences
    return torch.exp(-(a[..., :, None, :] - b[..., None, :, :]).square().sum(-1) / 2)


def depthwise(image, kernel):
    """One channel ``image [H, W]`` cross-correlated with ``kernel [k, k]``, zero padding k // 2, by shifts."""
    k = kernel.shape[-1]
    padded = F.pad(image, (k // 2,) * 4)
    height, width = image.shape
    return sum(kernel[i, j] * padded[i:i + height, j:j + width] for i in range(k) for j in range(k))


def released_soft(x, t, heads, hw, stride, iters=20):
    """SOFT's released layer: Q scaled by d^(-1/4) before the landmark conv, LayerNorm (eps 1e-5), exact GELU,
    Gaussian kernels, the Newton iteration on A + 0.01·I from 0.9·2/(max row sum)²·P, and a k×k conv of V per
    head (one kernel for all of the head's channels), all before the output projection."""
    batch, tokens, dim = x.shape
    d, (height, width) = dim // heads, hw
    q = heads_first(x @ t["W_q.weight"].T + t["W_q.bias"], heads) / d ** 0.25
    v = heads_first(x @ t["W_v.weight"].T + t["W_v.bias"], heads)
    grid = q.reshape(batch * heads, height, width, d).permute(0, 3, 1, 2)
    landmarks = F.conv2d(grid, t["attn.Qlandmark_op.weight"], stride=stride)
    landmarks = landmarks.flatten(2).transpose(1, 2).reshape(batch, heads, -1, d)
    mean, var = landmarks.mean(-1, keepdim=True), landmarks.var(-1, unbiased=False, keepdim=True)
    landmarks = (landmarks - mean) / torch.sqrt(var + 1e-5) * t["attn.Qnorm_act.0.weight"] + t["attn.Qnorm_act.0.bias"]
    landmarks = gelu(landmarks)
    k1, a = gaussian(q, landmarks), gaussian(landmarks, landmarks)
    p = a + 0.01 * torch.eye(a.shape[-1], dtype=a.dtype)
    inverse = (0.9 * 2 / a.sum(-1).amax(-1) ** 2)[..., None, None] * p
    for _ in range(iters):
        inverse = 2 * inverse - inverse @ p @ inverse
    out = k1 @ inverse @ (k1.transpose(-1, -2) @ v)  # [B, h, N, d]
    local = torch.stack([torch.stack([torch.stack([
        depthwise(v[b, h, :, c].reshape(height, width), t["attn.conv.weight"][h, 0]).reshape(tokens)
        for c in range(d)], -1) for h in range(heads)]) for b in range(batch)])
    out = (out + local).transpose(1, 2).reshape(batch, tokens, dim)
    return out @ t["ff.weight"].T + t["ff.bias"]


def grouped_1x1(x, weight, bias, groups):
    """A grouped 1×1 convolution of one vector ``x [C_in]``: output o reads only its group's inputs."""
    out_per_group, in_per_group = weight.shape[0] // groups, weight.shape[1]
    return torch.stack([weight[o, :, 0] @ x[(o // out_per_group) * in_per_group:][:in_per_group] + bias[o]
                        for o in range(weight.shape[0])])


def released_inline(x, t, heads, hw):
    """InLine's released layer (sr_ratio 1): ``(s/N)·Q(KᵀV) + (1 − s·Q·k̄)·v̄`` per head with s = d^(-1/2), plus
    V convolved with a 3×3 kernel per sample and channel made from the token mean of x, before the projection."""
    batch, tokens, dim = x.shape
    (height, width), s = hw, (dim // heads) ** -0.5
    q = heads_first(x @ t["q.weight"].T + t["q.bias"], heads)
    kv = x @ t["kv.weight"].T + t["kv.bias"]
    k, v = heads_first(kv[..., :dim], heads), heads_first(kv[..., dim:], heads)
    k_mean, v_mean = k.mean(2, keepdim=True), v.mean(2, keepdim=True)
    out = s / tokens * q @ (k.transpose(-1, -2) @ v) + (1 - s * q @ k_mean.transpose(-1, -2)) * v_mean
    out = out.transpose(1, 2).reshape(batch, tokens, dim)
    values = v.transpose(1, 2).reshape(batch, tokens, dim)
    for b in range(batch):
        hidden = gelu(grouped_1x1(x[b].mean(0), t["residual.0.weight"], t["residual.0.bias"], heads))
        taps = grouped_1x1(hidden, t["residual.2.weight"], t["residual.2.bias"], heads).reshape(dim, 3, 3)
        for c in range(dim):
            local = depthwise(values[b, :, c].reshape(height, width), taps[c]).reshape(tokens)
            out[b, :, c] = out[b, :, c] + local
    return out @ t["proj.weight"].T + t["proj.bias"]


def soft_mixer(stride, conv_size, **options):
    options = {"landmark_stride": stride, "conv_size": conv_size, "qkv_bias": True, "o_bias": True, **options}
    return build_mixer("soft", DIM, HEADS, causal=False, options=options).double()


@pytest.mark.parametrize("hw,stride,conv_size", [((4, 6), 2, 3), ((8, 8), 4, 5), ((6, 3), 3, 1)])
def test_soft_is_the_released_layer(hw, stride, conv_size):
    weights = released_soft_tensors(DIM, HEADS, stride, conv_size)
    mixer = soft_mixer(stride, conv_size)
    load_released_soft(mixer, weights)
    x = torch.randn(2, hw[0] * hw[1], DIM, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch.testing.assert_close(mixer(x, hw=hw), released_soft(x, weights, HEADS, hw, stride), rtol=1e-10, atol=1e-10)


def test_soft_per_channel_conv_is_the_per_head_one_with_kernels_repeated():
    per_head, per_channel = soft_mixer(2, 3), soft_mixer(2, 3, conv_kernel="per_channel")
    per_channel.load_state_dict({**per_head.state_dict(),
                                 "v_conv.weight": per_head.v_conv.weight.repeat_interleave(DIM // HEADS, dim=0)})
    x = torch.randn(1, 16, DIM, dtype=torch.float64)
    torch.testing.assert_close(per_channel(x, hw=(4, 4)), per_head(x, hw=(4, 4)), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="conv_kernel"):
        soft_mixer(2, 3, conv_kernel="per_pixel")


@pytest.mark.parametrize("hw", [(4, 5), (1, 1), (3, 3)])
def test_inline_is_the_released_layer(hw):
    weights = released_inline_tensors(DIM, HEADS)
    mixer = build_mixer("inline", DIM, HEADS, causal=False, options={"qkv_bias": True, "o_bias": True}).double()
    load_released_inline(mixer, weights)
    x = torch.randn(2, hw[0] * hw[1], DIM, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    torch.testing.assert_close(mixer(x, hw=hw), released_inline(x, weights, HEADS, hw), rtol=1e-10, atol=1e-10)


def test_a_released_checkpoints_layer_loads_by_prefix_and_leaves_the_rest():
    """A whole released SOFT-Tiny stage-1 checkpoint slice: dim 64, 2 heads, landmark stride 8, conv 9."""
    prefix = "block1.0.att.mha."
    layer = released_soft_tensors(64, 2, 8, 9)
    checkpoint = {prefix + name: tensor for name, tensor in layer.items()}
    checkpoint |= {"block1.0.att.norm1.weight": torch.ones(64), "block1.1.att.mha.W_q.weight": torch.zeros(64, 64)}
    mixer = build_mixer("soft", 64, 2, causal=False, options={"landmark_stride": 8, "conv_size": 9,
                                                               "qkv_bias": True, "o_bias": True}).double()
    load_released_soft(mixer, checkpoint, prefix=prefix)
    assert torch.equal(mixer.landmark_conv.weight, layer["attn.Qlandmark_op.weight"])
    assert torch.equal(mixer.v_conv.weight, layer["attn.conv.weight"])
    assert torch.equal(mixer.o_proj.bias, layer["ff.bias"])

    fused = released_inline_tensors(64, 2)
    inline = build_mixer("inline", 64, 2, causal=False, options={"qkv_bias": True, "o_bias": True}).double()
    load_released_inline(inline, {"block2.1.attn." + name: tensor for name, tensor in fused.items()},
                         prefix="block2.1.attn.")
    assert torch.equal(inline.k_proj.weight, fused["kv.weight"][:64])
    assert torch.equal(inline.v_proj.bias, fused["kv.bias"][64:])
    assert torch.equal(inline.kernel_net[2].weight, fused["residual.2.weight"])


def test_a_mismatched_released_layer_is_refused_by_name():
    weights = released_soft_tensors(DIM, HEADS, 2, 3)
    with pytest.raises(KeyError, match="W_v.bias"):
        load_released_soft(soft_mixer(2, 3), {k: t for k, t in weights.items() if k != "W_v.bias"})
    with pytest.raises(ValueError, match=r"attn.conv.weight.*\(3, 1, 3, 3\).*\(3, 1, 5, 5\)"):
        load_released_soft(soft_mixer(2, 5), weights)
    with pytest.raises(ValueError, match=r"W_q.bias.*qkv_bias"):
        load_released_soft(build_mixer("soft", DIM, HEADS, causal=False, options={"landmark_stride": 2}), weights)
    inline = build_mixer("inline", DIM, HEADS, causal=False, options={"qkv_bias": True, "o_bias": True})
    with pytest.raises(ValueError, match="sr_ratio"):
        load_released_inline(inline, {**released_inline_tensors(DIM, HEADS), "sr.weight": torch.zeros(1)})
