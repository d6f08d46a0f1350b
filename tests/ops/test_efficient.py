"""Efficient attention: the chunked/published forms against the O(T²) definition, forward and backward."""
import pytest
import torch

from pretrain.ops import efficient_attention, efficient_attention_naive


def random_qkv(batch, length, heads, dk, dv, *, key_scale=1.0, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, heads, dk, generator=gen, dtype=dtype)
    k = torch.randn(batch, length, heads, dk, generator=gen, dtype=dtype) * key_scale
    v = torch.randn(batch, length, heads, dv, generator=gen, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def outputs_and_grads(fn, inputs, seed=1):
    out = fn(*inputs)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return [out, *torch.autograd.grad((out * probe).sum(), inputs)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape,chunk", [((2, 37, 3, 5, 4), 8), ((1, 1, 1, 1, 1), 64), ((1, 64, 2, 16, 7), 64),
                                         ((3, 19, 1, 6, 6), 1), ((1, 50, 2, 3, 5), 13)])
def test_fast_equals_naive(causal, shape, chunk):
    inputs = random_qkv(*shape, key_scale=3.0)
    fast = outputs_and_grads(lambda q, k, v: efficient_attention(q, k, v, causal=causal, chunk_size=chunk), inputs)
    naive = outputs_and_grads(lambda q, k, v: efficient_attention_naive(q, k, v, causal=causal), inputs)
    for a, b in zip(fast, naive):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
def test_packed_documents_equal_separate_sequences(causal):
    q, k, v = random_qkv(1, 30, 2, 4, 3)
    cu_seqlens = torch.tensor([0, 7, 8, 8, 30], dtype=torch.int32)
    packed = efficient_attention(q, k, v, causal=causal, cu_seqlens=cu_seqlens, chunk_size=4)
    alone = [efficient_attention(q[:, s:e], k[:, s:e], v[:, s:e], causal=causal) for s, e in [(0, 7), (7, 8), (8, 30)]]
    torch.testing.assert_close(packed, torch.cat(alone, dim=1))
    naive = efficient_attention_naive(q, k, v, causal=causal, cu_seqlens=cu_seqlens)
    torch.testing.assert_close(packed, naive)


def test_state_carries_across_calls():
    q, k, v = random_qkv(2, 23, 2, 4, 5, key_scale=2.0)
    whole = efficient_attention(q, k, v)
    first, state = efficient_attention(q[:, :9], k[:, :9], v[:, :9], output_final_state=True, chunk_size=4)
    tokens = [first]
    for t in range(9, 23):
        o, state = efficient_attention(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], initial_state=state,
                                       output_final_state=True)
        tokens.append(o)
    torch.testing.assert_close(torch.cat(tokens, dim=1), whole)


def test_fp32_stays_finite_when_one_key_dwarfs_the_prefix():
    """A single global max would underflow every earlier prefix to 0/0; the running log-normaliser does not."""
    q, k, v = (t.detach() for t in random_qkv(1, 40, 2, 4, 3))
    k[:, 30] += 300.0
    k[:, 3] -= 300.0
    fast = efficient_attention(q.float(), k.float(), v.float(), chunk_size=16)
    assert torch.isfinite(fast).all()
    torch.testing.assert_close(fast, efficient_attention_naive(q, k, v).float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["wide_chunk", "history_dominates", "ordinary"])
def test_extreme_keys_equal_the_definition_with_gradients(monkeypatch, case):
    """Inside a chunk the weights are factored into two exponentials; one channel of one head whose keys spread
    ~100 within a chunk would overflow them, so that (batch, chunk, head) alone takes exact per-channel weights.
    Keys far below an earlier chunk's make the factored in-chunk weights underflow, as the true ones do."""
    from pretrain.ops.efficient import chunk as efficient

    exact_slices = []
    exact = efficient._exact_within_chunk
    monkeypatch.setattr(efficient, "_exact_within_chunk", lambda p, *rest: exact_slices.append(p.shape[0]) or
                        exact(p, *rest))
    q, k, v = random_qkv(2, 45, 2, 4, 3, key_scale=2.0)
    with torch.no_grad():
        if case == "wide_chunk":
            k[1, 20, 1, 2] += 100.0  # batch 1, chunk 1 (tokens 16-31), head 1, channel 2
        elif case == "history_dominates":
            k[:, :10] += 60.0
    fast = outputs_and_grads(lambda q, k, v: efficient_attention(q, k, v, chunk_size=16), (q, k, v))
    naive = outputs_and_grads(lambda q, k, v: efficient_attention_naive(q, k, v), (q, k, v))
    for a, b in zip(fast, naive):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert exact_slices == ([1] if case == "wide_chunk" else [])


def test_bf16_inputs_accumulate_in_fp32():
    q, k, v = (t.detach() for t in random_qkv(2, 33, 2, 8, 8))
    out = efficient_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), chunk_size=16)
    assert out.dtype == torch.bfloat16
    rounded = [t.bfloat16().double() for t in (q, k, v)]
    torch.testing.assert_close(out.double(), efficient_attention_naive(*rounded), rtol=1e-2, atol=1e-2)


def test_bad_input_names_the_shapes():
    q, k, v = random_qkv(1, 5, 2, 4, 3)
    with pytest.raises(ValueError, match=r"q \(1, 5, 2, 4\), k \(1, 4, 2, 4\)"):
        efficient_attention(q, k[:, :4], v)
    with pytest.raises(ValueError, match="unknown impl"):
        efficient_attention(q, k, v, impl="triton")
