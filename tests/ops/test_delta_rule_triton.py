"""The delta rule's Triton form held to the chunked form (run in fp64): outputs, final states and the gradients of
q, k, v, β, g and the initial state, on awkward shapes and gate regimes (docs/MIXERS.md#deltanet).

Without a GPU the kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by ``tests/conftest.py``);
shapes stay small because the interpreter is slow.
"""
import importlib
import warnings
from functools import partial

import kernel_checks
import pytest
import torch
import torch.nn.functional as F
from kernel_checks import assert_close

pytest.importorskip("triton")

from pretrain.ops.delta_rule import delta_rule

compare = partial(kernel_checks.compare, delta_rule)

delta_module = importlib.import_module("pretrain.ops.delta_rule")  # the package (ops/ exports the function by its name)
triton_module = importlib.import_module("pretrain.ops.delta_rule.triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# one-token documents, documents across the boundaries of chunks of 16 counted from the stream's start (chunk's
# layout; ours starts chunks at each document), a whole chunk
DOCUMENTS = [0, 1, 2, 5, 13, 16, 29, 45]


pytestmark = pytest.mark.usefixtures("unwritten_outputs_are_nan")  # tests/ops/conftest.py


def make_inputs(batch, length, heads, dk, dv, gates, *, seed, beta=(0.0, 1.0)):
    """q, L2-normalized k, v, β, g (None for DeltaNet), an initial state per sequence or document: fp64 leaves."""
    gen = torch.Generator().manual_seed(seed)

    def uniform(low, high, *shape):
        return low + (high - low) * torch.rand(*shape, generator=gen, dtype=torch.float64)

    q = torch.randn(batch, length, heads, dk, generator=gen, dtype=torch.float64)
    k = F.normalize(torch.randn(batch, length, heads, dk, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(batch, length, heads, dv, generator=gen, dtype=torch.float64)
    b = uniform(*beta, batch, length, heads)
    g = None if gates is None else uniform(*gates, batch, length, heads)
    return [None if x is None else x.to(DEVICE) for x in (q, k, v, b, g)]


# (batch, T, heads, Dk, Dv, cu_seqlens, gates (None: DeltaNet), chunk size)
CASES = {
    "deltanet_ragged_tail": (2, 37, 2, 16, 24, None, None, 16),
    "gated_documents": (1, 45, 2, 24, 16, DOCUMENTS, (-0.5, 0.0), 16),
    "deltanet_documents": (1, 45, 1, 16, 16, DOCUMENTS, None, 16),
    "gates_near_minus_20": (1, 45, 2, 16, 24, DOCUMENTS, (-20.0, -19.0), 16),
    "gates_near_0": (2, 21, 2, 16, 16, None, (-1e-3, 0.0), 16),
    "whole_chunks": (2, 32, 1, 16, 16, None, (-0.5, 0.0), 16),  # nothing pads: the chunk layout is a view
    "whole_chunk_documents": (1, 48, 1, 16, 16, [0, 16, 48], (-0.5, 0.0), 16),
    "width_64": (1, 40, 1, 64, 64, [0, 3, 40], (-1.0, 0.0), 32),
    "width_128_dv_64": (1, 20, 1, 128, 64, None, (-0.5, 0.0), 16),
    # a chunk of 20 in blocks of 32 rows: the rows past C must not reach exp (e^{+110} there once made dk, dg NaN)
    "chunk_20_strong_gates": (1, 45, 1, 16, 16, None, (-6.0, -5.0), 20),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_chunk_fp32(case):
    """Every output, state and gradient within 1e-5 relative of the chunked form in fp64, from a random initial
    state. (With gates near −20, g's gradient is ~α ≈ 2e-9 after cancelling terms of size 1 in the chunked form's
    fp32: 0.7 relative there, 1.5e-6 here, which writes the cancelling terms as constants.)"""
    batch, length, heads, dk, dv, cu, gates, chunk = CASES[case]
    seed = list(CASES).index(case)
    inputs = make_inputs(batch, length, heads, dk, dv, gates, seed=seed)
    kernel_checks.compare_from_random_state(delta_rule, inputs, cu, chunk, seed=seed)


@pytest.mark.parametrize("chunks_per_block", [1, 3])
def test_blocks_of_chunks_hand_on_the_running_document(monkeypatch, chunks_per_block):
    """Blocks of one chunk and of three (each recomputed on its own in backward): documents run across blocks,
    several end inside one, and the states and gradients still match."""
    monkeypatch.setattr(triton_module, "BLOCK_ELEMENTS", chunks_per_block * 2 * 8 * 16)  # heads × C × max(C, D)
    cu = [0, 1, 20, 23, 60]  # chunks of 8 from each document's start: 1, 3, 1 and 5
    inputs = make_inputs(1, 60, 2, 16, 16, (-1.0, 0.0), seed=20)
    state = torch.randn(len(cu) - 1, 2, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(20))
    compare(inputs, state.to(DEVICE), dtype=torch.float32, tol=1e-5, seed=20,
            cu_seqlens=torch.tensor(cu, device=DEVICE), chunk_size=8)


def test_beta_near_1_from_zero_state():
    """β near 1 (the solve's off-diagonal terms near ±k·k) and no initial state (none given, none differentiated)."""
    inputs = make_inputs(2, 30, 2, 16, 16, (-0.2, 0.0), seed=11, beta=(1 - 1e-3, 1.0))
    compare(inputs, None, dtype=torch.float32, tol=1e-5, seed=11, chunk_size=16)


def test_gradients_through_the_final_state_alone():
    """A loss of the final states only: no gradient reaches o (backward gets None for it), and every input's
    gradient still matches, packed documents included."""
    inputs = make_inputs(1, 30, 2, 16, 16, (-1.0, 0.0), seed=19)
    cu = torch.tensor([0, 11, 30], device=DEVICE)
    state = torch.randn(2, 2, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(19)).to(DEVICE)
    weights = torch.randn(2, 2, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(20)).to(DEVICE)
    grads = {}
    for impl, dtype in (("triton", torch.float32), ("chunk", torch.float64)):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (*inputs, state)]
        _, final = delta_rule(*leaves[:5], cu_seqlens=cu, initial_state=leaves[5], output_final_state=True,
                              chunk_size=8, impl=impl)
        grads[impl] = torch.autograd.grad((final * weights.to(dtype)).sum(), leaves)
    assert not grads["triton"][0].any()  # q reaches only o
    for name, got, want in zip(["dk", "dv", "dβ", "dg", "d initial state"], grads["triton"][1:], grads["chunk"][1:]):
        assert_close(got, want, 1e-5, name)


UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_keeps_its_dtype_with_fp32_accumulation(dtype):
    """bf16/fp16 inputs: o and the gradients in the input dtype, the state fp32; computed in fp32, so the error is
    that of rounding the results (and, on a GPU, the scan's TF32 products): within 4 units of the dtype's roundoff
    of the fp64 chunked form on the same rounded inputs."""
    inputs = [x.to(dtype).double() for x in make_inputs(1, 40, 2, 16, 24, (-1.0, 0.0), seed=12)]
    state = torch.randn(1, 2, 16, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    got = compare(inputs, state, dtype=dtype, tol=4 * UNIT_ROUNDOFF[dtype], seed=12, chunk_size=16)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    assert all(grad.dtype == dtype for grad in got[2:7]) and got[7].dtype == torch.float32


def test_chunk_size_is_only_the_tiling():
    """Chunks of 16, 32, of 20 (not a power of two) and longer than the sequence give one result."""
    q, k, v, beta, g = make_inputs(1, 50, 2, 16, 16, (-1.0, 0.0), seed=13)
    args = [x.float() for x in (q, k, v, beta, g)]
    outs = [delta_rule(*args, chunk_size=c, impl="triton") for c in (16, 32, 20, 64)]
    for size, other in zip((32, 20, 64), outs[1:]):
        assert_close(other, outs[0], 1e-6, f"o at chunk size {size}")


def test_pieces_with_carried_state_equal_the_whole():
    q, k, v, beta, g = (x.float() for x in make_inputs(2, 40, 2, 16, 16, (-1.0, 0.0), seed=14))
    whole, S_whole = delta_rule(q, k, v, beta, g, output_final_state=True, chunk_size=16, impl="triton")
    cut = 17
    first, S = delta_rule(q[:, :cut], k[:, :cut], v[:, :cut], beta[:, :cut], g[:, :cut], output_final_state=True,
                          chunk_size=16, impl="triton")
    second, S_end = delta_rule(q[:, cut:], k[:, cut:], v[:, cut:], beta[:, cut:], g[:, cut:], initial_state=S,
                               output_final_state=True, chunk_size=16, impl="triton")
    assert_close(torch.cat([first, second], 1), whole, 1e-6, "o in two pieces")
    assert_close(S_end, S_whole, 1e-6, "final state in two pieces")


def test_the_layout_is_read_once_per_offsets_tensor():
    """A model hands every layer the same offsets: their layout (read on the host, a wait on a GPU) is built once,
    and again after an in-place change, which the results follow."""
    q, k, v, beta, g = (x.float() for x in make_inputs(1, 30, 1, 16, 16, (-1.0, 0.0), seed=18))
    cu = torch.tensor([0, 7, 30], device=DEVICE)
    first = delta_rule(q, k, v, beta, g, cu_seqlens=cu, chunk_size=16, impl="triton")
    layout = triton_module._layouts._value
    delta_rule(q, k, v, beta, g, cu_seqlens=cu, chunk_size=16, impl="triton")
    delta_rule(q, k, v, beta, g, cu_seqlens=cu.detach(), chunk_size=16, impl="triton")  # as checkpointing hands it
    assert triton_module._layouts._value is layout
    cu[1] = 20
    moved = delta_rule(q, k, v, beta, g, cu_seqlens=cu, chunk_size=16, impl="triton")
    assert triton_module._layouts._value is not layout
    assert_close(moved, delta_rule(q, k, v, beta, g, cu_seqlens=cu, chunk_size=16, impl="chunk"), 1e-6, "o")
    assert not torch.equal(moved, first)


@pytest.mark.parametrize("gate", [False, True], ids=["deltanet", "gated_deltanet"])
def test_the_mixer_runs_it_as_is(gate):
    """The mixers pass ``impl`` through: a DeltaNet layer on packed documents gives the chunked form's output and
    gradients (input and every parameter)."""
    from pretrain.attention.deltanet import DeltaNet

    torch.manual_seed(0)
    layer = DeltaNet(32, 2, gate=gate, chunk_size=16).to(DEVICE)
    kernel_checks.assert_layer_matches_chunk(layer)


def test_refuses_what_it_cannot_run(monkeypatch):
    q, k, v, beta, g = make_inputs(1, 8, 1, 16, 16, (-1.0, 0.0), seed=15)
    with pytest.raises(ValueError, match="takes fp32, bf16 or fp16; got torch.float64"):
        delta_rule(q, k, v, beta, g, impl="triton")
    wide = torch.zeros(1, 8, 1, 272, device=DEVICE)
    with pytest.raises(ValueError, match="head dims up to 256; got k 272, v 16"):
        delta_rule(wide, wide, v.float(), beta, g, impl="triton")
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            delta_rule(q.float(), k.float(), v.float(), beta, g, impl="triton")


def test_auto_takes_ours_after_its_first_use_check(monkeypatch, fresh_verdicts):
    """On CUDA (stood in for by the interpreter) ``auto`` runs our kernel once it matched ``chunk``: the check's call,
    then every request's."""
    calls = []
    ours = delta_module.delta_rule_triton
    monkeypatch.setattr(delta_module, "_triton_may_run", lambda q, v: True)
    monkeypatch.setattr(delta_module, "delta_rule_triton", lambda *a, **kw: calls.append(1) or ours(*a, **kw))
    q, k, v, beta, g = (x.float() for x in make_inputs(1, 20, 2, 16, 16, (-1.0, 0.0), seed=16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = [delta_rule(q, k, v, beta, g, chunk_size=16) for _ in range(2)]
    assert len(calls) == 1 + 2
    torch.testing.assert_close(got[0], ours(q, k, v, beta, g, cu_seqlens=None, initial_state=None,
                                            output_final_state=False, chunk_size=16), rtol=0, atol=0)


def test_auto_keeps_to_chunk_when_ours_fails_its_check(monkeypatch, fresh_verdicts):
    monkeypatch.setattr(delta_module, "_triton_may_run", lambda q, v: True)
    ours = delta_module.delta_rule_triton

    def one_percent_off(*args, **kwargs):  # well-formed results, wrong numbers: the check compares, not crashes
        result = ours(*args, **kwargs)
        return tuple(1.01 * x for x in result) if isinstance(result, tuple) else 1.01 * result

    monkeypatch.setattr(delta_module, "delta_rule_triton", one_percent_off)
    q, k, v, beta, g = (x.float() for x in make_inputs(1, 20, 2, 16, 16, (-1.0, 0.0), seed=17))
    with pytest.warns(RuntimeWarning, match="our Triton delta-rule scan failed its first-use check .*output off by"):
        got = delta_rule(q, k, v, beta, g, chunk_size=16)
    torch.testing.assert_close(got, delta_rule(q, k, v, beta, g, chunk_size=16, impl="chunk"), rtol=0, atol=0)
