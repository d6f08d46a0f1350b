"""``retnet`` and ``mamba2`` held to their papers' formulas, written here independently of the decayed op: RetNet's
parallel retention ``(Q Kᵀ ⊙ D) V`` with ``D_nm = γ^{n−m}``, and Mamba-2's SSD recurrence token by token with
``torch``'s own depthwise ``conv1d`` (fp64, 1e-10)."""
import importlib

import pytest
import torch
import torch.nn.functional as F

from pretrain.attention import build_mixer
from pretrain.attention.retnet import alibi_slopes, lightning_log_decay, retnet_log_decay
from pretrain.ops import apply_rope

DIM, HEADS, T = 16, 2, 21


def depthwise_causal_conv(x, weight, bias):
    """``x [B, T, C]`` through torch's grouped conv1d, left-padded: our ``weight[:, i]`` weighs ``x_{t−i}``."""
    size = weight.shape[1]
    out = F.conv1d(F.pad(x.transpose(1, 2), (size - 1, 0)), weight.flip(1)[:, None], bias, groups=x.shape[2])
    return F.silu(out.transpose(1, 2))


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight


def retention_reference(m, x):
    """Multi-scale retention, parallel form: per head ``(Q Kᵀ ⊙ D) V``, ``D_nm = γ_h^{n−m}`` for n ≥ m."""
    batch, length, _ = x.shape
    q, k, v = m.q_proj(x), m.k_proj(x), m.v_proj(x)
    if m.short_conv:  # one kernel per channel of each of q, k, v, no bias
        q, k, v = (depthwise_causal_conv(t, conv.weight, None) for t, conv in zip((q, k, v), m.convolutions()))
    q, k, v = (t.view(batch, length, HEADS, -1) for t in (q, k, v))
    k = k / k.shape[-1] ** 0.5
    positions = torch.arange(length).expand(batch, length)
    if m.rope:
        q, k = apply_rope(q, positions, m.rope_theta), apply_rope(k, positions, m.rope_theta)
    gamma = m.log_decay(torch.zeros((), dtype=torch.float64)).exp()
    distance = (torch.arange(length)[:, None] - torch.arange(length)[None]).double()
    decay = torch.where(distance >= 0, gamma[:, None, None] ** distance.clamp(min=0), 0.0)  # [H, n, m]
    o = torch.einsum("hnm,bnhd,bmhd,bmhe->bnhe", decay, q, k, v)
    o = rms_norm(o, m.group_norm.weight, m.group_norm.eps).flatten(2)
    return m.o_proj(F.silu(m.gate_proj(x)) * o)


def mamba2_reference(m, x):
    """Mamba-2's SSD layer token by token: ``h_t = exp(dt_t A) h_{t−1} + dt_t x_t B_tᵀ``, ``y_t = h_t C_t + D x_t``."""
    batch, length, _ = x.shape
    xbc = depthwise_causal_conv(torch.cat([m.v_proj(x), m.k_proj(x), m.q_proj(x)], -1), m.conv.weight, m.conv.bias)
    xs, B, C = xbc.split([m.inner, m.state_size, m.state_size], -1)
    xs = xs.view(batch, length, HEADS, -1)
    dt = F.softplus(m.dt_proj(x) + m.dt_bias)
    A = -m.A_log.exp()
    h = x.new_zeros(batch, HEADS, xs.shape[-1], m.state_size)
    ys = []
    for t in range(length):
        h = (dt[:, t] * A).exp()[..., None, None] * h + (dt[:, t, :, None] * xs[:, t])[..., None] * B[:, t, None, None]
        ys.append(torch.einsum("bhpn,bn->bhp", h, C[:, t]) + m.D[:, None] * xs[:, t])
    y = torch.stack(ys, 1).flatten(2) * F.silu(m.gate_proj(x))
    return m.o_proj(rms_norm(y, m.norm.weight, m.norm.eps))


@pytest.mark.parametrize("options", [{}, {"short_conv": 0}, {"rope": False, "decay": "lightning", "layer_index": 1,
                                                              "num_layers": 5}])
def test_retnet_is_parallel_retention(make_mixer, options):
    mixer = make_mixer("retnet", causal=True, chunk_size=8, **options)
    x = torch.randn(2, T, DIM, dtype=torch.float64)
    torch.testing.assert_close(mixer(x), retention_reference(mixer, x), rtol=1e-10, atol=1e-10)


def test_mamba2_is_the_ssd_recurrence(make_mixer):
    mixer = make_mixer("mamba2", causal=True, chunk_size=8, state_size=8)
    with torch.no_grad():
        mixer.A_log.copy_(torch.tensor([0.5, 2.5]))  # decays of very different depth
    x = torch.randn(2, T, DIM, dtype=torch.float64)
    torch.testing.assert_close(mixer(x), mamba2_reference(mixer, x), rtol=1e-10, atol=1e-10)


