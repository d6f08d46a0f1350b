"""The general diagonal-plus-low-rank rule's Triton form (arbitrary a, b; RWKV-7's case) held to the chunked form
(``dplr_chunk``, run in fp64): outputs, final states and the gradients of q, k, v, a, b, g and the initial state, on
awkward shapes and per-channel gate regimes (docs/MIXERS.md#dplr).

Without a GPU the kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by ``tests/conftest.py``);
shapes stay small because the interpreter is slow.
"""
import importlib
from functools import partial

import kernel_checks
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from pretrain.ops.dplr import dplr_delta_rule

dplr_module = importlib.import_module("pretrain.ops.dplr")  # the package (ops/ exports the function by its name)
NAMES = ("q", "k", "v", "a", "b", "g")
compare = partial(kernel_checks.compare, dplr_delta_rule, names=NAMES)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# one-token documents, documents across the boundaries of chunks of 16 counted from the stream's start, a whole chunk
DOCUMENTS = [0, 1, 2, 5, 13, 16, 29, 45]

pytestmark = pytest.mark.usefixtures("unwritten_outputs_are_nan")  # tests/ops/conftest.py


def make_inputs(batch, length, heads, dk, dv, gates, transition, *, seed):
    """q, L2-normalized k, v, a, b, g ``[B, T, H, Dk]`` (fp64) from ``gates`` (low, high) or "mixed" (half the
    channels near 0, half near −20). ``transition``: "general" (a and b of unrelated directions, |a| ≤ 1/2) or
    "rwkv7" (the mixer's: a = −η ⊙ κ̂, b = κ̂, η in (0, 1) per channel)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(width):
        return torch.randn(batch, length, heads, width, generator=gen, dtype=torch.float64)

    def rand(width):
        return torch.rand(batch, length, heads, width, generator=gen, dtype=torch.float64)

    q, k, v, kappa = randn(dk), F.normalize(randn(dk), dim=-1), randn(dv), F.normalize(randn(dk), dim=-1)
    if transition == "rwkv7":
        a, b = -rand(dk) * kappa, kappa
    else:
        a, b = 0.5 * rand(1) * F.normalize(randn(dk), dim=-1), kappa
    u = rand(dk)
    if gates == "mixed":
        g = torch.cat([-1e-3 * u[..., :dk // 2], -19 - u[..., dk // 2:]], -1)
    else:
        g = gates[0] + (gates[1] - gates[0]) * u
    return [x.to(DEVICE) for x in (q, k, v, a, b, g)]


# (batch, T, heads, Dk, Dv, cu_seqlens, gates, transition, chunk size)
CASES = {
    "ragged_tail_dk_ne_dv": (2, 21, 1, 16, 24, None, (-1.0, 0.0), "general", 16),
    "documents_gates_near_minus_20": (1, 45, 1, 16, 16, DOCUMENTS, (-20.0, -19.0), "general", 16),
    "rwkv7_gates_near_0_dk_24": (1, 21, 2, 24, 16, None, (-1e-3, 0.0), "rwkv7", 16),  # Dk not a power of two
    # a chunk of 40: three sub-chunks, the last one short, pairs across them factored through the earlier one's last
    # token (b's rows a row down: its first row pairs with the earlier one's last, undecayed) with mixed gates
    "rwkv7_chunk_40_mixed_gates": (1, 50, 1, 32, 16, [0, 1, 50], "mixed", "rwkv7", 40),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_chunk_fp32(case):
    """Every output, state and gradient within 1e-5 relative of the chunked form in fp64, from a random initial
    state."""
    batch, length, heads, dk, dv, cu, gates, transition, chunk = CASES[case]
    seed = list(CASES).index(case)
    inputs = make_inputs(batch, length, heads, dk, dv, gates, transition, seed=seed)
    kernel_checks.compare_from_random_state(dplr_delta_rule, inputs, cu, chunk, seed=seed, names=NAMES)


def test_bf16_keeps_its_dtype_with_fp32_accumulation():
    """bf16 inputs: o and the gradients in bf16, the state fp32; computed in fp32, so within 4 units of bf16's
    roundoff of the fp64 chunked form on the same rounded inputs."""
    inputs = [x.to(torch.bfloat16).double() for x in make_inputs(1, 40, 1, 16, 24, "mixed", "rwkv7", seed=12)]
    state = torch.randn(1, 1, 16, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    got = compare(inputs, state, dtype=torch.bfloat16, tol=4 * 2.0**-8, seed=12, chunk_size=16)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    assert all(grad.dtype == torch.bfloat16 for grad in got[2:8]) and got[8].dtype == torch.float32


def test_the_rwkv7_mixer_runs_it_as_is():
    """The RWKV-7 mixer passes ``impl`` through: on packed documents it gives the chunked form's output and gradients
    (input and every parameter; those that start at zero, as the low-rank maps' second factors, made random so that
    the ones before them get a gradient)."""
    from pretrain.attention.rwkv7 import RWKV7

    torch.manual_seed(0)
    layer = RWKV7(32, 2, chunk_size=16).to(DEVICE)
    with torch.no_grad():
        for parameter in layer.parameters():
            if not parameter.any():
                parameter.normal_(std=0.1)
    kernel_checks.assert_layer_matches_chunk(layer)


def test_refuses_what_it_cannot_run():
    q, k, v, a, b, g = make_inputs(1, 8, 1, 16, 16, (-1.0, 0.0), "general", seed=15)
    with pytest.raises(ValueError, match="takes fp32, bf16 or fp16; got torch.float64"):
        dplr_delta_rule(q, k, v, a, b, g, impl="triton")
    wide = torch.zeros(1, 8, 1, 272, device=DEVICE)
    with pytest.raises(ValueError, match=r"dplr_delta_rule\(impl='triton'\) supports head dims up to 256; got k 272"):
        dplr_delta_rule(wide, wide, v.float(), wide, wide, wide, impl="triton")


def test_auto_takes_ours_after_its_first_use_check(monkeypatch, fresh_verdicts):
    """On CUDA (stood in for by the interpreter) ``auto`` runs our kernels once they matched ``chunk``: the check's
    call, then every request's; on CPU ``auto`` is ``chunk``. (One head: the check runs as many as the request, up
    to two; the way a failed check keeps to ``chunk`` is KDA's and the delta rule's to test.)"""
    inputs = [x.float() for x in make_inputs(1, 20, 1, 16, 16, (-1.0, 0.0), "rwkv7", seed=16)]
    kernel_checks.assert_auto_takes_ours_after_its_check(monkeypatch, dplr_module, "dplr_triton", dplr_delta_rule,
                                                         inputs)
