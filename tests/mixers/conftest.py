"""Shared helpers for the mixer tests: build a mixer in float64 with every parameter random (biases too)."""
import pytest
import torch

from pretrain.attention import build_mixer


def random_mixer(name, *, causal, dim=16, heads=2, seed=0, **options):
    """A float64 mixer whose parameters are all random, so zero-initialised biases and taps take part."""
    torch.manual_seed(seed)
    mixer = build_mixer(name, dim, heads, causal=causal, options=options).double()
    with torch.no_grad():
        for param in mixer.parameters():
            scale = 1.5 / param.shape[-1] ** 0.5 if param.dim() >= 2 else 0.5
            param.normal_(0, scale)
    return mixer


@pytest.fixture
def make_mixer():
    return random_mixer
