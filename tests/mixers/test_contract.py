"""The mixer contract, checked for every registered mixer: what a model, a config and sequence parallelism rely on."""
import inspect

import pytest
import torch

from pretrain.attention import REGISTRY, build_mixer, mixer_options
from pretrain.attention.base import Mixer

from test_mixers import ALL, DIM, HEADS


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_registered_mixer_keeps_the_contract(name):
    cls = REGISTRY[name]
    assert isinstance(cls.supports_causal, bool) and isinstance(getattr(cls, "supports_sequence_parallel", False), bool)
    forward = inspect.signature(cls.forward).parameters
    assert {"cu_seqlens", "position_ids", "hw"} <= set(forward), name
    mixer = build_mixer(name, DIM, HEADS, causal=cls.supports_causal, options=ALL.get(name, {}))
    assert mixer.flops_per_token(64) > 0
    assert isinstance(mixer.o_proj, torch.nn.Linear)  # the model scales its init as a residual output
    if cls.supports_causal:
        assert callable(mixer.step) and callable(mixer.prefill)
    if issubclass(cls, Mixer):  # projections from the base class: the released models' bias options
        assert {"qkv_bias", "o_bias"} <= set(mixer_options(name)), name


@pytest.mark.parametrize("name", sorted(n for n, cls in REGISTRY.items() if issubclass(cls, Mixer)))
def test_projection_biases_are_options(name):
    options = {**ALL.get(name, {}), "qkv_bias": True, "o_bias": True}
    mixer = build_mixer(name, DIM, HEADS, causal=REGISTRY[name].supports_causal, options=options)
    assert all(proj.bias is not None for proj in (mixer.q_proj, mixer.k_proj, mixer.v_proj, mixer.o_proj))
    plain = build_mixer(name, DIM, HEADS, causal=REGISTRY[name].supports_causal, options=ALL.get(name, {}))
    assert all(proj.bias is None for proj in (plain.q_proj, plain.k_proj, plain.v_proj, plain.o_proj))


@pytest.mark.parametrize("name", sorted(n for n, cls in REGISTRY.items() if cls.supports_causal))
def test_decoding_with_biases_continues_the_parallel_form(make_mixer, name):
    """``prefill`` then ``step`` equals ``forward`` with every projection biased (the biases are random here)."""
    mixer = make_mixer(name, causal=True, **ALL.get(name, {}), qkv_bias=True, o_bias=True)
    x = torch.randn(2, 11, DIM, dtype=torch.float64)
    y, state = mixer.prefill(x[:, :7])
    steps = []
    for t in range(7, 11):
        y_t, state = mixer.step(x[:, t], state)
        steps.append(y_t)
    torch.testing.assert_close(torch.cat([y, torch.stack(steps, 1)], 1), mixer(x), rtol=1e-10, atol=1e-10)


# mamba2's short convolution (over x, B, C, its conv_size) is part of the layer, not an option on q, k, v
LINEAR_STATE = {name for name, cls in REGISTRY.items() if cls.supports_causal} - {"softmax", "aft_full", "mamba2"}


@pytest.mark.parametrize("name", sorted(LINEAR_STATE))
def test_every_linear_state_causal_mixer_offers_a_short_convolution(name):
    """``short_conv: K`` on every causal mixer with a fixed-size state (softmax and AFT-full keep every token)."""
    assert "short_conv" in mixer_options(name), name
