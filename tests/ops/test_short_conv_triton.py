"""The short convolution's Triton form held to the tap loop computed in fp64, the output and every gradient (x, the
weight, the bias, ``before``), and ``auto``'s choice of it (docs/MIXERS.md#short-convolution).

Without a GPU the kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by ``tests/conftest.py``).
The blocks shrink to 8 tokens × 16 channels, so rows of 19 tokens and 19 channels span three token blocks and two
channel blocks, the last ones partial; packed rows hold a one-token document (one at a block's first token) and
documents across block boundaries.
"""
import importlib
import warnings
from unittest.mock import Mock

import pytest
import torch

pytest.importorskip("triton")

from pretrain.ops.short_conv import short_conv, short_conv_naive
from pretrain.ops.short_conv import triton as kernels

sc = importlib.import_module("pretrain.ops.short_conv")  # the module, not the function it is named after

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BATCH, LENGTH, CHANNELS = 2, 19, 19
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}

pytestmark = pytest.mark.usefixtures("unwritten_outputs_are_nan")  # tests/ops/conftest.py


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setitem(kernels.CONFIG, "token_block", 8)
    monkeypatch.setitem(kernels.CONFIG, "channel_block", 16)


def packed_positions(first_began):
    """Row 0: a document begun ``first_began`` tokens before the row (7 tokens here), a one-token document, one of
    11 across the block boundary at 16; row 1: 8 tokens, a one-token document at the block start 8, then 10."""
    lengths = [[7, 1, 11], [8, 1, 10]]
    return torch.stack([torch.cat([torch.arange(n) + (first_began if d == 0 else 0) for d, n in enumerate(row)])
                        for row in lengths]).to(DEVICE)


def make_inputs(K, bias, before, *, seed):
    """x, weight, bias (or None), before (or None) in fp64, and the upstream gradient."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(BATCH, LENGTH, CHANNELS), (CHANNELS, K), (CHANNELS,) if bias else None,
              (BATCH, K - 1, CHANNELS) if before else None, (BATCH, LENGTH, CHANNELS)]
    return [None if s is None else torch.randn(s, generator=gen, dtype=torch.float64).to(DEVICE) for s in shapes]


def results(impl, tensors, dtypes, positions, activation):
    """The output and the gradients of x, weight, bias, before (None where absent) from ``tensors`` (x, weight,
    bias, before, upstream) cast to ``dtypes``; a gradient autograd leaves out (before's, at K = 1) as zeros."""
    *inputs, upstream = tensors
    leaves = [None if t is None else t.to(dt).requires_grad_() for t, dt in zip(inputs, dtypes)]
    x, weight, bias, before = leaves
    y = short_conv(x, weight, bias, positions=positions, before=before, activation=activation, impl=impl)
    given = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(y, given, upstream.to(y.dtype), allow_unused=True))
    return [y] + [None if t is None else _or_zeros(next(grads), t) for t in leaves]


def _or_zeros(grad, leaf):
    return torch.zeros_like(leaf) if grad is None else grad


def assert_matches(got, want, tol):
    for name, a, b in zip(["y", "dx", "dweight", "dbias", "dbefore"], got, want):
        assert (a is None) == (b is None), name
        if a is None or b.numel() == 0:
            continue
        assert torch.isfinite(a).all(), f"{name}: non-finite values"
        error = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert error < tol, f"{name}: relative error {error:.2e} ≥ {tol:.0e}"


CASES = [  # K, activation, bias, positions, before: every option on and off, each K
    (4, "silu", False, True, True),  # Gated DeltaNet's q, k, v on a sequence slice
    (4, "silu", True, True, False),  # Mamba-2's
    (4, None, False, False, True),  # InLine's local branch while decoding
    (4, None, True, True, True),
    (4, "silu", False, False, False),
    (2, "silu", True, False, True),
    (2, None, False, True, True),
    (1, "silu", True, True, True),  # before is [B, 0, C]
    (1, None, False, False, False),
]


@pytest.mark.parametrize("K,activation,bias,packed,before", CASES)
def test_matches_the_loop_in_fp32(K, activation, bias, packed, before):
    """Within 1e-5 relative of the loop in fp64 (measured ≤ 2e-7)."""
    tensors = make_inputs(K, bias, before, seed=K + 2 * bias + 4 * packed)
    positions = packed_positions(2 if before else 0) if packed else None
    got = results("triton", tensors, [torch.float32] * 4, positions, activation)
    assert_matches(got, results("naive", tensors, [torch.float64] * 4, positions, activation), 1e-5)


