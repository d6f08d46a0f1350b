"""AFT ops: every fast form against ``aft_full_naive`` (the definition), forward and backward, in float64."""
import pytest
import torch

from pretrain.ops import (
    aft_conv2d,
    aft_conv2d_naive,
    aft_full,
    aft_full_naive,
    aft_local,
    aft_local_naive,
    aft_simple,
    aft_simple_naive,
)


def randn(*shape, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).requires_grad_()


def qkv(batch, length, channels, *, key_scale=2.0):
    return randn(batch, length, channels, seed=1), randn(batch, length, channels, scale=key_scale, seed=2), \
        randn(batch, length, channels, seed=3)


def assert_same_function(fast, naive, inputs):
    """Equal outputs and equal gradients for every input (a random probe on the output)."""
    results = []
    for fn in (fast, naive):
        out = fn(*inputs)
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
        results.append([out, *torch.autograd.grad((out * probe).sum(), inputs)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("batch,length,channels,chunk", [(2, 29, 6, 8), (1, 1, 3, 64), (3, 16, 1, 16), (1, 35, 2, 1)])
def test_aft_full(causal, batch, length, channels, chunk):
    w = randn(40, 40, scale=2.0, seed=4)  # T_max = 40 > T: the top-left block is used
    assert_same_function(lambda q, k, v, w: aft_full(q, k, v, w, causal=causal, chunk_size=chunk),
                         lambda q, k, v, w: aft_full_naive(q, k, v, w, causal=causal),
                         [*qkv(batch, length, channels), w])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length,window,chunk", [(29, 3, 5), (29, 7, 5), (33, 1, 8), (40, 8, 8), (5, 9, 4)])
def test_aft_local(causal, length, window, chunk):
    w_rel = randn(window if causal else 2 * window - 1, scale=2.0, seed=5)
    assert_same_function(lambda q, k, v, w: aft_local(q, k, v, w, window=window, causal=causal, chunk_size=chunk),
                         lambda q, k, v, w: aft_local_naive(q, k, v, w, window=window, causal=causal),
                         [*qkv(2, length, 4), w_rel])


def test_aft_local_is_not_masked_outside_the_window():
    """Outside the window the bias is 0, not −∞: a distant token still moves the output."""
    q, k, v = (t.detach() for t in qkv(1, 20, 2))
    w_rel = torch.zeros(3, dtype=torch.float64)
    changed = v.clone()
    changed[:, 0] += 10.0
    far = slice(10, 20)
    moved = aft_local(q, k, v, w_rel, window=3) - aft_local(q, k, changed, w_rel, window=3)
    assert moved[:, far].abs().min() > 0


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length,chunk", [(29, 4), (1, 64), (64, 64)])
def test_aft_simple(causal, length, chunk):
    assert_same_function(lambda q, k, v: aft_simple(q, k, v, causal=causal, chunk_size=chunk),
                         lambda q, k, v: aft_simple_naive(q, k, v, causal=causal), list(qkv(2, length, 5)))


@pytest.mark.parametrize("hw,heads,size", [((4, 5), 2, 3), ((3, 3), 1, 5), ((1, 7), 4, 3)])
def test_aft_conv2d(hw, heads, size):
    w = randn(heads, size, size, seed=6)
    assert_same_function(lambda q, k, v, w: aft_conv2d(q, k, v, w, hw=hw, heads=heads),
                         lambda q, k, v, w: aft_conv2d_naive(q, k, v, w, hw=hw, heads=heads),
                         [*qkv(2, hw[0] * hw[1], 8), w])


def test_packed_documents():
    q, k, v = qkv(1, 30, 3)
    cu_seqlens = torch.tensor([0, 11, 12, 30], dtype=torch.int32)
    w, w_rel = randn(20, 20, seed=7), randn(4, seed=8)
    cases = [(aft_full, aft_full_naive, dict(w=w)), (aft_local, aft_local_naive, dict(w_rel=w_rel, window=4)),
             (aft_simple, aft_simple_naive, {})]
    for fast, naive, extra in cases:
        assert_same_function(lambda q, k, v: fast(q, k, v, cu_seqlens=cu_seqlens, **extra),  # noqa: B023 (run now)
                             lambda q, k, v: naive(q, k, v, cu_seqlens=cu_seqlens, **extra),  # noqa: B023
                             [q, k, v])


def random_documents(total, longest, seed):
    """``cu_seqlens`` cutting ``total`` tokens into documents of 1…``longest`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    cuts = [0]
    while cuts[-1] < total:
        cuts.append(min(total, cuts[-1] + int(torch.randint(1, longest + 1, (1,), generator=gen))))
    return torch.tensor(cuts, dtype=torch.int32)


@pytest.mark.parametrize("window,chunk", [(None, 4), (None, 8), (3, 4), (4, 4), (6, 4), (1, 8)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_causal_many_documents(window, chunk, seed):
    """Documents of 1…3 chunks, one-token ones, some starting on a chunk boundary, all in one packed row."""
    length = 61
    cu_seqlens = random_documents(length, 3 * chunk, seed)
    if seed == 0:  # documents that begin exactly where a chunk does, and one that fills a whole chunk
        cu_seqlens = torch.tensor([0, chunk, 2 * chunk, 2 * chunk + 1, 4 * chunk, length], dtype=torch.int32)
    inputs = list(qkv(1, length, 3))
    if window is None:
        fast = lambda q, k, v: aft_simple(q, k, v, cu_seqlens=cu_seqlens, chunk_size=chunk)
        naive = lambda q, k, v: aft_simple_naive(q, k, v, cu_seqlens=cu_seqlens)
    else:
        inputs.append(randn(window, scale=2.0, seed=seed + 10))
        fast = lambda q, k, v, w: aft_local(q, k, v, w, window=window, cu_seqlens=cu_seqlens, chunk_size=chunk)
        naive = lambda q, k, v, w: aft_local_naive(q, k, v, w, window=window, cu_seqlens=cu_seqlens)
    assert_same_function(fast, naive, inputs)


def test_fp32_each_document_has_its_own_reference():
    """A document whose keys sit 300 above its neighbours', sharing chunks with them: a reference shared across
    documents would underflow the neighbours to 0/0."""
    q, k, v = (t.detach() for t in qkv(1, 40, 4))
    cu_seqlens = torch.tensor([0, 5, 13, 19, 40], dtype=torch.int32)
    k[:, 5:13] += 300.0
    w_rel = torch.randn(6, dtype=torch.float64)
    for fast, naive in [(lambda *a: aft_local(*a, w_rel.float(), window=6, cu_seqlens=cu_seqlens, chunk_size=8),
                         lambda *a: aft_local_naive(*a, w_rel, window=6, cu_seqlens=cu_seqlens)),
                        (lambda *a: aft_simple(*a, cu_seqlens=cu_seqlens, chunk_size=8),
                         lambda *a: aft_simple_naive(*a, cu_seqlens=cu_seqlens))]:
        out = fast(q.float(), k.float(), v.float())
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), naive(q, k, v), rtol=1e-4, atol=1e-5)


def test_fp32_keys_far_apart_stay_finite():
    """One key 300 above the rest (at a chunk start): a single max over the whole sequence would leave every
    earlier causal row 0/0; the running max per chunk does not."""
    q, k, v = (t.detach() for t in qkv(1, 50, 4))
    k[:, 40] += 300.0
    k[:, 3] -= 300.0
    w_rel, w = torch.randn(5, dtype=torch.float64), torch.randn(50, 50, dtype=torch.float64)
    for fast, naive in [(lambda *a: aft_full(*a, w.float(), chunk_size=8), lambda *a: aft_full_naive(*a, w)),
                        (lambda *a: aft_local(*a, w_rel.float(), window=5, chunk_size=8),
                         lambda *a: aft_local_naive(*a, w_rel, window=5)),
                        (lambda *a: aft_simple(*a, chunk_size=8), aft_simple_naive)]:
        out = fast(q.float(), k.float(), v.float())
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), naive(q, k, v), rtol=1e-4, atol=1e-5)


def test_bf16_inputs_accumulate_in_fp32():
    q, k, v = (t.detach() for t in qkv(2, 40, 8))
    w, w_rel, w_conv = (torch.randn(*shape, dtype=torch.float64).bfloat16().double()
                        for shape in [(40, 40), (4,), (2, 3, 3)])
    cases = [(lambda *a: aft_full(*a, w.bfloat16()), lambda *a: aft_full_naive(*a, w)),
             (lambda *a: aft_local(*a, w_rel.bfloat16(), window=4, chunk_size=16),
              lambda *a: aft_local_naive(*a, w_rel, window=4)),
             (lambda *a: aft_simple(*a, chunk_size=16), aft_simple_naive),
             (lambda *a: aft_conv2d(*a, w_conv.bfloat16(), hw=(5, 8), heads=2),
              lambda *a: aft_conv2d_naive(*a, w_conv, hw=(5, 8), heads=2))]
    rounded = [t.bfloat16().double() for t in (q, k, v)]
    for fast, naive in cases:
        out = fast(q.bfloat16(), k.bfloat16(), v.bfloat16())
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), naive(*rounded), rtol=1e-2, atol=1e-2)  # bf16 output rounding


def test_bad_input_names_the_problem():
    q, k, v = (t.detach() for t in qkv(1, 10, 4))
    with pytest.raises(ValueError, match="T_max"):
        aft_full(q, k, v, torch.zeros(8, 8))
    with pytest.raises(ValueError, match=r"window=3 causal needs \(3,\)"):
        aft_local(q, k, v, torch.zeros(5), window=3)
    with pytest.raises(ValueError, match="hw=\\(3, 4\\)"):
        aft_conv2d(q, k, v, torch.zeros(2, 3, 3), hw=(3, 4), heads=2)
    with pytest.raises(ValueError, match="s odd"):
        aft_conv2d(q, k, v, torch.zeros(2, 2, 2), hw=(2, 5), heads=2)
