"""Vision mixers on an image grid: SOFT, AFT-conv and InLine's dynamic 3×3 local branch."""
import pytest
import torch
import torch.nn.functional as F

DIM = 16  # the default width of the make_mixer fixture


@pytest.mark.parametrize("name,options", [("soft", {"landmark_stride": 2}), ("soft", {"symmetric": True}),
                                          ("aft_conv", {"kernel_size": 3}), ("inline", {}), ("linear", {})])
def test_grid_mixers_keep_the_shape_and_see_the_whole_image(make_mixer, name, options):
    mixer = make_mixer(name, causal=False, **options)
    x = torch.randn(2, 32, DIM, dtype=torch.float64)
    y = mixer(x, hw=(4, 8))
    assert y.shape == x.shape
    changed = x.clone()
    changed[:, -1] += 1.0  # the last pixel moves the first one's output: global, non-causal mixing
    assert (mixer(changed, hw=(4, 8))[:, 0] - y[:, 0]).abs().amax() > 1e-6


@pytest.mark.parametrize("name", ["soft", "aft_conv", "inline"])
def test_missing_or_wrong_grid_is_refused(make_mixer, name):
    mixer = make_mixer(name, causal=False)
    x = torch.randn(1, 12, DIM, dtype=torch.float64)
    with pytest.raises(ValueError, match="hw"):
        mixer(x)
    with pytest.raises(ValueError, match="hw"):
        mixer(x, hw=(5, 5))


def test_inline_dynamic_kernel_is_a_per_sample_depthwise_conv(make_mixer):
    """The grouped conv over B·C channels equals convolving each sample with its own kernel."""
    mixer = make_mixer("inline", causal=False)
    x = torch.randn(3, 20, DIM, dtype=torch.float64)
    v = mixer.v_proj(x)
    batched = mixer._dynamic_conv2d(x, v, (4, 5))
    for b in range(3):
        kernel = mixer.kernel_net(x[b].mean(0)[None, :, None]).reshape(DIM, 1, 3, 3)
        image = v[b].T.reshape(1, DIM, 4, 5)
        alone = F.conv2d(image, kernel, padding=1, groups=DIM).reshape(DIM, 20).T
        torch.testing.assert_close(batched[b], alone)


def test_soft_landmark_count_follows_the_stride(make_mixer):
    mixer = make_mixer("soft", causal=False, landmark_stride=2)
    q = torch.randn(2, 48, 2, DIM // 2, dtype=torch.float64)
    assert mixer._landmarks(q, (6, 8)).shape == (2, 12, 2, DIM // 2)
