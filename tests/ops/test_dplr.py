"""The chunked and recurrent diagonal-plus-low-rank rule equal the token-by-token recurrence (naive): outputs, final
states and the gradients of q, k, v, a, b, g and the initial state, in fp64 to 1e-10, over awkward shapes and gate
regimes (per channel, near 0 and near −20); the gated delta rule is its special case; pieces with a carried state
equal the whole; bad inputs fail by name."""
import pytest
import torch
import torch.nn.functional as F

from pretrain.ops.delta_rule import chunk as delta_chunk_module
from pretrain.ops.delta_rule import delta_rule
from pretrain.ops.dplr import dplr_delta_rule, kda_delta_rule

CHUNK = 8  # small, so short test sequences still span many chunks
TOL = dict(rtol=1e-10, atol=1e-10)

SHAPES = {  # (batch, T, cu_seqlens)
    "single_token": (2, 1, None),
    "ragged_tail": (2, 37, None),
    "documents": (1, 45, [0, 1, 2, 5, 13, 16, 29, 45]),
}
# the transition's parts per token: "kda" is Kimi's (I − β k kᵀ) Diag(α), "rwkv7" RWKV-7's Diag(w) − (η ⊙ κ) κᵀ;
# the log-gate per channel drawn from (low, high), "mixed" half the channels near 0 and half near −20
REGIMES = {
    "kda_gates_near_0": ("kda", (-1e-3, 0.0)),
    "kda_gates_near_-20": ("kda", (-20.0, -19.0)),
    "kda_mixed": ("kda", "mixed"),
    "kda_moderate": ("kda", (-1.0, 0.0)),
    "rwkv7_mixed": ("rwkv7", "mixed"),
}


