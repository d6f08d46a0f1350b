"""Softmax attention: the fast forms (SDPA, one masked call, varlen_attn, flash-attn) against the definition and SDPA
per document, RoPE, and the `softmax` mixer."""
import subprocess
import sys

import pytest
import torch

from pretrain.attention import REGISTRY, build_mixer
from pretrain.attention.norm import RMSNorm
from pretrain.ops import apply_rope, cu_seqlens_from_position_ids, softmax_attention, softmax_attention_naive
from pretrain.ops.softmax import INSTALLED

SHAPES = [(1, 1, 1, 8), (2, 7, 3, 24), (3, 33, 2, 16), (1, 64, 4, 32)]  # B, T, H, D: awkward and ordinary


def random_qkv(shape, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=dtype).requires_grad_() for _ in range(3)]


def grads(out, inputs, seed=1):
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, inputs, upstream)


def definition(q, k, v, causal):
    """softmax(q·k/√d) v written with loops over one head at a time: docs/MIXERS.md#softmax literally."""
    B, T, H, D = q.shape
    out = torch.zeros_like(v)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                keys = range(t + 1) if causal else range(T)
                scores = torch.stack([q[b, t, h] @ k[b, j, h] / D**0.5 for j in keys])
                weights = scores.softmax(0)
                out[b, t, h] = sum(w * v[b, j, h] for w, j in zip(weights, keys))
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_naive_is_the_definition(causal):
    q, k, v = (t.detach() for t in random_qkv((2, 5, 2, 4)))
    torch.testing.assert_close(softmax_attention_naive(q, k, v, causal=causal), definition(q, k, v, causal))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_fast_matches_naive_forward_and_gradients(shape, causal):
    q, k, v = random_qkv(shape)
    fast, ref = softmax_attention(q, k, v, causal=causal), softmax_attention_naive(q, k, v, causal=causal)
    torch.testing.assert_close(fast, ref)
    for g_fast, g_ref in zip(grads(fast, (q, k, v)), grads(ref, (q, k, v))):
        torch.testing.assert_close(g_fast, g_ref)


@pytest.mark.parametrize("causal", [True, False])
def test_packed_documents_equal_documents_alone(causal):
    lengths = [5, 1, 12, 3]  # a one-token document included
    q, k, v = random_qkv((1, sum(lengths), 3, 8))
    cu_seqlens = torch.tensor([0, 5, 6, 18, 21], dtype=torch.int32)
    packed = softmax_attention(q, k, v, causal=causal, cu_seqlens=cu_seqlens)
    alone = torch.cat([softmax_attention_naive(q[:, a:b], k[:, a:b], v[:, a:b], causal=causal)
                       for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])], dim=1)
    torch.testing.assert_close(packed, alone)
    torch.testing.assert_close(softmax_attention_naive(q, k, v, causal=causal, cu_seqlens=cu_seqlens), alone)
    for g_packed, g_alone in zip(grads(packed, (q, k, v)), grads(alone, (q, k, v))):
        torch.testing.assert_close(g_packed, g_alone)


# Packed rows of awkward layouts (document lengths): one-token documents, one document the whole row, many short
# documents; totals not powers of two.
LAYOUTS = {"one_token_docs": [1, 5, 1, 1, 13, 1], "whole_row": [37], "many": [3, 1, 7, 2, 9, 4, 1, 6, 5, 8, 2, 3] * 3}


def offsets(lengths, device="cpu"):
    return torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
def test_one_call_over_packed_documents_equals_sdpa_per_document(layout, causal):
    """impl="masked" (one SDPA call, a block-diagonal mask) against SDPA once per document: fp32, output and
    gradients, with max_seqlen a loose bound (the row) as the mixer passes it."""
    lengths = LAYOUTS[layout]
    q, k, v = random_qkv((1, sum(lengths), 3, 8), dtype=torch.float32)
    cu = offsets(lengths)
    one_call = softmax_attention(q, k, v, causal=causal, cu_seqlens=cu, max_seqlen=sum(lengths), impl="masked")
    per_document = softmax_attention(q, k, v, causal=causal, cu_seqlens=cu, impl="sdpa")
    torch.testing.assert_close(one_call, per_document)
    for g_one, g_each in zip(grads(one_call, (q, k, v)), grads(per_document, (q, k, v))):
        torch.testing.assert_close(g_one, g_each)


