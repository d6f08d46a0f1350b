"""The causal LM: shapes, causality, document boundaries, hybrids from the registry, init, FLOPs, learning."""
import math
from typing import ClassVar

import pytest
import torch
from torch import nn

from pretrain.attention import REGISTRY
from pretrain.attention.norm import RMSNorm, _RMSNormFunction
from pretrain.config import ModelConfig
from pretrain.models import build_lm


def model_cfg(**overrides) -> ModelConfig:
    return ModelConfig(**{"vocab_size": 50, "dim": 32, "n_layers": 2, "n_heads": 4, **overrides})


class TokenShift(nn.Module):
    """A stand-in for a later mixer: each token sees its predecessor in the same document (causal, no attention)."""

    supports_causal: ClassVar[bool] = True

    def __init__(self, dim, num_heads, *, causal=True, scale: float = 1.0):
        super().__init__()
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.scale = scale

    def forward(self, x, *, cu_seqlens=None, position_ids=None):
        shifted = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
        if position_ids is not None:
            shifted = shifted * (position_ids[..., None] > 0)
        return self.o_proj(self.scale * shifted)

    def flops_per_token(self, seq_len):
        return 2 * self.o_proj.in_features * self.o_proj.out_features


@pytest.fixture
def token_shift(monkeypatch):
    monkeypatch.setitem(REGISTRY, "token_shift", TokenShift)


def test_logits_shape_and_position_ids_default_to_one_document_per_row():
    torch.manual_seed(0)
    model = build_lm(model_cfg())
    ids = torch.randint(0, 50, (3, 11))
    logits = model(ids)
    assert logits.shape == (3, 11, 50)
    torch.testing.assert_close(model(ids, torch.arange(11).expand(3, 11)), logits)


def test_future_tokens_do_not_change_past_logits():
    torch.manual_seed(0)
    model = build_lm(model_cfg())
    ids = torch.randint(0, 50, (2, 12))
    changed = ids.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 50
    before, after = model(ids), model(changed)
    torch.testing.assert_close(before[:, :7], after[:, :7])
    assert not torch.allclose(before[:, 7:], after[:, 7:])


@pytest.mark.parametrize("pattern", [[], ["token_shift", "softmax"]])
def test_packed_documents_give_what_each_document_gives_alone(pattern, token_shift):
    torch.manual_seed(0)
    model = build_lm(model_cfg(layer_pattern=pattern)).double()
    ids = torch.randint(0, 50, (2, 9))
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 7, 0]])
    packed = model(ids, position_ids)
    for row, start, end in [(0, 0, 3), (0, 3, 9), (1, 0, 8), (1, 8, 9)]:
        torch.testing.assert_close(packed[row, start:end], model(ids[row:row + 1, start:end])[0])


def test_layer_pattern_repeats_to_n_layers_and_options_reach_the_mixer(token_shift):
    cfg = model_cfg(n_layers=4, layer_pattern=["token_shift", "softmax"],
                    mixer_options={"token_shift": {"scale": 0.5}, "softmax": {"qk_norm": True}}, rope_theta=123.0)
    model = build_lm(cfg)
    assert [type(block.mixer).__name__ for block in model.layers] == ["TokenShift", "SoftmaxAttention"] * 2
    assert model.layers[0].mixer.scale == 0.5
    softmax = model.layers[1].mixer
    assert softmax.rope_theta == 123.0 and isinstance(softmax.q_norm, RMSNorm)  # model.rope_theta is shared
    override = build_lm(model_cfg(mixer_options={"softmax": {"rope_theta": 7.0}}))
    assert override.layers[0].mixer.rope_theta == 7.0  # the mixer's own option wins


def test_tied_and_untied_embeddings():
    tied, untied = build_lm(model_cfg()), build_lm(model_cfg(tie_embeddings=False))
    assert tied.lm_head.weight is tied.embed.weight
    assert untied.lm_head.weight is not untied.embed.weight
    count = lambda m: sum(p.numel() for p in m.parameters())
    assert count(untied) - count(tied) == 50 * 32


