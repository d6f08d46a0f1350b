"""KDA's Triton form held to the chunked form (``kda_chunk``, run in fp64): outputs, final states and the gradients
of q, k, v, β, g and the initial state, on awkward shapes and per-channel gate regimes (docs/MIXERS.md#kda).

Without a GPU the kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by ``tests/conftest.py``);
shapes stay small because the interpreter is slow.
"""
import importlib
from functools import partial

import kernel_checks
import pytest
import torch
import torch.nn.functional as F
from kernel_checks import assert_close

pytest.importorskip("triton")

from pretrain.ops.dplr import kda_delta_rule

compare = partial(kernel_checks.compare, kda_delta_rule)

dplr_module = importlib.import_module("pretrain.ops.dplr")  # the package (ops/ exports the function by its name)
delta_triton_module = importlib.import_module("pretrain.ops.delta_rule.triton")  # its blocks of chunks
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# one-token documents, documents across the boundaries of chunks of 16 counted from the stream's start (chunk's
# layout; ours starts chunks at each document), a whole chunk
DOCUMENTS = [0, 1, 2, 5, 13, 16, 29, 45]

pytestmark = pytest.mark.usefixtures("unwritten_outputs_are_nan")  # tests/ops/conftest.py


def make_inputs(batch, length, heads, dk, dv, gates, *, seed):
    """q, L2-normalized k, v, β, g ``[B, T, H, Dk]`` from ``gates`` (low, high) or "mixed" (half the channels near
    0, half near −20): fp64."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, heads, dk, generator=gen, dtype=torch.float64)
    k = F.normalize(torch.randn(batch, length, heads, dk, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(batch, length, heads, dv, generator=gen, dtype=torch.float64)
    beta = torch.rand(batch, length, heads, generator=gen, dtype=torch.float64)
    u = torch.rand(batch, length, heads, dk, generator=gen, dtype=torch.float64)
    if gates == "mixed":
        g = torch.cat([-1e-3 * u[..., :dk // 2], -19 - u[..., dk // 2:]], -1)
    else:
        g = gates[0] + (gates[1] - gates[0]) * u
    return [x.to(DEVICE) for x in (q, k, v, beta, g)]


# (batch, T, heads, Dk, Dv, cu_seqlens, gates, chunk size)
CASES = {
    "ragged_tail_dk_ne_dv": (2, 21, 1, 16, 24, None, (-1.0, 0.0), 16),
    "documents_gates_near_minus_20": (1, 45, 1, 16, 16, DOCUMENTS, (-20.0, -19.0), 16),
    "gates_near_0_dk_24": (1, 21, 2, 24, 16, None, (-1e-3, 0.0), 16),  # Dk not a power of two: masked channels
    # a chunk of 40: three sub-chunks, the last one short (rows padded to 64), pairs across them factored through
    # the earlier one's last token with half the channels' gates near −20
    "chunk_40_mixed_gates": (1, 50, 1, 32, 16, [0, 1, 50], "mixed", 40),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_chunk_fp32(case):
    """Every output, state and gradient within 1e-5 relative of the chunked form in fp64, from a random initial
    state."""
    batch, length, heads, dk, dv, cu, gates, chunk = CASES[case]
    seed = list(CASES).index(case)
    inputs = make_inputs(batch, length, heads, dk, dv, gates, seed=seed)
    kernel_checks.compare_from_random_state(kda_delta_rule, inputs, cu, chunk, seed=seed)


def test_gradients_through_the_final_state_alone_from_zero_state():
    """A loss of the final states only (backward gets None for o) and no initial state: every input's gradient
    still matches, packed documents included."""
    inputs = make_inputs(1, 30, 1, 16, 16, (-1.0, 0.0), seed=19)
    cu = torch.tensor([0, 11, 30], device=DEVICE)
    weights = torch.randn(2, 1, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(20)).to(DEVICE)
    grads = {}
    for impl, dtype in (("triton", torch.float32), ("chunk", torch.float64)):
        leaves = [x.detach().to(dtype).requires_grad_() for x in inputs]
        _, final = kda_delta_rule(*leaves, cu_seqlens=cu, output_final_state=True, chunk_size=16, impl=impl)
        grads[impl] = torch.autograd.grad((final * weights.to(dtype)).sum(), leaves)
    assert not grads["triton"][0].any()  # q reaches only o
    for name, got, want in zip(["dk", "dv", "dβ", "dg"], grads["triton"][1:], grads["chunk"][1:]):
        assert_close(got, want, 1e-5, name)


def test_blocks_of_chunks_hand_on_the_running_document(monkeypatch):
    """Blocks of three chunks of 8 (shorter than a sub-chunk), each recomputed on its own in backward: documents run
    across blocks, several end inside one, and the states and gradients still match."""
    monkeypatch.setattr(delta_triton_module, "BLOCK_ELEMENTS", 3 * 8 * 16)  # chunks × heads × C × max(C, D)
    cu = [0, 1, 20, 23, 40]  # chunks of 8 from each document's start: 1, 3, 1 and 3
    inputs = make_inputs(1, 40, 1, 16, 16, (-1.0, 0.0), seed=20)
    state = torch.randn(len(cu) - 1, 1, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(20))
    compare(inputs, state.to(DEVICE), dtype=torch.float32, tol=1e-5, seed=20,
            cu_seqlens=torch.tensor(cu, device=DEVICE), chunk_size=8)


UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_keeps_its_dtype_with_fp32_accumulation(dtype):
    """bf16/fp16 inputs: o and the gradients in the input dtype, the state fp32; computed in fp32, so the error is
    that of rounding the results: within 4 units of the dtype's roundoff of the fp64 chunked form on the same
    rounded inputs."""
    inputs = [x.to(dtype).double() for x in make_inputs(1, 40, 1, 16, 24, "mixed", seed=12)]
    state = torch.randn(1, 1, 16, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    got = compare(inputs, state, dtype=dtype, tol=4 * UNIT_ROUNDOFF[dtype], seed=12, chunk_size=16)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    assert all(grad.dtype == dtype for grad in got[2:7]) and got[7].dtype == torch.float32


def test_the_mixer_runs_it_as_is():
    """The KDA mixer passes ``impl`` through: on packed documents it gives the chunked form's output and gradients
    (input and every parameter)."""
    from pretrain.attention.kda import KimiDeltaAttention

    torch.manual_seed(0)
    layer = KimiDeltaAttention(32, 2, chunk_size=16).to(DEVICE)
    kernel_checks.assert_layer_matches_chunk(layer)


def test_refuses_what_it_cannot_run(monkeypatch):
    q, k, v, beta, g = make_inputs(1, 8, 1, 16, 16, (-1.0, 0.0), seed=15)
    with pytest.raises(ValueError, match="takes fp32, bf16 or fp16; got torch.float64"):
        kda_delta_rule(q, k, v, beta, g, impl="triton")
    wide = torch.zeros(1, 8, 1, 272, device=DEVICE)
    with pytest.raises(ValueError, match=r"kda_delta_rule\(impl='triton'\) supports head dims up to 256; got k 272"):
        kda_delta_rule(wide, wide, v.float(), beta.float(), wide, impl="triton")
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            kda_delta_rule(*(x.float() for x in (q, k, v, beta, g)), impl="triton")


def test_auto_takes_ours_after_its_first_use_check(monkeypatch, fresh_verdicts):
    """On CUDA (stood in for by the interpreter) ``auto`` runs our kernels once they matched ``chunk``: the check's
    call, then every request's; on CPU ``auto`` is ``chunk``. (One head: the check runs as many as the request, up
    to two.)"""
    inputs = [x.float() for x in make_inputs(1, 20, 1, 16, 16, (-1.0, 0.0), seed=16)]
    kernel_checks.assert_auto_takes_ours_after_its_check(monkeypatch, dplr_module, "kda_triton", kda_delta_rule,
                                                         inputs)


def test_auto_keeps_to_chunk_when_ours_fails_its_check(monkeypatch, fresh_verdicts):
    """A kernel that raises on this device (as one the compiler refuses would) fails its check: ``auto`` warns once
    and runs ``chunk``."""
    def broken(*args, **kwargs):
        raise RuntimeError("stands in for a kernel this device cannot run")

    monkeypatch.setattr(dplr_module, "_triton_may_run", lambda q, v: True)
    monkeypatch.setattr(dplr_module, "kda_triton", broken)
    q, k, v, beta, g = (x.float() for x in make_inputs(1, 20, 2, 16, 16, (-1.0, 0.0), seed=17))
    with pytest.warns(RuntimeWarning, match="our Triton KDA form failed its first-use check .*RuntimeError: stands in"):
        got = kda_delta_rule(q, k, v, beta, g, chunk_size=16)
    torch.testing.assert_close(got, kda_delta_rule(q, k, v, beta, g, chunk_size=16, impl="chunk"), rtol=0, atol=0)