@pytest.mark.parametrize("dtype,weight_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
def test_half_precision_rounds_once(dtype, weight_dtype):
    """bf16/fp16 inputs, fp32 sums: each result is the exact one (the loop in fp64 on the same rounded inputs)
    rounded once, so within a roundoff u of its dtype (asserted 2u). Results take the loop's dtypes: y x's
    promoted with the weight's, every gradient its input's."""
    tensors = make_inputs(4, True, True, seed=11)
    dtypes = [dtype, weight_dtype, weight_dtype, dtype]
    rounded = [t.to(dt).double() for t, dt in zip(tensors, dtypes + [dtype])]
    positions = packed_positions(2)
    got = results("triton", rounded, dtypes, positions, "silu")
    loop = results("naive", rounded, dtypes, positions, "silu")
    assert [t.dtype for t in got] == [t.dtype for t in loop]
    assert_matches(got, results("naive", rounded, [torch.float64] * 4, positions, "silu"), 2 * UNIT_ROUNDOFF[dtype])


def test_reads_strided_inputs():
    """x with channels not adjacent, positions and ``before`` sliced from larger buffers (a sequence-parallel halo
    is one rank's row of the gathered ones), and an expanded upstream gradient: read in place, as the loop reads
    them."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(BATCH, CHANNELS, LENGTH, generator=gen).to(DEVICE).transpose(1, 2)
    weight = torch.randn(CHANNELS, 3, generator=gen).to(DEVICE)
    gathered = torch.randn(BATCH, 4, 2, CHANNELS, generator=gen).to(DEVICE)
    positions = torch.cat([packed_positions(2), packed_positions(0)], dim=1)[:, :LENGTH]
    found = []
    for impl in ("triton", "naive"):
        leaves = [t.detach().clone().requires_grad_() for t in (x, weight, gathered)]
        y = short_conv(leaves[0], leaves[1], positions=positions, before=leaves[2][:, 1], impl=impl)
        found.append([y, *torch.autograd.grad(y.sum(), leaves)])
    for got, want in zip(*found):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_refuses_fp64():
    x = torch.zeros(1, 3, 4, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match="impl='triton' takes fp32, bf16 or fp16; got torch.float64"):
        short_conv(x, torch.zeros(4, 2, dtype=torch.float64, device=DEVICE), impl="triton")


@pytest.fixture
def as_on_cuda(monkeypatch, fresh_verdicts):
    """``auto`` as on CUDA with Triton installed (the kernels themselves run under the interpreter here)."""
    monkeypatch.setattr(sc, "_triton_may_run", lambda x: True)


def watched(monkeypatch, kernel):
    """``kernel`` in the Triton form's place, its calls counted."""
    spy = Mock(wraps=kernel)
    monkeypatch.setattr(sc, "short_conv_triton", spy)
    return spy


def small_request():
    x, weight, bias, before, _ = (t.float() for t in make_inputs(4, True, True, seed=3))
    return (x, weight, bias), dict(positions=packed_positions(2), before=before)


@pytest.mark.skipif(DEVICE == "cuda", reason="stands in for CUDA on CPU")
def test_auto_takes_the_kernel_after_its_first_use_check(monkeypatch, as_on_cuda):
    kernel = watched(monkeypatch, sc.short_conv_triton)
    args, kwargs = small_request()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = short_conv(*args, **kwargs)
        short_conv(*args, **kwargs)
    assert kernel.call_count == 1 + 2  # its check, then both requests
    torch.testing.assert_close(got, short_conv(*args, **kwargs, impl="naive"), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(DEVICE == "cuda", reason="stands in for CUDA on CPU")
def test_auto_keeps_to_the_loop_when_the_kernel_fails_its_check(monkeypatch, as_on_cuda):
    def wrong(x, weight, bias=None, **kwargs):  # a kernel that drops the bias
        return short_conv_naive(x, weight, None, **kwargs)

    kernel = watched(monkeypatch, wrong)
    args, kwargs = small_request()
    with pytest.warns(RuntimeWarning, match="the Triton short convolution failed its first-use check"):
        got = short_conv(*args, **kwargs)
    assert kernel.call_count == 1
    torch.testing.assert_close(got, short_conv(*args, **kwargs, impl="naive"), rtol=0, atol=0)


@pytest.mark.skipif(DEVICE == "cuda", reason="stands in for CUDA on CPU")
def test_auto_keeps_to_the_loop_under_compile(monkeypatch, as_on_cuda):
    """Inductor fuses the loop itself, and the Triton form is no custom op it could keep opaque."""
    kernel = watched(monkeypatch, sc.short_conv_triton)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    args, kwargs = small_request()
    short_conv(*args, **kwargs)
    assert kernel.call_count == 0