def test_decay_schedules():
    """RetNet's γ_h = 1 − 2^{−5−h}; Lightning's ALiBi slopes 2^{−8(h+1)/H}, weaker with depth; ALiBi's interleaving
    for a head count that is not a power of two."""
    torch.testing.assert_close(retnet_log_decay(3).exp(), torch.tensor([1 - 1 / 32, 1 - 1 / 64, 1 - 1 / 128],
                                                                       dtype=torch.float64), rtol=0, atol=1e-15)
    torch.testing.assert_close(alibi_slopes(4), torch.tensor([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8], dtype=torch.float64))
    torch.testing.assert_close(alibi_slopes(6), torch.cat([alibi_slopes(4), alibi_slopes(8)[[0, 2]]]))
    first, last = lightning_log_decay(4, 0, 8), lightning_log_decay(4, 7, 8)
    torch.testing.assert_close(first, -alibi_slopes(4) * (1 + 1e-5))
    assert torch.all(last > first) and torch.all(last < 0)


def test_the_gate_starts_where_its_options_say():
    """``gated_deltanet`` and ``mamba2`` share Mamba-2's init: dt log-uniform in [dt_min, dt_max] (through
    softplus's inverse), A uniform in a_init_range; the ungated ``deltanet`` refuses the gate's options by name."""
    for name in ("gated_deltanet", "mamba2"):
        mixer = build_mixer(name, DIM, HEADS, causal=True, options={"dt_min": 1e-4, "dt_max": 2e-4,
                                                                    "a_init_range": (2.0, 3.0)})
        dt, A = F.softplus(mixer.dt_bias.double()), mixer.A_log.double().exp()
        assert torch.all((dt > 1e-4 * (1 - 1e-5)) & (dt < 2e-4 * (1 + 1e-5))), (name, dt)
        assert torch.all((A >= 2 - 1e-6) & (A <= 3 + 1e-6)), (name, A)
        with pytest.raises(ValueError, match=f"{name}: need 0 < dt_min ≤ dt_max"):
            build_mixer(name, DIM, HEADS, causal=True, options={"dt_min": 0.1, "dt_max": 0.01})
    with pytest.raises(ValueError, match="deltanet: dt_max set the gate's decay, and this one has no gate"):
        build_mixer("deltanet", DIM, HEADS, causal=True, options={"dt_max": 0.01})


def test_the_lm_hands_each_layer_its_place():
    """Lightning's schedule needs the layer's depth: the LM passes ``layer_index`` and ``num_layers``."""
    from pretrain.config import load_config
    from pretrain.tasks import build_model

    cfg = load_config(None, ["data.tokenizer=none", "data.train_shards=none", "model.vocab_size=11", "model.dim=16",
                             "model.n_heads=2", "model.n_layers=3", "model.mixer=retnet",
                             "model.mixer_options.retnet.decay=lightning"])
    decays = [block.mixer.log_decay(torch.zeros((), dtype=torch.float64)) for block in build_model(cfg).layers]
    for index, decay in enumerate(decays):
        torch.testing.assert_close(decay, lightning_log_decay(2, index, 3))


@pytest.mark.parametrize("name, op, position", [("retnet", "retnet.decayed_linear_attention", 3),
                                                ("mamba2", "mamba2.decayed_linear_attention", 3),
                                                ("gated_deltanet", "deltanet.delta_rule", 4),
                                                ("deltanet", "deltanet.delta_rule", 4)])
def test_log_decay_is_the_decay_the_op_applies(make_mixer, monkeypatch, name, op, position):
    """``Mixer.log_decay`` (what ``tools/eval_recall.py`` reads of the trained gates) is the ``g`` the op is handed,
    in training's forward and in decoding's; None where the op gets none."""
    module_name, function = op.rsplit(".", 1)
    module = importlib.import_module(f"pretrain.attention.{module_name}")
    original, given = getattr(module, function), []

    def recording(*args, **kwargs):
        given.append(args[position])
        return original(*args, **kwargs)

    monkeypatch.setattr(module, function, recording)
    mixer = make_mixer(name, causal=True, chunk_size=8)
    x = torch.randn(2, T, DIM, dtype=torch.float64)
    mixer(x)
    mixer.prefill(x)
    expected = mixer.log_decay(x)
    assert len(given) == 2
    for g in given:
        if expected is None:
            assert g is None
        else:
            assert torch.equal(g, expected) and bool((g <= 0).all()), name


@pytest.mark.parametrize("name", ["linear", "softmax", "inline"])
def test_a_state_that_does_not_decay_has_no_log_decay(make_mixer, name):
    assert make_mixer(name, causal=True).log_decay(torch.randn(1, T, DIM, dtype=torch.float64)) is None
