"""Softmax attention: the fast form (SDPA / flash-attn) against the definition, RoPE, and the `softmax` mixer."""
import pytest
import torch

from pretrain.attention import REGISTRY, build_mixer
from pretrain.attention.norm import RMSNorm
from pretrain.ops import apply_rope, cu_seqlens_from_position_ids, softmax_attention, softmax_attention_naive

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
def test_mixer_keeps_packed_documents_apart(qk_norm):
    """Two rows of packed documents give, token for token, what each document gives alone."""
    torch.manual_seed(0)
    mixer = build_mixer("softmax", 32, 4, causal=True, options={"qk_norm": qk_norm}).double()
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