def test_ffn_width_defaults_to_eight_thirds_rounded_up():
    assert build_lm(model_cfg(dim=96, multiple_of=64)).layers[0].ffn.up_proj.out_features == 256  # 8/3·96 = 256
    assert build_lm(model_cfg(dim=100, n_heads=2, multiple_of=64)).layers[0].ffn.up_proj.out_features == 320
    assert build_lm(model_cfg(ffn_hidden=72)).layers[0].ffn.up_proj.out_features == 72


def test_init_scales_residual_output_projections_by_depth():
    torch.manual_seed(0)
    n_layers, std = 8, 0.05
    model = build_lm(model_cfg(dim=256, n_heads=4, n_layers=n_layers, init_std=std, vocab_size=300))
    residual_std = std / math.sqrt(2 * n_layers)
    for block in model.layers:
        for weight, expected in [(block.mixer.q_proj.weight, std), (block.ffn.gate_proj.weight, std),
                                 (block.mixer.o_proj.weight, residual_std), (block.ffn.down_proj.weight, residual_std)]:
            assert weight.std().item() == pytest.approx(expected, rel=0.03)
            assert weight.mean().abs().item() < 0.05 * expected
    assert model.embed.weight.std().item() == pytest.approx(std, rel=0.03)
    assert torch.all(block.mixer_norm.weight == 1)


def test_init_keeps_what_a_mixer_started_on_purpose():
    """RWKV-7's decay starts from a ramp of base values across each head (slow to fast) in its low-rank
    projection's bias, the projection itself at zero: the model's init drew the one and zeroed the other, which
    started every channel at a memory of about three tokens."""
    mixer = build_lm(model_cfg(mixer="rwkv7", dim=64, n_heads=2)).layers[0].mixer
    up = mixer.decay_lora[-1]
    torch.testing.assert_close(up.bias.detach(), torch.linspace(-6.0, -1.0, 32).repeat(2))
    assert torch.all(up.weight == 0) and torch.all(mixer.rate_lora[-1].weight == 0)
    assert mixer.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.1)  # the receptance: drawn as any layer


def test_flops_per_token_is_mixers_plus_ffn_plus_head_by_part(token_shift):
    dim, vocab, seq_len, hidden = 64, 100, 40, 192
    model = build_lm(model_cfg(dim=dim, vocab_size=vocab, n_layers=4, layer_pattern=["softmax", "token_shift"]))
    softmax = 4 * 2 * dim * dim + 2 * 2 * (seq_len / 2) * dim
    token_shift_flops = 2 * dim * dim
    ffn = 3 * 2 * dim * hidden
    assert model.flops_per_token(seq_len) == 2 * softmax + 2 * token_shift_flops + 4 * ffn + 2 * dim * vocab
    assert model.flops_by_part(seq_len) == {"SoftmaxAttention": 2 * softmax, "TokenShift": 2 * token_shift_flops,
                                            "SwiGLU": 4 * ffn, "LMHead": 2 * dim * vocab}


def test_unresolved_vocab_size_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="model.vocab_size"):
        build_lm(model_cfg(vocab_size=0))


def test_builds_on_the_meta_device_without_memory():
    with torch.device("meta"):
        model = build_lm(model_cfg(dim=2048, n_layers=24, n_heads=16, vocab_size=32000))
    assert next(model.parameters()).is_meta
    assert 1.2e9 < sum(p.numel() for p in model.parameters()) < 1.3e9


def test_learns_to_continue_a_repeated_sequence():
    """A few AdamW steps on one periodic batch drive the loss well below chance: gradients reach every part."""
    torch.manual_seed(0)
    model = build_lm(model_cfg(n_layers=2))
    ids = torch.arange(40).remainder(7).expand(4, 40) + 3
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 0.8 * math.log(50) and losses[-1] < 0.5
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def rms_norm_formula(x, weight, eps):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("shape", [(1, 1, 8), (2, 3, 5, 24), (7, 64)])
def test_rms_norm_matches_its_formula_forward_and_gradients(shape):
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(shape, generator=gen, dtype=torch.float64)).requires_grad_()
    norm = RMSNorm(shape[-1], eps=1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=gen))
    out, ref = norm(x), rms_norm_formula(x, norm.weight, 1e-5)
    torch.testing.assert_close(out, ref)
    upstream = torch.randn(shape, generator=gen, dtype=torch.float64)
    for got, expected in zip(torch.autograd.grad(out, (x, norm.weight), upstream),
                             torch.autograd.grad(ref, (x, norm.weight), upstream)):
        torch.testing.assert_close(got, expected)
    torch.testing.assert_close(out, nn.functional.rms_norm(x, (shape[-1],), norm.weight, 1e-5))