def test_one_call_means_one_kernel_call_whatever_the_document_count(monkeypatch):
    """The per-document loop is gone from impl="masked": SDPA runs once for 1 document and for 36 (and the
    per-document form, for contrast, once per document)."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *args, **kwargs: calls.append(1) or sdpa(*args, **kwargs))
    for layout in ("whole_row", "many"):
        calls.clear()
        q, k, v = (t.detach() for t in random_qkv((1, sum(LAYOUTS[layout]), 2, 8), dtype=torch.float32))
        softmax_attention(q, k, v, cu_seqlens=offsets(LAYOUTS[layout]), impl="masked")
        assert len(calls) == 1
    calls.clear()
    softmax_attention(q, k, v, cu_seqlens=offsets(LAYOUTS["many"]), impl="sdpa")
    assert len(calls) == len(LAYOUTS["many"])


@pytest.mark.parametrize("impl", ["masked", "varlen"])
def test_one_call_forms_read_nothing_from_the_device(impl):
    """Forward and backward of the one-call forms run on the meta device, where reading a value (``.item()``,
    ``.tolist()``, a data-dependent shape: a host sync on a GPU) raises; varlen_attn runs there by its fake
    kernel, so its plumbing (flattening, offsets, the causal flag, max_seqlen) is exercised here too. SDPA per
    document reads the offsets, and fails here."""
    q, k, v = (torch.randn(1, 50, 2, 8, device="meta", requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 20, 21, 50], device="meta")
    out = softmax_attention(q, k, v, cu_seqlens=cu, max_seqlen=50, impl=impl)
    assert out.shape == (1, 50, 2, 8) and out.device.type == "meta"
    assert all(g.shape == q.shape for g in torch.autograd.grad(out.sum(), (q, k, v)))
    with pytest.raises(RuntimeError, match="meta"):
        softmax_attention(q, k, v, cu_seqlens=cu, impl="sdpa")


@pytest.mark.parametrize("impl", ["masked", "varlen"])
def test_mixer_forward_and_backward_read_nothing_from_the_device(impl):
    """The softmax mixer over packed rows passes the row length as max_seqlen, so no layer reads the offsets."""
    mixer = build_mixer("softmax", 32, 4, causal=True, options={"impl": impl, "qk_norm": True}).to("meta")
    x = torch.randn(2, 10, 32, device="meta", requires_grad=True)
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2]])
    cu = cu_seqlens_from_position_ids(position_ids).to("meta")
    out = mixer(x, cu_seqlens=cu, position_ids=position_ids.to("meta"))
    torch.autograd.grad(out.sum(), [x, *mixer.parameters()])


def test_impl_names_are_checked():
    q, k, v = (t.detach() for t in random_qkv((1, 6, 1, 8), dtype=torch.float32))
    with pytest.raises(ValueError, match="impl must be one of"):
        softmax_attention(q, k, v, impl="flex")
    with pytest.raises(ValueError, match="impl must be one of"):
        build_mixer("softmax", 32, 4, causal=True, options={"impl": "flash_attn"})
    with pytest.raises(ValueError, match="max_seqlen"):
        softmax_attention(q, k, v, cu_seqlens=offsets([6]), max_seqlen=0)
    with pytest.raises(ValueError, match="impl='varlen'.*CPU"):
        softmax_attention(q, k, v, cu_seqlens=offsets([2, 4]), impl="varlen")


@pytest.mark.parametrize("impl", ["naive", "sdpa", "masked"])
def test_every_cpu_form_matches_naive_on_rows(impl):
    q, k, v = random_qkv((2, 7, 3, 24))
    torch.testing.assert_close(softmax_attention(q, k, v, impl=impl), softmax_attention_naive(q, k, v))


def test_bf16_inputs_keep_their_dtype_and_stay_close():
    q, k, v = (t.detach().to(torch.bfloat16) for t in random_qkv((2, 40, 2, 16)))
    out = softmax_attention(q, k, v)
    assert out.dtype == torch.bfloat16
    reference = softmax_attention_naive(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), reference, atol=2e-2, rtol=2e-2)


def test_packed_documents_need_batch_one():
    q, k, v = random_qkv((2, 4, 1, 8))
    with pytest.raises(ValueError, match="batch size 1"):
        softmax_attention(q, k, v, cu_seqlens=torch.tensor([0, 4, 8], dtype=torch.int32))


def test_rope_is_a_rotation_by_position_in_the_complex_plane():
    x = torch.randn(2, 6, 3, 8, dtype=torch.float64)
    pos = torch.randint(0, 1000, (2, 6))
    theta = 500.0
    freqs = theta ** -(torch.arange(4, dtype=torch.float64) * 2 / 8)
    rotation = torch.polar(torch.ones((), dtype=torch.float64), pos[..., None, None] * freqs)
    as_complex = torch.complex(x[..., :4], x[..., 4:]) * rotation
    expected = torch.cat([as_complex.real, as_complex.imag], dim=-1)
    torch.testing.assert_close(apply_rope(x, pos, theta), expected)


def test_rope_scores_depend_only_on_relative_position():
    q, k = torch.randn(2, 1, 1, 1, 16, dtype=torch.float64).unbind(0)
    def score(p, s):
        return (apply_rope(q, torch.tensor([[p]]), 10000.0) * apply_rope(k, torch.tensor([[s]]), 10000.0)).sum()
    torch.testing.assert_close(score(3, 1), score(103, 101))
    assert not torch.allclose(score(3, 1), score(3, 2))


def test_mixer_is_registered_causal_with_its_options():
    assert REGISTRY["softmax"].supports_causal
    mixer = build_mixer("softmax", 32, 4, causal=True, options={"rope_theta": 500.0, "qk_norm": True})
    assert mixer.rope_theta == 500.0 and isinstance(mixer.q_norm, RMSNorm)
    with pytest.raises(ValueError, match="even head dimension"):
        build_mixer("softmax", 12, 4, causal=True)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("impl", ["auto", "masked"])
def test_mixer_keeps_packed_documents_apart(qk_norm, impl):
    """Two rows of packed documents give, token for token, what each document gives alone."""
    torch.manual_seed(0)
    mixer = build_mixer("softmax", 32, 4, causal=True, options={"qk_norm": qk_norm, "impl": impl}).double()
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2]])
    packed = mixer(x, cu_seqlens=cu_seqlens_from_position_ids(position_ids), position_ids=position_ids)
    for row, (start, end) in [(0, (0, 4)), (0, (4, 10)), (1, (0, 7)), (1, (7, 10))]:
        alone = mixer(x[row:row + 1, start:end])  # no position_ids: positions 0.. of the document
        torch.testing.assert_close(packed[row:row + 1, start:end], alone)


def test_mixer_flops_count_projections_and_half_the_causal_scores():
    dim, seq_len = 64, 100
    causal = build_mixer("softmax", dim, 4, causal=True)
    full = build_mixer("softmax", dim, 4, causal=False)
    projections = 4 * 2 * dim * dim
    assert full.flops_per_token(seq_len) == projections + 2 * 2 * seq_len * dim
    assert causal.flops_per_token(seq_len) == projections + 2 * 2 * (seq_len / 2) * dim


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("packed", [False, True])
def test_cuda_bf16_matches_naive(packed):
    q, k, v = (t.detach().to("cuda", torch.bfloat16).requires_grad_() for t in random_qkv((1, 300, 4, 64)))
    cu_seqlens = torch.tensor([0, 17, 200, 300], dtype=torch.int32, device="cuda") if packed else None
    fast = softmax_attention(q, k, v, cu_seqlens=cu_seqlens)
    ref = softmax_attention_naive(q.float(), k.float(), v.float(), cu_seqlens=cu_seqlens)
    torch.testing.assert_close(fast.float(), ref, atol=2e-2, rtol=2e-2)
    upstream = torch.randn_like(ref)
    for g_fast, g_ref in zip(torch.autograd.grad(fast.float(), (q, k, v), upstream),
                             torch.autograd.grad(ref, (q, k, v), upstream)):
        torch.testing.assert_close(g_fast.float(), g_ref.float(), atol=5e-2, rtol=5e-2)


def cuda_kernel_or_skip(impl):
    """Skip where the library kernel ``impl`` (for ``auto``: any of them) does not import."""
    if not (any(INSTALLED.values()) if impl == "auto" else INSTALLED.get(impl, True)):
        pytest.skip(f"impl={impl!r} has no library kernel installed here")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", ["varlen", "flash", "masked"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_packed_forms_match_sdpa_per_document_in_bf16(impl, layout, causal):
    """Each one-call form against SDPA once per document, both in bf16 on the GPU: output and gradients, heads of
    64 and 128, max_seqlen the row (a loose bound, as the mixer passes it)."""
    cuda_kernel_or_skip(impl)
    lengths = LAYOUTS[layout] * 8  # a few hundred tokens
    for head_dim in (64, 128):
        q, k, v = (t.detach().to("cuda", torch.bfloat16).requires_grad_()
                   for t in random_qkv((1, sum(lengths), 4, head_dim), dtype=torch.float32))
        cu = offsets(lengths, "cuda")
        one_call = softmax_attention(q, k, v, causal=causal, cu_seqlens=cu, max_seqlen=sum(lengths), impl=impl)
        per_document = softmax_attention(q, k, v, causal=causal, cu_seqlens=cu, impl="sdpa")
        torch.testing.assert_close(one_call.float(), per_document.float(), atol=2e-2, rtol=2e-2)
        upstream = torch.randn_like(one_call)
        for g_one, g_each in zip(torch.autograd.grad(one_call, (q, k, v), upstream),
                                 torch.autograd.grad(per_document, (q, k, v), upstream)):
            torch.testing.assert_close(g_one.float(), g_each.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", ["auto", "varlen"])
def test_cuda_packed_mixer_step_never_syncs(impl):
    """A packed softmax mixer's forward and backward in bf16 under ``set_sync_debug_mode("error")``: no host sync
    in any layer (``auto`` after its first-use check, which reads values once per process, has run)."""
    cuda_kernel_or_skip(impl)
    mixer = build_mixer("softmax", 256, 4, causal=True, options={"impl": impl}).to("cuda", torch.bfloat16)
    position_ids = torch.cat([torch.arange(n) for n in [700, 1, 300, 23]] * 2).view(2, 1024).cuda()
    cu = cu_seqlens_from_position_ids(position_ids)
    x = torch.randn(2, 1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mixer(x, cu_seqlens=cu, position_ids=position_ids).sum().backward()  # auto's first-use check, allocations
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = mixer(x, cu_seqlens=cu, position_ids=position_ids)
        out.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_packed_benchmark_reports_every_impl_beside_sdpa_per_document(load_tool, capsys):
    load_tool("bench_softmax_packed").main(["--batch", "2", "--seq-len", "48", "--min-doc", "1", "--max-doc", "20",
                                            "--head-dim", "8", "--impls", "sdpa,masked,naive", "--repeats", "1"])
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row[1].strip() for row in rows[1:]] == ["sdpa", "masked", "naive"]
    assert all(float(row[3]) < 1e-5 for row in rows[1:])  # each form's output matches SDPA per document


@pytest.mark.dist
def test_a_model_imports_and_runs_without_loading_torchs_compiler():
    """varlen_attn is imported at its first call: importing it loads TorchDynamo and sympy, about a second at the
    start of every tool (eval, export, generate) that never calls it."""
    code = ("import sys, torch; from pretrain.config import ModelConfig; from pretrain.models.lm import build_lm; "
            "lm = build_lm(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, mixer='softmax')); "
            "lm(torch.randint(0, 64, (1, 16))).sum().backward(); "
            "print(*(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == []
