"""The chunked and recurrent delta rule equal the token-by-token recurrence (naive): outputs, final states and the
gradients of q, k, v, β, g and the initial state, in fp64 to 1e-10, over awkward shapes and β/gate regimes; pieces
with a carried state equal the whole; bad inputs fail by name."""
import pytest
import torch
import torch.nn.functional as F

from pretrain.ops.delta_rule import chunk as chunk_module
from pretrain.ops.delta_rule import delta_rule

CHUNK = 8  # small, so short test sequences still span many chunks
TOL = dict(rtol=1e-10, atol=1e-10)

# (batch, T, cu_seqlens): one token, T not a multiple of the chunk, whole chunks, packed documents that begin at
# and inside chunks, one-token ones among them
SHAPES = {
    "single_token": (2, 1, None),
    "ragged_tail": (2, 37, None),
    "whole_chunks": (1, 4 * CHUNK, None),
    "documents": (1, 45, [0, 1, 2, 5, 13, 16, 29, 45]),
}
# β and the log-gate g per token: (low, high) of a uniform draw; g None is DeltaNet
REGIMES = {
    "deltanet": ((0.0, 1.0), None),
    "beta_near_0": ((1e-4, 1e-3), (-0.5, 0.0)),
    "beta_near_1": ((1 - 1e-3, 1 - 1e-4), (-0.5, 0.0)),
    "strong_gate": ((0.0, 1.0), (-8.0, -2.0)),
    "weak_gate": ((0.0, 1.0), (-1e-3, 0.0)),
}


def make_inputs(batch, T, regime, heads=2, dk=3, dv=5, *, seed=0):
    """q, L2-normalized k, v, β, g (fp64 leaves that require grad; g None for DeltaNet)."""
    gen = torch.Generator().manual_seed(seed)

    def uniform(low_high, *shape):
        low, high = low_high
        return low + (high - low) * torch.rand(*shape, generator=gen, dtype=torch.float64)

    q = torch.randn(batch, T, heads, dk, generator=gen, dtype=torch.float64)
    k = F.normalize(torch.randn(batch, T, heads, dk, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(batch, T, heads, dv, generator=gen, dtype=torch.float64)
    beta_range, gate_range = REGIMES[regime]
    beta = uniform(beta_range, batch, T, heads)
    g = None if gate_range is None else uniform(gate_range, batch, T, heads)
    return [None if x is None else x.requires_grad_() for x in (q, k, v, beta, g)]


def run_with_grads(inputs, state, *, impl, seed=2, **kwargs):
    """Output, final state and the gradients of a random linear function of both w.r.t. every input given."""
    o, final = delta_rule(*inputs, impl=impl, initial_state=state, output_final_state=True, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
    loss = loss + (final * torch.randn(final.shape, generator=gen, dtype=final.dtype)).sum()
    leaves = [x for x in [*inputs, state] if x is not None]
    return o, final, torch.autograd.grad(loss, leaves)


def assert_same(got, want, what):
    o, final, grads = got
    o_ref, final_ref, grads_ref = want
    torch.testing.assert_close(o, o_ref, **TOL, msg=lambda m: f"{what} output: {m}")
    torch.testing.assert_close(final, final_ref, **TOL, msg=lambda m: f"{what} final state: {m}")
    names = ["q", "k", "v", "beta", "g", "initial_state"]
    for name, a, b in zip([n for n in names], grads, grads_ref):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what} d{name}: {m}")  # noqa: B023


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("with_state", [False, True], ids=["from_zero", "from_state"])
def test_chunk_and_recurrent_match_naive_fp64(shape, regime, with_state):
    batch, T, cu = SHAPES[shape]
    cu_seqlens = None if cu is None else torch.tensor(cu)
    inputs = make_inputs(batch, T, regime)
    num = batch if cu is None else len(cu) - 1
    state = torch.randn(num, 2, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    state = state.requires_grad_() if with_state else None
    want = run_with_grads(inputs, state, impl="naive", cu_seqlens=cu_seqlens)
    for impl in ("chunk", "recurrent"):
        got = run_with_grads(inputs, state, impl=impl, cu_seqlens=cu_seqlens, chunk_size=CHUNK)
        assert_same(got, want, impl)


@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_any_chunk_size_and_one_chunk_per_block(monkeypatch, chunk_size):
    """Chunks of one token, of a size that is not a power of two, longer than the documents; and blocks of a single
    chunk (each recomputed on its own in backward), on packed documents with initial states."""
    cu = [0, 1, 2, 5, 13, 16, 29, 45]
    inputs = make_inputs(1, 45, "strong_gate", seed=3)
    state = torch.randn(len(cu) - 1, 2, 3, 5, dtype=torch.float64).requires_grad_()
    want = run_with_grads(inputs, state, impl="naive", cu_seqlens=torch.tensor(cu))
    monkeypatch.setattr(chunk_module, "BLOCK_ELEMENTS", 1)
    got = run_with_grads(inputs, state, impl="chunk", cu_seqlens=torch.tensor(cu), chunk_size=chunk_size)
    assert_same(got, want, f"chunk_size={chunk_size}")


def test_auto_is_chunk_and_grad_free_calls_agree():
    inputs = make_inputs(2, 21, "weak_gate", seed=4)
    o_auto = delta_rule(*inputs, chunk_size=CHUNK)
    with torch.no_grad():
        o_chunk = delta_rule(*inputs, chunk_size=CHUNK, impl="chunk")
    torch.testing.assert_close(o_auto.detach(), o_chunk, rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["chunk", "recurrent"])
def test_pieces_with_carried_state_equal_the_whole(impl):
    q, k, v, beta, g = (x.detach() for x in make_inputs(2, 30, "strong_gate", seed=5))
    o_whole, S_whole = delta_rule(q, k, v, beta, g, output_final_state=True, chunk_size=CHUNK, impl=impl)
    cut = 11
    o_1, S_1 = delta_rule(q[:, :cut], k[:, :cut], v[:, :cut], beta[:, :cut], g[:, :cut], output_final_state=True,
                          chunk_size=CHUNK, impl=impl)
    o_2, S_2 = delta_rule(q[:, cut:], k[:, cut:], v[:, cut:], beta[:, cut:], g[:, cut:], initial_state=S_1,
                          output_final_state=True, chunk_size=CHUNK, impl=impl)
    torch.testing.assert_close(torch.cat([o_1, o_2], 1), o_whole, **TOL)
    torch.testing.assert_close(S_2, S_whole, **TOL)


def test_fp32_and_bf16_keep_their_dtype_with_an_fp32_state():
    q, k, v, beta, g = (x.detach() for x in make_inputs(1, 19, "weak_gate", seed=6))
    o_ref, S_ref = delta_rule(q, k, v, beta, g, output_final_state=True, impl="naive")
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        o, S = delta_rule(*(x.to(dtype) for x in (q, k, v, beta, g)), output_final_state=True, chunk_size=CHUNK)
        assert o.dtype == dtype and S.dtype == torch.float32
        torch.testing.assert_close(o.double(), o_ref, rtol=tol, atol=tol)
        torch.testing.assert_close(S.double(), S_ref, rtol=tol, atol=tol)


def test_bad_inputs_fail_by_name():
    q, k, v, beta, g = (x.detach() for x in make_inputs(1, 6, "weak_gate"))
    with pytest.raises(ValueError, match="impl must be one of"):
        delta_rule(q, k, v, beta, g, impl="fused")
    with pytest.raises(ValueError, match=r"beta \[B, T, H\]"):
        delta_rule(q, k, v, beta[..., :1], g)
    with pytest.raises(ValueError, match=r"g \[B, T, H\]"):
        delta_rule(q, k, v, beta, g[:, :3])
    with pytest.raises(ValueError, match=r"initial_state has shape \(1, 2, 5, 3\)"):
        delta_rule(q, k, v, beta, g, initial_state=torch.zeros(1, 2, 5, 3))
    with pytest.raises(ValueError, match="cu_seqlens must rise strictly"):
        delta_rule(q, k, v, beta, g, cu_seqlens=torch.tensor([0, 3, 3, 6]))
    with pytest.raises(ValueError, match="q, k"):
        delta_rule(q, k[..., :2], v, beta, g)