def make_inputs(batch, T, regime, heads=2, dk=4, dv=5, *, seed=0):
    """q, k, v, a, b, g: fp64 leaves that require grad."""
    gen = torch.Generator().manual_seed(seed)
    form, gates = REGIMES[regime]
    shape = (batch, T, heads, dk)
    if gates == "mixed":
        g = torch.cat([-1e-3 * torch.rand(*shape[:3], dk // 2, generator=gen, dtype=torch.float64),
                       -19 - torch.rand(*shape[:3], dk - dk // 2, generator=gen, dtype=torch.float64)], -1)
    else:
        g = gates[0] + (gates[1] - gates[0]) * torch.rand(*shape, generator=gen, dtype=torch.float64)
    q, k = (torch.randn(*shape, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(batch, T, heads, dv, generator=gen, dtype=torch.float64)
    key = F.normalize(torch.randn(*shape, generator=gen, dtype=torch.float64), dim=-1)
    rate = torch.rand(*(shape if form == "rwkv7" else shape[:3] + (1,)), generator=gen, dtype=torch.float64)
    a, b = (-rate * key, key * g.exp()) if form == "kda" else (-rate * key, key)
    return [x.detach().requires_grad_() for x in (q, k, v, a, b, g)]


def run_with_grads(op, inputs, state, *, seed=2, **kwargs):
    """Output, final state and the gradients of a random linear function of both w.r.t. every input given."""
    o, final = op(*inputs, initial_state=state, output_final_state=True, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
    loss = loss + (final * torch.randn(final.shape, generator=gen, dtype=final.dtype)).sum()
    leaves = [x for x in [*inputs, state] if x is not None]
    return o, final, torch.autograd.grad(loss, leaves)


def assert_same(got, want, what, names=("q", "k", "v", "a", "b", "g", "initial_state")):
    o, final, grads = got
    o_ref, final_ref, grads_ref = want
    torch.testing.assert_close(o, o_ref, **TOL, msg=lambda m: f"{what} output: {m}")
    torch.testing.assert_close(final, final_ref, **TOL, msg=lambda m: f"{what} final state: {m}")
    for name, x, y in zip(names, grads, grads_ref):
        torch.testing.assert_close(x, y, **TOL, msg=lambda m: f"{what} d{name}: {m}")  # noqa: B023


def random_state(num, *, seed=1):
    return torch.randn(num, 2, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("with_state", [False, True], ids=["from_zero", "from_state"])
def test_chunk_and_recurrent_match_naive_fp64(shape, regime, with_state):
    batch, T, cu = SHAPES[shape]
    cu_seqlens = None if cu is None else torch.tensor(cu)
    inputs = make_inputs(batch, T, regime)
    state = random_state(batch if cu is None else len(cu) - 1).requires_grad_() if with_state else None
    want = run_with_grads(dplr_delta_rule, inputs, state, impl="naive", cu_seqlens=cu_seqlens)
    for impl in ("chunk", "recurrent"):
        got = run_with_grads(dplr_delta_rule, inputs, state, impl=impl, cu_seqlens=cu_seqlens, chunk_size=CHUNK)
        assert_same(got, want, impl)


@pytest.mark.parametrize("chunk_size", [1, 5, 11, 32, 64])
def test_any_chunk_size_sub_chunks_and_one_chunk_per_block(monkeypatch, chunk_size):
    """Chunks of one token, of prime sizes (leaves padded to a power of two), of 32 and 64 with documents straddling
    their sub-chunks, longer than the documents; and blocks of a single chunk (each recomputed on its own)."""
    cu = [0, 1, 2, 5, 13, 16, 29, 45, 50, 90]
    inputs = make_inputs(1, 90, "kda_mixed", seed=3)
    state = random_state(len(cu) - 1).requires_grad_()
    want = run_with_grads(dplr_delta_rule, inputs, state, impl="naive", cu_seqlens=torch.tensor(cu))
    monkeypatch.setattr(delta_chunk_module, "BLOCK_ELEMENTS", 1)
    got = run_with_grads(dplr_delta_rule, inputs, state, impl="chunk", cu_seqlens=torch.tensor(cu),
                         chunk_size=chunk_size)
    assert_same(got, want, f"chunk_size={chunk_size}")


@pytest.mark.parametrize("impl", ["naive", "chunk", "recurrent"])
def test_the_gated_delta_rule_is_its_special_case(impl):
    """``g`` equal over channels, ``a = −β k``, ``b = e^g k`` and keys ``β k``: the gated delta rule's outputs, states
    and gradients of q, k, v, β and g (through the construction), against the delta rule's own chunked form."""
    gen = torch.Generator().manual_seed(7)
    cu = torch.tensor([0, 3, 20, 21, 45])
    q, v = torch.randn(1, 45, 2, 4, generator=gen, dtype=torch.float64), torch.randn(1, 45, 2, 5, generator=gen,
                                                                                      dtype=torch.float64)
    k = F.normalize(torch.randn(1, 45, 2, 4, generator=gen, dtype=torch.float64), dim=-1)
    beta, g = torch.rand(1, 45, 2, generator=gen, dtype=torch.float64), -3 * torch.rand(1, 45, 2, generator=gen,
                                                                                        dtype=torch.float64)
    leaves = [x.requires_grad_() for x in (q, k, v, beta, g)]
    state = random_state(4).requires_grad_()

    def as_dplr(q, k, v, beta, g, **kwargs):
        channels = g[..., None].expand_as(k)
        return dplr_delta_rule(q, beta[..., None] * k, v, -beta[..., None] * k, channels.exp() * k, channels,
                               **kwargs)

    want = run_with_grads(delta_rule, leaves, state, impl="chunk", cu_seqlens=cu, chunk_size=CHUNK)
    got = run_with_grads(as_dplr, leaves, state, impl=impl, cu_seqlens=cu, chunk_size=CHUNK)
    assert_same(got, want, impl, names=("q", "k", "v", "beta", "g", "initial_state"))


@pytest.mark.parametrize("impl", ["chunk", "recurrent"])
def test_pieces_with_carried_state_equal_the_whole(impl):
    inputs = [x.detach() for x in make_inputs(2, 30, "rwkv7_mixed", seed=5)]
    o_whole, S_whole = dplr_delta_rule(*inputs, output_final_state=True, chunk_size=CHUNK, impl=impl)
    cut = 11
    o_1, S_1 = dplr_delta_rule(*(x[:, :cut] for x in inputs), output_final_state=True, chunk_size=CHUNK, impl=impl)
    o_2, S_2 = dplr_delta_rule(*(x[:, cut:] for x in inputs), initial_state=S_1, output_final_state=True,
                               chunk_size=CHUNK, impl=impl)
    torch.testing.assert_close(torch.cat([o_1, o_2], 1), o_whole, **TOL)
    torch.testing.assert_close(S_2, S_whole, **TOL)


@pytest.mark.parametrize("regime", ["kda_gates_near_0", "kda_mixed"])
def test_fp32_and_bf16_keep_their_dtype_with_an_fp32_state(regime):
    """bf16 inputs run in fp32 (the gates are given in fp32, as the mixers make them): the error is the inputs'
    rounding, gates near −20 included."""
    inputs = [x.detach() for x in make_inputs(1, 70, regime, seed=6)]
    o_ref, S_ref = dplr_delta_rule(*inputs, output_final_state=True, impl="naive")
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 5e-2)):
        *rest, g = inputs
        o, S = dplr_delta_rule(*(x.to(dtype) for x in rest), g.float(), output_final_state=True, chunk_size=64)
        assert o.dtype == dtype and S.dtype == torch.float32
        torch.testing.assert_close(o.double(), o_ref, rtol=tol, atol=tol)
        torch.testing.assert_close(S.double(), S_ref, rtol=tol, atol=tol)


def test_bad_inputs_fail_by_name():
    q, k, v, a, b, g = (x.detach() for x in make_inputs(1, 6, "kda_mixed"))
    with pytest.raises(ValueError, match="impl must be one of"):
        dplr_delta_rule(q, k, v, a, b, g, impl="fused")
    with pytest.raises(ValueError, match=r"wants g \[B, T, H, Dk\]"):
        dplr_delta_rule(q, k, v, a, b, g[..., 0])
    with pytest.raises(ValueError, match=r"wants a \[B, T, H, Dk\]"):
        dplr_delta_rule(q, k, v, a[:, :3], b, g)
    with pytest.raises(ValueError, match=r"initial_state has shape \(1, 2, 5, 4\)"):
        dplr_delta_rule(q, k, v, a, b, g, initial_state=torch.zeros(1, 2, 5, 4))
    with pytest.raises(ValueError, match="cu_seqlens must rise strictly"):
        dplr_delta_rule(q, k, v, a, b, g, cu_seqlens=torch.tensor([0, 3, 3, 6]))


def test_a_runs_map_and_its_combine_rule():
    """``(S_run, M)`` of a run maps any entering state to the run's final state; masked-out tokens count for nothing;
    the pairs of two runs combine into the pair of both."""
    from pretrain.ops.dplr.state import combine_transitions, dplr_transition_of_tokens

    q, k, v, a, b, g = (x.detach() for x in make_inputs(2, 30, "kda_mixed", seed=8))
    entering = random_state(2, seed=9)
    _, want = dplr_delta_rule(q, k, v, a, b, g, initial_state=entering, output_final_state=True, impl="naive")
    S_run, M = dplr_transition_of_tokens(k, v, a, b, g, torch.ones(2, 30, dtype=torch.bool), chunk_size=CHUNK)
    torch.testing.assert_close(M @ entering + S_run, want, **TOL)

    mask = torch.arange(30) >= 4  # the first four tokens belong to someone else
    tail = dplr_transition_of_tokens(k, v, a, b, g, mask.expand(2, 30), chunk_size=CHUNK)
    _, want_tail = dplr_delta_rule(*(x[:, 4:] for x in (q, k, v, a, b, g)), initial_state=entering,
                                   output_final_state=True, impl="naive")
    torch.testing.assert_close(tail[1] @ entering + tail[0], want_tail, **TOL)

    cut = 13
    pieces = [dplr_transition_of_tokens(*(x[:, part] for x in (k, v, a, b, g)), torch.ones(2, len(range(30)[part]),
                                        dtype=torch.bool), chunk_size=CHUNK) for part in (slice(cut), slice(cut, 30))]
    S_both, M_both = combine_transitions(*pieces)
    torch.testing.assert_close(S_both, S_run, **TOL)
    torch.testing.assert_close(M_both, M, **TOL)


@pytest.mark.parametrize("spread, chunk_size, leaf", [(300.0, 32, 32), (6.0, 32, 8), (-1.0, 32, 1), (8.0, 15, 5),
                                                     (8.0, 45, 9), (-1.0, 11, 1)],
                         ids=["factored_whole", "factored_quarters", "single_tokens", "three_leaves_padded",
                              "five_leaves_padded", "eleven_tokens_padded"])
def test_moderate_gates_factored_or_single_tokens(monkeypatch, spread, chunk_size, leaf):
    """Gates in (−1, 0) factor through a whole chunk of 32, or (allowed a spread of 6) through its quarters, the tree's
    levels above them; with factoring refused, leaves of single tokens and every level give the same; leaves whose
    count is not a power of two are padded to one. The leaf each case takes is checked, so that none of them silently
    stops covering its path."""
    from pretrain.ops.dplr import chunk as dplr_chunk_module

    cu = torch.tensor([0, 1, 2, 5, 13, 16, 29, 45])
    inputs = make_inputs(1, 45, "kda_moderate", seed=10)
    want = run_with_grads(dplr_delta_rule, inputs, None, impl="naive", cu_seqlens=cu)
    monkeypatch.setattr(dplr_chunk_module, "FACTORED_SPREAD", {torch.float64: spread})
    taken, choose = [], dplr_chunk_module._factored_sub_chunk

    def recorded(*args):
        taken.append(choose(*args))
        return taken[-1]

    monkeypatch.setattr(dplr_chunk_module, "_factored_sub_chunk", recorded)
    assert_same(run_with_grads(dplr_delta_rule, inputs, None, impl="chunk", cu_seqlens=cu, chunk_size=chunk_size),
                want, f"spread {spread}, chunk {chunk_size}")
    assert set(taken) == {leaf}, taken


@pytest.mark.parametrize("gates", [(-1e-3, 0.0), (-20.0, -19.0)], ids=["near_0", "near_-20"])
@pytest.mark.parametrize("chunk_size", [CHUNK, 32])
def test_kda_entry_equals_the_transition_written_out(gates, chunk_size):
    """``kda_delta_rule``'s chunked form (two products a chunk) against the naive form of ``(I − β k kᵀ) Diag(e^g)``:
    outputs, states and the gradients of q, k, v, β and g, packed documents and initial states."""
    gen = torch.Generator().manual_seed(11)
    cu = torch.tensor([0, 1, 2, 5, 13, 16, 29, 45, 50, 90])
    q, v = torch.randn(1, 90, 2, 4, generator=gen, dtype=torch.float64), torch.randn(1, 90, 2, 5, generator=gen,
                                                                                      dtype=torch.float64)
    k = F.normalize(torch.randn(1, 90, 2, 4, generator=gen, dtype=torch.float64), dim=-1)
    beta = torch.rand(1, 90, 2, generator=gen, dtype=torch.float64)
    g = gates[0] + (gates[1] - gates[0]) * torch.rand(1, 90, 2, 4, generator=gen, dtype=torch.float64)
    leaves = [x.requires_grad_() for x in (q, k, v, beta, g)]
    state = random_state(9).requires_grad_()
    want = run_with_grads(kda_delta_rule, leaves, state, impl="naive", cu_seqlens=cu)
    got = run_with_grads(kda_delta_rule, leaves, state, impl="chunk", cu_seqlens=cu, chunk_size=chunk_size)
    assert_same(got, want, "kda", names=("q", "k", "v", "beta", "g", "initial_state"))
