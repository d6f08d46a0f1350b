"""Every form of decayed linear attention equals the O(T²) definition (docs/MIXERS.md#decay): outputs, final states
and the gradients of q, k, v, the log-decay g and the initial state, in fp64 at 1e-10, for a constant decay per head
and a gate per token and head; the chunked form stays finite where the cumulative log-decay reaches −10⁴ and keeps
only its inputs and a state per block of chunks for backward; bad inputs and the combinations decay does not support
fail by name."""
import pytest
import torch

from pretrain.ops.decayed_linear_attention import chunk as chunk_module
from pretrain.ops.decayed_linear_attention import decayed_linear_attention
from pretrain.ops.linear_attention.state import LinearAttentionState

CHUNK = 8  # small, so short test sequences still span many chunks
TOL = {"rtol": 1e-10, "atol": 1e-10}

# (batch, T, cu_seqlens): one token, T not a multiple of the chunk, packed documents (one-token ones, documents
# that start and end inside chunks and that straddle chunk boundaries)
SHAPES = {
    "single_token": (2, 1, None),
    "ragged_tail": (2, 37, None),
    "documents": (1, 45, [0, 1, 2, 5, 13, 16, 29, 44, 45]),
}


def inputs(batch, T, *, per_token, scale=1.0, heads=2, dk=3, dv=5, seed=0):
    """Positive q, k (feature-mapped), signed v and a log-decay ``−scale·U(0, 1)`` (per token, or per head)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.rand(batch, T, heads, dk, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(batch, T, heads, dv, generator=gen, dtype=torch.float64)
    shape = (batch, T, heads) if per_token else (heads,)
    g = -scale * torch.rand(shape, generator=gen, dtype=torch.float64)
    return [x.requires_grad_() for x in (q, k, v, g)]


def initial_states(num, normalize, heads=2, dk=3, dv=5, seed=1):
    gen = torch.Generator().manual_seed(seed)
    S = torch.randn(num, heads, dk, dv, generator=gen, dtype=torch.float64).requires_grad_()
    if normalize == "none":
        return LinearAttentionState(S)
    z = 3 * torch.rand(num, heads, dk, generator=gen, dtype=torch.float64)
    return LinearAttentionState(S, z.requires_grad_())


def results(impl, tensors, state, *, chunk_size=CHUNK, **kwargs):
    """Output, final state, and the gradients of a fixed random function of both w.r.t. every input."""
    o, final = decayed_linear_attention(*tensors, impl=impl, initial_state=state, output_final_state=True,
                                        chunk_size=chunk_size, **kwargs)
    gen = torch.Generator().manual_seed(2)
    outs = [o] + [f for f in final if f is not None]
    loss = sum((x * torch.randn(x.shape, generator=gen, dtype=torch.float64)).sum() for x in outs)
    leaves = [*tensors, *([] if state is None else [s for s in state if s is not None])]
    return [x.detach() for x in outs] + list(torch.autograd.grad(loss, leaves))


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("normalize", ["none", "divisive"])
@pytest.mark.parametrize("per_token", [True, False], ids=["per_token", "per_head"])
def test_chunk_and_recurrent_equal_naive(per_token, normalize, shape, with_state):
    batch, T, offsets = SHAPES[shape]
    cu = None if offsets is None else torch.tensor(offsets)
    tensors = inputs(batch, T, per_token=per_token)
    num = batch if cu is None else cu.numel() - 1
    state = initial_states(num, normalize) if with_state else None
    want = results("naive", tensors, state, normalize=normalize, cu_seqlens=cu)
    for impl in ("chunk", "recurrent"):
        for got, ref in zip(results(impl, tensors, state, normalize=normalize, cu_seqlens=cu), want):
            torch.testing.assert_close(got, ref, **TOL)


@pytest.mark.parametrize("log_decay", [-20.0, -1e-6])
def test_gates_near_zero_and_near_one(log_decay):
    """g ≈ −20 (each token all but forgets the past) and g ≈ −10⁻⁶ (the state barely forgets) with the gates'
    gradients, across packed documents."""
    cu = torch.tensor([0, 3, 20, 21, 45])
    q, k, v, g = inputs(1, 45, per_token=True)
    g = (log_decay * (1 + 0.1 * g.detach())).requires_grad_()  # spread a little around the value
    want = results("naive", [q, k, v, g], None, cu_seqlens=cu)
    for impl in ("chunk", "recurrent"):
        for got, ref in zip(results(impl, [q, k, v, g], None, cu_seqlens=cu), want):
            torch.testing.assert_close(got, ref, **TOL)


def test_long_sequence_with_deep_cumulative_decay_stays_finite_and_exact():
    """T = 4,096 with g ≈ −2.5 per token: the cumulative log-decay reaches −10⁴, where exp(G_i)·exp(−G_j) would be
    0·∞. The chunked form (64-token chunks, as in training) equals the recurrence, outputs and gradients."""
    q, k, v, g = inputs(1, 4096, per_token=True, scale=5.0, heads=1, dk=2, dv=2, seed=3)
    assert g.detach().sum() < -1e4
    got = results("chunk", [q, k, v, g], None, chunk_size=64)
    for x in got:
        assert torch.isfinite(x).all()
    for x, ref in zip(got, results("recurrent", [q, k, v, g], None)):
        torch.testing.assert_close(x, ref, **TOL)


@pytest.mark.parametrize("normalize", ["none", "divisive"])
def test_blocks_of_one_chunk_each_recomputed_on_its_own(monkeypatch, normalize):
    """Blocks of a single chunk, each run again with autograd in backward and handing its state to the next, equal
    the definition: packed documents, initial states in, final states out, every gradient."""
    batch, T, offsets = SHAPES["documents"]
    cu = torch.tensor(offsets)
    tensors = inputs(batch, T, per_token=True)
    state = initial_states(cu.numel() - 1, normalize)
    want = results("naive", tensors, state, normalize=normalize, cu_seqlens=cu)
    monkeypatch.setattr(chunk_module, "BLOCK_ELEMENTS", 1)
    for got, ref in zip(results("chunk", tensors, state, normalize=normalize, cu_seqlens=cu), want):
        torch.testing.assert_close(got, ref, **TOL)


@pytest.mark.parametrize("normalize", ["none", "divisive"])
def test_chunk_keeps_its_inputs_and_one_state_for_backward(normalize):
    """Backward keeps q, k, v and g, 4·(2D + Dv + 1) bytes per token and head in fp32 (divisive: v with the
    denominator's column of ones, Dv + 1 wide, and the quotient and denominator kept outside the core, 4·(Dv + 1)
    more), and one D×Dv state per head and block of chunks (one block here): none of the C×C decay and weight
    matrices nor the T/C chunk states, so the bytes do not depend on the chunk size. (Autograd through the chunks
    kept 3× as much.)"""
    T, H, D = 256, 2, 32
    q, k, v, g = (x.float().detach().requires_grad_() for x in inputs(1, T, per_token=True, heads=H, dk=D, dv=D))

    def saved_bytes(chunk_size):
        held = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: held.append(t) or t, lambda t: t):
            decayed_linear_attention(q, k, v, g, normalize=normalize, impl="chunk", chunk_size=chunk_size)
        return sum(t.numel() * t.element_size() for t in held)

    dv = D + (normalize == "divisive")  # v, augmented with the denominator's column of ones
    per_token = 4 * (2 * D + dv + 1) + (4 * dv if normalize == "divisive" else 0)
    bound = T * H * per_token + H * D * dv * 4
    assert saved_bytes(4) == saved_bytes(64) == bound


def test_gradcheck_fp64():
    cu = torch.tensor([0, 1, 6, 11])
    q, k, v, g = inputs(1, 11, per_token=True, heads=1, dk=2, dv=2)
    state = initial_states(3, "divisive", heads=1, dk=2, dv=2)
    def run(q, k, v, g, S, z):
        o, final = decayed_linear_attention(q, k, v, g, normalize="divisive", cu_seqlens=cu, chunk_size=4,
                                            initial_state=LinearAttentionState(S, z), output_final_state=True)
        return o, final.S, final.z

    assert torch.autograd.gradcheck(run, (q, k, v, g, state.S, state.z))


def test_pieces_with_carried_state_equal_the_whole():
    q, k, v, g = (x.detach() for x in inputs(2, 30, per_token=True))
    whole = decayed_linear_attention(q, k, v, g, normalize="divisive", chunk_size=CHUNK)
    first, state = decayed_linear_attention(q[:, :13], k[:, :13], v[:, :13], g[:, :13], normalize="divisive",
                                            output_final_state=True, chunk_size=CHUNK)
    rest = decayed_linear_attention(q[:, 13:], k[:, 13:], v[:, 13:], g[:, 13:], normalize="divisive",
                                    initial_state=state, impl="recurrent")
    torch.testing.assert_close(torch.cat([first, rest], 1), whole, **TOL)


def test_zero_decay_is_linear_attention():
    from pretrain.ops.linear_attention import linear_attention
    q, k, v, _ = (x.detach() for x in inputs(1, 29, per_token=False))
    cu = torch.tensor([0, 4, 29])
    torch.testing.assert_close(decayed_linear_attention(q, k, v, torch.zeros(2, dtype=torch.float64), cu_seqlens=cu,
                                                        normalize="divisive", chunk_size=CHUNK),
                               linear_attention(q, k, v, cu_seqlens=cu, normalize="divisive", chunk_size=CHUNK),
                               **TOL)


def test_fp32_inputs_give_fp32_outputs_close_to_fp64():
    q, k, v, g = (x.detach() for x in inputs(1, 100, per_token=True, scale=3.0))
    o = decayed_linear_attention(*(x.float() for x in (q, k, v, g)), normalize="divisive")
    assert o.dtype == torch.float32
    torch.testing.assert_close(o.double(), decayed_linear_attention(q, k, v, g, normalize="divisive", impl="naive"),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", ["chunk", "recurrent"])
def test_bf16_inputs_accumulate_in_fp32_with_an_fp32_state(impl):
    q, k, v, g = (x.detach() for x in inputs(1, 70, per_token=True))
    o, final = decayed_linear_attention(*(x.bfloat16() for x in (q, k, v)), g.float(), normalize="divisive",
                                        output_final_state=True, chunk_size=16, impl=impl)
    assert o.dtype == torch.bfloat16 and final.S.dtype == final.z.dtype == torch.float32
    want = decayed_linear_attention(*(x.bfloat16().double() for x in (q, k, v)), g.float().double(),
                                    normalize="divisive", impl="naive")
    torch.testing.assert_close(o.double(), want, rtol=1e-2, atol=1e-2)  # bf16's 8 bits, rounding o once


def test_auto_runs_the_chunked_form():
    q, k, v, g = (x.detach() for x in inputs(1, 20, per_token=True))
    torch.testing.assert_close(decayed_linear_attention(q, k, v, g, chunk_size=CHUNK),
                               decayed_linear_attention(q, k, v, g, chunk_size=CHUNK, impl="chunk"), rtol=0, atol=0)


@pytest.mark.parametrize("change, message", [
    ({"normalize": "subtractive"}, "subtractive' does not combine with decay"),
    ({"normalize": "softmax"}, "normalize must be one of"),
    ({"impl": "fast"}, "impl must be one of"),
    ({"g": torch.zeros(3, dtype=torch.float64)}, r"must be \[H\] = \[2\]"),
    ({"g": torch.full((2,), 0.5, dtype=torch.float64)}, "finite and ≤ 0"),
    ({"g": torch.tensor([float("-inf"), -1.0], dtype=torch.float64)}, "finite and ≤ 0"),
    ({"g": torch.zeros(2, dtype=torch.long)}, "floating tensor"),
    ({"initial_state": LinearAttentionState(torch.zeros(1, 2, 3, 5))}, "initial_state.S has shape"),
    ({"normalize": "divisive", "initial_state": LinearAttentionState(torch.zeros(2, 2, 3, 5))},
     "initial_state.z is missing"),
])
def test_bad_inputs_fail_by_name(change, message):
    q, k, v, g = (x.detach() for x in inputs(2, 5, per_token=False))
    kwargs = {"g": g, **change}
    with pytest.raises(ValueError, match=message):
        decayed_linear_attention(q, k, v, **kwargs)
