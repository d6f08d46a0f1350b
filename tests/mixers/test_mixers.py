"""The mixer contract for every seed mixer: registry names, causality, packed documents, gradients, FLOPs."""
import pytest
import torch

from pretrain.attention import REGISTRY, build_mixer
from pretrain.ops import cu_seqlens_from_position_ids

DIM, HEADS = 16, 2  # the default size of the make_mixer fixture
SEQUENCE_MIXERS = {  # name → options small enough for short test sequences
    "linear": {}, "cosine": {}, "efficient": {"chunk_size": 4}, "inline": {},
    "aft_full": {"max_seq_len": 32}, "aft_local": {"window": 3, "chunk_size": 4}, "aft_simple": {"chunk_size": 4},
}
CAUSAL_ONLY = {  # recurrences without a non-causal form: decayed (retnet, mamba2), the delta rule
    "retnet": {"chunk_size": 4}, "mamba2": {"chunk_size": 4, "state_size": 8},
    "deltanet": {"chunk_size": 4}, "gated_deltanet": {"chunk_size": 4}, "kda": {"chunk_size": 4},
    "rwkv7": {"chunk_size": 4},
}
VISION_ONLY = {"soft": {"landmark_stride": 2}, "aft_conv": {"kernel_size": 3}}
ALL = {**SEQUENCE_MIXERS, **CAUSAL_ONLY, **VISION_ONLY}
CAUSAL = {**SEQUENCE_MIXERS, **CAUSAL_ONLY}


def test_every_seed_mixer_is_registered():
    assert set(ALL) <= set(REGISTRY)


@pytest.mark.parametrize("name", sorted(CAUSAL_ONLY))
def test_mixers_without_a_non_causal_form_refuse_one(name):
    with pytest.raises(ValueError, match=f"{name} .*causal"):
        build_mixer(name, DIM, HEADS, causal=False)


def test_gated_deltanet_is_deltanet_with_the_gate():
    plain, gated = (build_mixer(name, DIM, HEADS, causal=True) for name in ("deltanet", "gated_deltanet"))
    assert not plain.gate and gated.gate and type(gated).__mro__[1] is type(plain)
    assert {"A_log", "dt_bias", "decay_proj.weight"} <= {n for n, _ in gated.named_parameters()}
    assert not any("decay" in n or n in ("A_log", "dt_bias") for n, _ in plain.named_parameters())


def test_kda_gate_bias_is_where_its_output_gate_starts():
    """With the gate's weights and bias at zero it is sigmoid(gate_bias) everywhere: the output scales with it."""
    x = torch.randn(2, 9, DIM)
    outs = []
    for bias in (0.0, -2.0):
        torch.manual_seed(0)
        mixer = build_mixer("kda", DIM, HEADS, causal=True, options={"chunk_size": 4, "gate_bias": bias})
        torch.nn.init.zeros_(mixer.out_gate_proj[1].weight)
        torch.nn.init.zeros_(mixer.out_gate_proj[1].bias)  # as init_weights leaves it
        outs.append(mixer(x))
    torch.testing.assert_close(outs[1], outs[0] * torch.sigmoid(torch.tensor(-2.0)) / 0.5)


@pytest.mark.parametrize("name", sorted(VISION_ONLY))
def test_mixers_without_a_causal_form_are_refused_for_a_causal_model(name):
    with pytest.raises(ValueError, match=f"{name!r} has no causal form"):
        build_mixer(name, DIM, HEADS, causal=True)
    with pytest.raises(ValueError, match="no causal form"):
        REGISTRY[name](DIM, HEADS, causal=True)


def test_unknown_and_bad_options_are_named():
    with pytest.raises(ValueError, match="windw"):
        build_mixer("aft_local", DIM, HEADS, causal=True, options={"windw": 4})
    with pytest.raises(ValueError, match="feature_map"):
        build_mixer("linear", DIM, HEADS, causal=True, options={"feature_map": "tanh"})
    with pytest.raises(ValueError, match="identity"):
        build_mixer("linear", DIM, HEADS, causal=True, options={"feature_map": "identity"})


