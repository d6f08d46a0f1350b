"""The hierarchical vision backbone: every stage-mixer variant, any resolution and aspect, FLOPs, meta build."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from pretrain.config import ModelConfig, VisionConfig
from pretrain.models import build_vision_model
from pretrain.models.vision import drop_path

SOFT_STRIDES = {"soft": {"landmark_stride": [8, 4, 2, 1]}}  # SOFT's published per-stage strides
SOFT_GRID = {"soft": {"landmark_stride": [2, 1, 1, 1], "landmark_grid": 2}}  # at most 2×2 landmarks per stage

VARIANTS = {  # name: (stage_mixers, mixer_options)
    "soft": (["soft", "soft", "soft", "softmax"], SOFT_STRIDES),
    "soft_grid": (["soft", "soft", "soft", "softmax"], SOFT_GRID),
    "inline": (["inline"] * 4, {}),
    "inline_hybrid": (["inline", "inline", "softmax", "softmax"], {}),
    "aft_conv": (["aft_conv"] * 4, {"aft_conv": {"kernel_size": 3}}),
    "linear": (["linear"] * 4, {}),
    "cosine": (["cosine"] * 4, {}),
    "efficient": (["efficient"] * 4, {}),
    "softmax": (["softmax"] * 4, {}),
}


def tiny_config(stage_mixers, mixer_options=None, **vision) -> tuple[VisionConfig, ModelConfig]:
    """The two sections the backbone reads: tiny widths, one block per stage, 10 classes."""
    return (VisionConfig(**{"image_size": 32, "num_classes": 10, "in_channels": 3, "patch_size": 4,
                            "stage_dims": [16, 32, 48, 64], "stage_depths": [1, 1, 1, 1], "stage_heads": [1, 2, 2, 4],
                            "stage_mixers": list(stage_mixers), "mlp_ratio": 2.0, "drop_path": 0.0, **vision}),
            ModelConfig(init_std=0.02, norm_eps=1e-5, mixer_options=mixer_options or {}))


def tiny_model(variant, seed=0, **vision):
    torch.manual_seed(seed)
    return build_vision_model(*tiny_config(*VARIANTS[variant], **vision))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_trains_at_two_resolutions(variant):
    """At 64 px every parameter learns; at 32 px the last grid is one token, where e.g. efficient attention's
    softmax of the keys over the tokens is a constant 1 and its key projection rightly gets no gradient."""
    model = tiny_model(variant)
    for size in (32, 64):
        model.zero_grad()
        logits = model(torch.randn(2, 3, size, size))
        assert logits.shape == (2, 10) and logits.isfinite().all()
        logits.logsumexp(-1).sum().backward()
        assert all(p.grad.isfinite().all() for p in model.parameters() if p.grad is not None)
    silent = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not silent, f"{variant} at 64 px: no gradient reaches {silent}"


@pytest.mark.parametrize("variant", ["linear", "softmax", "aft_conv", "soft", "soft_grid"])
def test_a_non_square_grid_keeps_rows_and_columns_apart(variant):
    """Transposing the image and every 2-D kernel must transpose nothing else: the mixers here are blind to token
    order beyond their kernels, and pooling is a mean, so the logits stay the same. A grid read with H and W swapped
    anywhere would scramble the neighbourhoods and change them."""
    model = tiny_model(variant).eval()
    images = torch.randn(2, 3, 32, 64)
    with torch.no_grad():
        logits = model(images)
        for name, param in model.named_parameters():
            if param.dim() == 4 or name.endswith("pos_bias"):  # conv weights [O, I, kh, kw]; AFT's [heads, k, k]
                param.copy_(param.transpose(-1, -2).clone())
        transposed = model(images.transpose(-1, -2))
        mirrored = model(images.flip(-1))
    torch.testing.assert_close(transposed, logits, rtol=1e-4, atol=1e-5)  # fp32 sums in another order
    assert (mirrored - logits).abs().amax() > 1e-3  # while a mirror image is another image


def test_weights_trained_at_one_resolution_run_at_others(tmp_path):
    model = tiny_model("soft", drop_path=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    images, labels = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    for _ in range(2):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
    torch.save(model.state_dict(), tmp_path / "model.pt")

    restored = tiny_model("soft", seed=1, image_size=64)
    restored.load_state_dict(torch.load(tmp_path / "model.pt"))
    model.eval(), restored.eval()
    with torch.no_grad():
        for size in [(64, 64), (96, 32)]:
            wide = torch.randn(2, 3, *size)
            assert restored(wide).isfinite().all()
            torch.testing.assert_close(restored(wide), model(wide))
        assert (restored(images) - tiny_model("soft", seed=1).eval()(images)).abs().amax() > 1e-4


@pytest.mark.parametrize("variant", ["softmax", "soft", "soft_grid", "linear", "aft_conv"])
def test_flops_per_image_matches_the_counted_matmuls_and_convolutions(variant):
    """PyTorch's FLOP counter sees every matmul and convolution that runs (softmax attention through the math
    kernel, which it can count). Softmax and SOFT mixers count exactly those; the linear-time mixers also count a
    few elementwise terms (normalizers, gates), a few percent at these widths. (inline is left out: its
    ``flops_per_token`` omits the per-image kernel network of its dynamic convolution, 3 % here.)"""
    model = tiny_model(variant).eval()
    for height, width in [(32, 64), (64, 64)]:
        with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH), torch.no_grad():
            model(torch.randn(1, 3, height, width))
        counted = counter.get_total_flops()
        rel = 1e-9 if variant.startswith("soft") else 0.03
        assert model.flops_per_image(height, width) == pytest.approx(counted, rel=rel), (height, width)


def test_flops_grow_linearly_with_pixels_for_linear_mixers_and_faster_for_softmax():
    linear, softmax = tiny_model("linear"), tiny_model("softmax")
    head = 2 * 64 * 10
    assert linear.flops_per_image(128, 128) - head == pytest.approx(4 * (linear.flops_per_image(64, 64) - head))
    assert softmax.flops_per_image(128, 128) - head > 4.5 * (softmax.flops_per_image(64, 64) - head)


def test_soft_landmark_grid_caps_the_landmarks_and_changes_nothing_below_the_cap():
    """Published SOFT's landmarks grow with the image (FLOPs more than ×4 per ×4 pixels: the m³ inverse); with
    ``landmark_grid`` their number stops at g² and the FLOPs grow slower than the pixels. Where the strided
    convolution gives at most g per side nothing is pooled, so the model equals the published one."""
    mixers, strides = ["soft"] * 4, {"landmark_stride": [2, 1, 1, 1]}
    torch.manual_seed(0)
    grown = build_vision_model(*tiny_config(mixers, {"soft": strides})).eval()
    torch.manual_seed(0)
    capped = build_vision_model(*tiny_config(mixers, {"soft": {**strides, "landmark_grid": 4}})).eval()
    small = torch.randn(1, 3, 32, 32)  # stage grids 8, 4, 2, 1: landmarks 4×4, 4×4, 2×2, 1, all within the cap
    with torch.no_grad():
        torch.testing.assert_close(capped(small), grown(small))

        first = (grown.layers[0].mixer, capped.layers[0].mixer)  # stride 2, 1 head of 16 channels
        q = torch.randn(1, 32 * 48, 1, 16)
        assert [mixer._landmarks(q, (32, 48)).shape[1] for mixer in first] == [16 * 24, 4 * 4]
    head = 2 * 64 * 10
    growth = [(model.flops_per_image(512, 512) - head) / (model.flops_per_image(256, 256) - head)
              for model in (grown, capped)]
    assert growth[0] > 4.0 >= growth[1], growth


def test_builds_on_the_meta_device_with_the_same_parameters():
    config = tiny_config(*VARIANTS["soft"])
    with torch.device("meta"):
        on_meta = build_vision_model(*config)
    shapes = {name: p.shape for name, p in build_vision_model(*config).named_parameters()}
    assert {name: p.shape for name, p in on_meta.named_parameters()} == shapes
    assert all(p.is_meta for p in on_meta.parameters())
    assert len(on_meta.layers) == 4


def test_layers_are_every_block_and_take_activation_checkpointing():
    """``model.layers`` holds each block once, in order; wrapped by the trainer's DeepSpeed checkpointing (blocks
    called positionally as ``block(x, hw)``), training gives the same gradients, stochastic depth included."""
    from pretrain.distributed.activation_checkpointing import apply_activation_checkpointing

    model = tiny_model("inline_hybrid", drop_path=0.5, stage_depths=[2, 1, 1, 1])
    assert len(model.layers) == 5 and [b.drop_path_rate for b in model.layers] == pytest.approx(
        [0.0, 0.125, 0.25, 0.375, 0.5])
    images = torch.randn(4, 3, 32, 32)

    def gradients():
        model.zero_grad()
        torch.manual_seed(7)
        model(images).square().sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = gradients()
    apply_activation_checkpointing(model)
    for a, b in zip(plain, gradients()):
        torch.testing.assert_close(a, b)


def test_drop_path_drops_whole_samples_and_keeps_the_mean():
    torch.manual_seed(0)
    x = torch.ones(20000, 3, 2)
    out = drop_path(x, 0.25, training=True)
    kept = out[:, 0, 0] != 0
    assert (out[kept] == 1 / 0.75).all() and (out[~kept] == 0).all()  # per sample: all kept or all dropped
    assert kept.float().mean().item() == pytest.approx(0.75, abs=0.01)
    assert out.mean().item() == pytest.approx(1.0, abs=0.02)
    assert torch.equal(drop_path(x, 0.25, training=False), x)


def test_softmax_on_a_grid_has_no_rope():
    """With ``hw`` the softmax mixer is blind to token order (the backbone's convolution brings positions); the
    LM's call without ``hw`` still rotates q and k by position."""
    from pretrain.attention import build_mixer

    torch.manual_seed(0)
    mixer = build_mixer("softmax", 16, 2, causal=False).double()
    x, order = torch.randn(2, 12, 16, dtype=torch.float64), torch.randperm(12)
    torch.testing.assert_close(mixer(x[:, order], hw=(3, 4)), mixer(x, hw=(3, 4))[:, order])
    assert (mixer(x[:, order]) - mixer(x)[:, order]).abs().amax() > 1e-6


@pytest.mark.parametrize("size", [(36, 32), (32, 48)])
def test_an_image_size_off_the_output_stride_is_refused_naming_it(size):
    model = tiny_model("linear")
    with pytest.raises(ValueError, match=f"{size[0]}x{size[1]}.*output stride 32"):
        model(torch.randn(1, 3, *size))
    with pytest.raises(ValueError, match=f"{size[0]}x{size[1]}"):
        model.flops_per_image(*size)


def test_bad_stage_lists_are_refused_naming_the_key():
    with pytest.raises(ValueError, match="stage_heads"):
        build_vision_model(*tiny_config(["linear"] * 4, stage_heads=[1, 2, 4]))
    with pytest.raises(ValueError, match="mixer_options.soft.landmark_stride"):
        build_vision_model(*tiny_config(["soft"] * 4, {"soft": {"landmark_stride": [8, 4]}}))
    with pytest.raises(ValueError, match="num_classes"):
        build_vision_model(*tiny_config(["linear"] * 4, num_classes=0))