def test_rms_norm_keeps_bf16_and_saves_only_input_and_inverse_rms():
    x = torch.randn(4, 6, 32, dtype=torch.bfloat16, requires_grad=True)
    norm = RMSNorm(32).to(torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = norm(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), rms_norm_formula(x.double(), 1.0, 1e-5), atol=1e-2, rtol=1e-2)
    assert [t.shape for t in saved] == [x.shape, norm.weight.shape, (4, 6, 1)]
    assert saved[0] is x and saved[1] is norm.weight


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch's fused RMSNorm kernels)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_on_cuda_runs_torchs_fused_kernels_and_agrees_with_ours(dtype):
    """On CUDA the norm is ``F.rms_norm`` (torch's fused kernels): the output and both gradients as our autograd
    function gives them (fp32 inside either way), in a third of the kernels or fewer."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (3 * torch.randn(4, 50, 96, device="cuda", generator=gen)).to(dtype)
    upstream = torch.randn(x.shape, device="cuda", generator=gen).to(dtype)
    norm = RMSNorm(96).to("cuda", dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, device="cuda", generator=gen))
    forms = {"fused": norm, "ours": lambda a: _RMSNormFunction.apply(a, norm.weight, norm.eps)}
    results, kernels = {}, {}
    for name, form in forms.items():
        leaf = x.clone().requires_grad_()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = form(leaf)
            results[name] = (out, *torch.autograd.grad(out, (leaf, norm.weight), upstream))
            torch.cuda.synchronize()
        kernels[name] = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for got, want in zip(results["fused"], results["ours"]):
        assert got.dtype == want.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), **tolerance)
    assert 0 < 3 * kernels["fused"] <= kernels["ours"], kernels


CAUSAL_MIXERS = sorted(name for name, cls in REGISTRY.items() if cls.supports_causal)


@pytest.mark.parametrize("mixer", CAUSAL_MIXERS)
def test_every_registered_causal_mixer_plugs_in(mixer):
    """Each causal mixer in the registry builds into the LM unchanged, stays causal and keeps documents apart."""
    torch.manual_seed(0)
    model = build_lm(model_cfg(mixer=mixer)).double()
    ids = torch.randint(0, 50, (2, 12))
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]])
    packed = model(ids, position_ids)
    torch.testing.assert_close(packed[0, 5:], model(ids[:1, 5:])[0])
    torch.testing.assert_close(packed[0, :5], model(ids[:1, :5])[0])
    changed = ids.clone()
    changed[1, 8:] = (changed[1, 8:] + 1) % 50
    torch.testing.assert_close(model(changed)[1, :8], model(ids)[1, :8])
    assert model.flops_per_token(12) > 0


def test_an_omegaconf_node_is_refused_with_the_conversion_to_use():
    from omegaconf import OmegaConf

    with pytest.raises(TypeError, match=r"OmegaConf.to_object\(cfg.model\)"):
        build_lm(OmegaConf.structured(model_cfg()))


def test_the_mixers_per_head_norm_equals_torchs_rmsnorm_it_replaced():
    """The q/k and output norms moved from nn.RMSNorm to ours with nn.RMSNorm's fp32 eps: same values and gradients."""
    torch.manual_seed(0)
    x = torch.randn(2, 7, 3, 16, requires_grad=True)
    ours, torchs = RMSNorm(16, eps=torch.finfo(torch.float32).eps), nn.RMSNorm(16)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        torchs.weight.copy_(ours.weight)
    grad = torch.randn(2, 7, 3, 16)
    out, ref = ours(x), torchs(x)
    torch.testing.assert_close(out, ref)
    dx, dw = torch.autograd.grad(out, (x, ours.weight), grad)
    dx_ref, dw_ref = torch.autograd.grad(ref, (x, torchs.weight), grad)
    torch.testing.assert_close(dx, dx_ref)
    torch.testing.assert_close(dw, dw_ref)