@pytest.mark.parametrize("name", sorted(CAUSAL))
def test_causal_output_ignores_the_future(make_mixer, name):
    mixer = make_mixer(name, causal=True, **CAUSAL[name])
    x = torch.randn(2, 20, DIM, dtype=torch.float64)
    changed = x.clone()
    changed[:, 12:] += torch.randn_like(changed[:, 12:])
    y, y_changed = mixer(x), mixer(changed)
    torch.testing.assert_close(y[:, :12], y_changed[:, :12], rtol=1e-10, atol=1e-10)
    assert (y[:, 12:] - y_changed[:, 12:]).abs().amax() > 1e-3


@pytest.mark.parametrize("name,causal", [(name, causal) for name in sorted(CAUSAL) for causal in (True, False)
                                         if causal or name not in CAUSAL_ONLY])
def test_packed_documents_equal_separate_sequences(make_mixer, name, causal):
    """Rows [d0 d1 | d2 d3 d4] packed with cu_seqlens give what each document gives alone."""
    options = dict(CAUSAL[name])
    if name == "inline" and not causal:
        options["local"] = False  # its non-causal local branch is the 2-D image convolution
    mixer = make_mixer(name, causal=causal, **options)
    lengths = [[7, 9], [5, 1, 10]]
    x = torch.randn(2, 16, DIM, dtype=torch.float64, requires_grad=True)
    position_ids = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths])
    packed = mixer(x, cu_seqlens=cu_seqlens_from_position_ids(position_ids), position_ids=position_ids)
    for row, row_lengths in enumerate(lengths):
        start = 0
        for n in row_lengths:
            alone = mixer(x[row:row + 1, start:start + n], position_ids=torch.arange(n)[None])
            torch.testing.assert_close(packed[row:row + 1, start:start + n], alone, rtol=1e-10, atol=1e-10)
            start += n
    packed.square().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().amax() > 0


SHORT_CONV = ["aft_local", "aft_simple", "cosine", "efficient", "inline", "linear"]  # the linear-state causal mixers


@pytest.mark.parametrize("name", SHORT_CONV)
def test_short_conv_never_crosses_a_document_start(make_mixer, name):
    """Packed rows with one-token documents and documents shorter than the K − 1 = 3 taps give what each document
    gives alone, gradients included: no tap reads the document before."""
    mixer = make_mixer(name, causal=True, **SEQUENCE_MIXERS[name], short_conv=4)
    lengths = [[2, 1, 9], [5, 1, 1, 5]]
    x = torch.randn(2, 12, DIM, dtype=torch.float64, requires_grad=True)
    position_ids = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths])
    packed = mixer(x, cu_seqlens=cu_seqlens_from_position_ids(position_ids), position_ids=position_ids)
    upstream = torch.randn_like(packed)
    packed_grad, = torch.autograd.grad((packed * upstream).sum(), x)
    for row, row_lengths in enumerate(lengths):
        start = 0
        for n in row_lengths:
            part = slice(start, start + n)
            piece = x[row:row + 1, part].detach().requires_grad_()
            alone = mixer(piece)
            alone_grad, = torch.autograd.grad((alone * upstream[row:row + 1, part]).sum(), piece)
            torch.testing.assert_close(packed[row:row + 1, part], alone, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(packed_grad[row:row + 1, part], alone_grad, rtol=1e-10, atol=1e-10)
            start += n


@pytest.mark.parametrize("name", SHORT_CONV)
def test_short_conv_changes_the_mixer_and_is_counted(make_mixer, name):
    """K taps over q, k and v: three depthwise kernels with their FLOPs, trained like the rest; 0 leaves the mixer
    as it was (no parameters, so old checkpoints load)."""
    plain = make_mixer(name, causal=True, **SEQUENCE_MIXERS[name])
    mixer = make_mixer(name, causal=True, **SEQUENCE_MIXERS[name], short_conv=4)
    extra = {key: p.shape for key, p in mixer.named_parameters() if key not in dict(plain.named_parameters())}
    assert extra == {f"{x}_conv.weight": (DIM, 4) for x in "qkv"}
    assert mixer.flops_per_token(32) == plain.flops_per_token(32) + 3 * 2 * 4 * DIM
    x = torch.randn(2, 10, DIM, dtype=torch.float64)
    mixer(x).square().sum().backward()
    assert all(mixer.get_parameter(key).grad.abs().amax() > 0 for key in extra)
    with pytest.raises(ValueError, match="short_conv must be ≥ 0"):
        build_mixer(name, DIM, HEADS, causal=True, options={**SEQUENCE_MIXERS[name], "short_conv": -1})


@pytest.mark.parametrize("name", sorted(ALL))
def test_gradients_reach_every_parameter(make_mixer, name):
    options = ALL[name]
    mixer = make_mixer(name, causal=name in CAUSAL_ONLY, **options)
    x = torch.randn(2, 24, DIM, dtype=torch.float64)
    mixer(x, hw=(4, 6)).square().sum().backward()
    for pname, param in mixer.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), pname
        if pname != "pos_bias" or name != "aft_full":  # rows/columns beyond T=24 of a 32×32 bias stay unused
            assert param.grad.abs().amax() > 0, pname


@pytest.mark.parametrize("name", sorted(ALL))
def test_flops_per_token_counts_the_projections_and_more(name):
    options = ALL[name]
    mixer = build_mixer(name, DIM, HEADS, causal=name not in VISION_ONLY, options=options)
    projections = 2 * DIM * DIM * sum(isinstance(m, torch.nn.Linear) for m in mixer.modules())
    flops = mixer.flops_per_token(32)
    assert projections < flops < 50 * projections


@pytest.mark.parametrize("name", ["aft_full", "softmax"])
def test_only_quadratic_mixers_grow_with_sequence_length(name):
    mixer = build_mixer(name, DIM, HEADS, causal=True)
    assert mixer.flops_per_token(1024) > mixer.flops_per_token(32)
    for linear_time in ["linear", "cosine", "efficient", "inline", "aft_local", "aft_simple", "retnet", "mamba2"]:
        other = build_mixer(linear_time, DIM, HEADS, causal=True)
        assert other.flops_per_token(1024) == other.flops_per_token(32)


def test_aft_full_refuses_sequences_beyond_its_bias(make_mixer):
    mixer = make_mixer("aft_full", causal=True, max_seq_len=8)
    with pytest.raises(ValueError, match="T_max"):
        mixer(torch.randn(1, 9, DIM, dtype=torch.float64))


def test_elu_plus_one_keeps_its_output_alone_with_autograd_gradients():
    """``φ = elu + 1`` differentiates from its output: the gradient of autograd through ``F.elu``, at 0 and far out."""
    import torch.nn.functional as F

    from pretrain.attention.linear import elu_plus_one

    x = torch.tensor([-40.0, -3.0, -1e-12, 0.0, 1e-12, 0.5, 7.0], dtype=torch.float64, requires_grad=True)
    upstream = torch.linspace(-1, 2, x.numel(), dtype=torch.float64)
    held = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: held.append(t) or t, lambda t: t):
        phi = elu_plus_one(x)
    assert len(held) == 1 and held[0] is phi
    grad, = torch.autograd.grad(phi, x, upstream)
    reference_x = x.detach().requires_grad_()
    reference = F.elu(reference_x) + 1
    torch.testing.assert_close(phi, reference, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, torch.autograd.grad(reference, reference_x, upstream)[0], rtol=1e-10, atol=1e-10)
