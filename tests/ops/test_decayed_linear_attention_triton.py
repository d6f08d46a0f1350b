"""The Triton kernels of decayed linear attention held to the chunked form (docs/MIXERS.md#decay): outputs, final
states and the gradients of q, k, v, the log-decay g and the initial state, within 1e-5 relative in fp32.

Without a GPU they run under Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by ``tests/conftest.py``), so the
shapes are small. The reference is ``impl="chunk"`` in fp64 (itself held to the O(T²) definition at 1e-10): in fp32
the chunked form's own dg is wrong in every digit at g ≈ −20 (its autograd leaves terms of order one to cancel, where
dg is of order e⁻²⁰), which the kernels are not.
"""
import importlib
import warnings

import pytest
import torch

pytest.importorskip("triton")

from pretrain.attention import build_mixer
from pretrain.ops.decayed_linear_attention import decayed_linear_attention
from pretrain.ops.first_use import forget_verdicts
from pretrain.ops.linear_attention import triton as kernels
from pretrain.ops.linear_attention.state import FIELDS, LinearAttentionState

dla = importlib.import_module("pretrain.ops.decayed_linear_attention")  # the module: pretrain.ops re-exports its entry
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CHUNK = 16
DOCUMENTS = [0, 1, 5, 21, 22, 45]  # one-token documents; documents inside a chunk and across its boundaries


pytestmark = pytest.mark.usefixtures("unwritten_outputs_are_nan")  # tests/ops/conftest.py


def make_inputs(batch, T, heads, dk, dv, *, per_token=True, log_decay=None, seed=0):
    """Positive q, k (as after φ), signed v, and g per token (or per head): −U(0, 1), or log_decay·U(1, 1.1) around
    a given value; fp64 leaves on CPU."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.rand(batch, T, heads, dk, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(batch, T, heads, dv, generator=gen, dtype=torch.float64)
    spread = torch.rand((batch, T, heads) if per_token else (heads,), generator=gen, dtype=torch.float64)
    g = -spread if log_decay is None else log_decay * (1 + 0.1 * spread)
    return [x.requires_grad_() for x in (q, k, v, g)]


def make_state(num, heads, dk, dv, normalize, seed=1):
    """A random initial state with the fields ``normalize`` carries (z positive, as a sum of features is)."""
    gen = torch.Generator().manual_seed(seed)
    parts = {"S": torch.randn(num, heads, dk, dv, generator=gen, dtype=torch.float64),
             "z": 3 * torch.rand(num, heads, dk, generator=gen, dtype=torch.float64)}
    return LinearAttentionState(**{f: parts[f].requires_grad_() for f in FIELDS[normalize]})


def results(impl, tensors, state, dtype, *, seed=2, **kwargs):
    """Output, final state, and the gradients of a fixed random function of both w.r.t. every input (q, k, v in
    ``dtype``, g and the state fp32; all fp64 for the reference)."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v, g = [x.detach().to(DEVICE, dtype).requires_grad_() for x in tensors[:3]] + \
        [tensors[3].detach().to(DEVICE, wide).requires_grad_()]
    fields = [] if state is None else [s.detach().to(DEVICE, wide).requires_grad_() for s in state if s is not None]
    o, final = decayed_linear_attention(q, k, v, g, impl=impl, initial_state=LinearAttentionState(*fields) if fields
                                        else None, output_final_state=True, chunk_size=CHUNK, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    outs = [o] + [f for f in final if f is not None]
    loss = sum((x * torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x)).sum() for x in outs)
    grads = torch.autograd.grad(loss, [q, k, v, g, *fields])
    names = ["o"] + [f"final {f}" for f, x in zip(LinearAttentionState._fields, final) if x is not None] + \
        ["dq", "dk", "dv", "dg"] + [f"d initial {f}" for f in LinearAttentionState._fields[:len(fields)]]
    return dict(zip(names, [x.detach() for x in outs] + list(grads), strict=True))


def assert_matches(got, want, tol):
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype or want[name].dtype == torch.float64, name
        assert torch.isfinite(got[name]).all(), f"{name}: non-finite values"
        error = ((got[name].double() - want[name]).norm() / want[name].norm()).item()
        assert error < tol, f"{name}: relative error {error:.2e} ≥ {tol:.0e}"


def compare(tensors, state, tol=1e-5, dtype=torch.float32, **kwargs):
    assert_matches(results("triton", tensors, state, dtype, **kwargs),
                   results("chunk", tensors, state, torch.float64, **kwargs), tol)


@pytest.mark.parametrize("normalize", ["none", "divisive"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "documents"])
def test_matches_chunk_fp32(normalize, packed):
    """T not a multiple of the chunk, Dk ≠ Dv (neither a power of two), per-token decay, an initial state, the final
    state, every gradient; packed: one-token documents and documents straddling chunks."""
    batch, T, cu = (1, 45, torch.tensor(DOCUMENTS, device=DEVICE)) if packed else (2, 37, None)
    tensors = make_inputs(batch, T, 2, 12, 20, seed=int(packed))
    state = make_state(batch if cu is None else cu.numel() - 1, 2, 12, 20, normalize)
    compare(tensors, state, normalize=normalize, cu_seqlens=cu)


@pytest.mark.parametrize("log_decay", [-20.0, -1e-6])
def test_gates_near_minus_20_and_near_0(log_decay):
    """g ≈ −20 (each token all but forgets the past, dg ≈ e⁻²⁰) and g ≈ −10⁻⁶, across packed documents, with the
    final state's gradient."""
    cu = torch.tensor([0, 3, 20, 21, 45], device=DEVICE)
    tensors = make_inputs(1, 45, 2, 12, 20, log_decay=log_decay, seed=3)
    compare(tensors, make_state(4, 2, 12, 20, "none"), cu_seqlens=cu)


def test_one_decay_per_head_at_head_width_64():
    """g ``[H]`` (RetNet's), D = 64 and Dv = 80: two value blocks in the forward and dv sweeps."""
    tensors = make_inputs(1, 40, 2, 64, 80, per_token=False, seed=4)
    compare(tensors, make_state(1, 2, 64, 80, "divisive"), normalize="divisive")


def test_head_width_128():
    """D = 128: two key blocks, whose parts of dg (and of the final state's term in it) add up; packed."""
    cu = torch.tensor([0, 7, 30], device=DEVICE)
    tensors = make_inputs(1, 30, 2, 128, 32, seed=5)
    compare(tensors, make_state(2, 2, 128, 32, "none"), cu_seqlens=cu)


def test_gradients_through_the_final_state_alone():
    """Only the final state is used (a sequence-parallel rank's hand-off): o's gradient is None inside the kernels'
    backward; the gradients of k, v, g and the initial state as the chunked form's, q's zero."""
    q, k, v, g = (x.detach().to(DEVICE, torch.float32).requires_grad_() for x in make_inputs(1, 40, 2, 8, 12, seed=6))
    S = make_state(1, 2, 8, 12, "none").S.detach().to(DEVICE, torch.float32).requires_grad_()
    found = []
    for impl in ("triton", "chunk"):
        _, final = decayed_linear_attention(q, k, v, g, initial_state=LinearAttentionState(S), output_final_state=True,
                                            chunk_size=CHUNK, impl=impl)
        found.append(torch.autograd.grad(final.S.square().sum(), [q, k, v, g, S], allow_unused=True))
    (dq, *got), (unused, *want) = found
    assert unused is None and not dq.any()
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# Forced segments of 2 chunks: 70 tokens in segments of 32, 32, 6; the other documents (one token, 24, 32, 5) whole
SEGMENTED_DOCUMENTS = [0, 1, 71, 72, 96, 128, 133]


@pytest.mark.parametrize("normalize,log_decay", [("divisive", None), ("none", -20.0)])
def test_segmented_forward_matches_chunk_fp32(normalize, log_decay, monkeypatch):
    """A long document cut into segments whose states combine with their decays (a sums pass of each segment's own
    state and log-decay, a running ``e^{b} S + part``, the main pass; backward the same in reverse, dg's later sums
    added per segment), the short ones whole in the same launch; the initial and final states, every gradient; at
    g ≈ −20 too."""
    monkeypatch.setattr(kernels, "SEGMENT_CHUNKS", 2)
    cu = torch.tensor(SEGMENTED_DOCUMENTS, device=DEVICE)
    tensors = make_inputs(1, SEGMENTED_DOCUMENTS[-1], 2, 12, 20, log_decay=log_decay, seed=7)
    compare(tensors, make_state(cu.numel() - 1, 2, 12, 20, normalize), normalize=normalize, cu_seqlens=cu)


def test_segmented_gradients_of_o_alone(monkeypatch):
    """Segments without the final state's gradient (dS_T None: each cut document's running sum starts from zero, no
    final-state terms in dg): dq, dk, dv, dg within 1e-5 of the chunked form's in fp64."""
    monkeypatch.setattr(kernels, "SEGMENT_CHUNKS", 2)
    cu = torch.tensor(SEGMENTED_DOCUMENTS, device=DEVICE)
    inputs = make_inputs(1, SEGMENTED_DOCUMENTS[-1], 1, 8, 12, seed=10)
    weight = torch.randn(1, SEGMENTED_DOCUMENTS[-1], 1, 12, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    found = []
    for impl, dtype in (("triton", torch.float32), ("chunk", torch.float64)):
        leaves = [x.detach().to(DEVICE, dtype).requires_grad_() for x in inputs]
        o = decayed_linear_attention(*leaves, cu_seqlens=cu, chunk_size=CHUNK, impl=impl)
        found.append(dict(zip(["dq", "dk", "dv", "dg"], torch.autograd.grad((o * weight.to(dtype)).sum(), leaves))))
    assert_matches(*found, 1e-5)


def test_segments_the_rule_chooses(monkeypatch):
    """Cut by the rule itself (its GPU shrunk to 4 SMs, segments of at least 3 chunks, as the undecayed kernels'
    test): 150 tokens in 4 segments, 70 in 2, the rest whole; rows of equal length too."""
    monkeypatch.setattr(kernels, "DEFAULT_MULTIPROCESSORS", 4)
    monkeypatch.setattr(kernels, "MIN_SEGMENT_CHUNKS", 3)
    documents = [0, 150, 151, 221, 238, 278, 279]
    cu = torch.tensor(documents, device=DEVICE)
    compare(make_inputs(1, documents[-1], 1, 12, 20, seed=8), make_state(6, 1, 12, 20, "divisive"),
            normalize="divisive", cu_seqlens=cu)
    compare(make_inputs(2, 100, 1, 12, 20, seed=9), make_state(2, 1, 12, 20, "none"))


UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.mark.parametrize("normalize,dtype", [("none", torch.bfloat16), ("divisive", torch.bfloat16),
                                             ("none", torch.float16)])
def test_half_precision_accumulates_in_fp32(normalize, dtype):
    """bf16/fp16 q, k, v (o and their gradients in that dtype), fp32 g, states and accumulators: within 4 units of
    the input dtype's roundoff u of the exact result on the same rounded inputs (measured ≤ 2.2u: divisive's dq)."""
    tensors = [x.detach().to(dtype).double() if i < 3 else x for i, x in enumerate(make_inputs(1, 50, 2, 24, 40))]
    state = make_state(1, 2, 24, 40, normalize)
    got = results("triton", tensors, state, dtype, normalize=normalize)
    assert got["o"].dtype == got["dq"].dtype == dtype and got["dg"].dtype == got["final S"].dtype == torch.float32
    assert_matches(got, results("chunk", tensors, state, torch.float64, normalize=normalize), 4 * UNIT_ROUNDOFF[dtype])


def test_refuses_fp64():
    q, k, v, g = (x.detach().to(DEVICE) for x in make_inputs(1, 5, 1, 4, 4))
    with pytest.raises(ValueError, match="impl='triton' takes fp32, bf16 or fp16; got torch.float64"):
        decayed_linear_attention(q, k, v, g, impl="triton")


def counted(kernel):
    """``kernel`` that keeps a list of its calls in ``.calls``."""
    def call(*args, **kwargs):
        call.calls.append(args[0].shape)
        return kernel(*args, **kwargs)
    call.calls = []
    return call


@pytest.fixture
def as_on_cuda(monkeypatch):
    """``auto`` as on CUDA with Triton installed (the kernels themselves run under the interpreter here)."""
    forget_verdicts()
    monkeypatch.setattr(dla, "_triton_may_run", lambda q: True)
    yield
    forget_verdicts()


@pytest.mark.skipif(DEVICE == "cuda", reason="stands in for CUDA on CPU")
def test_auto_takes_the_kernel_after_its_first_use_check(monkeypatch, as_on_cuda):
    kernel = counted(dla._RUN["triton"])
    monkeypatch.setitem(dla._RUN, "triton", kernel)
    q, k, v, g = (x.detach().float() for x in make_inputs(1, 20, 2, 8, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = decayed_linear_attention(q, k, v, g, cu_seqlens=torch.tensor([0, 9, 20]))
        decayed_linear_attention(q, k, v, g, cu_seqlens=torch.tensor([0, 9, 20]))
    assert len(kernel.calls) == 2 + 2  # checked whole and cut into segments, then both requests
    torch.testing.assert_close(got, decayed_linear_attention(q, k, v, g, cu_seqlens=torch.tensor([0, 9, 20]),
                                                             impl="chunk"), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(DEVICE == "cuda", reason="stands in for CUDA on CPU")
def test_auto_keeps_to_chunk_when_the_kernel_fails_its_check(monkeypatch, as_on_cuda):
    def wrong(q, k, v, g, **kwargs):
        return dla.decayed_linear_attention_chunk(q, k, 1.1 * v, g, **kwargs)

    monkeypatch.setitem(dla._RUN, "triton", counted(wrong))
    q, k, v, g = (x.detach().float() for x in make_inputs(1, 20, 2, 8, 8))
    with pytest.warns(RuntimeWarning, match="Triton decayed linear-attention kernel failed its first-use check"):
        got = decayed_linear_attention(q, k, v, g, normalize="divisive")
    assert len(dla._RUN["triton"].calls) == 1
    torch.testing.assert_close(got, decayed_linear_attention(q, k, v, g, normalize="divisive", impl="chunk"),
                               rtol=0, atol=0)


@pytest.mark.parametrize("name", ["retnet", "mamba2"])
def test_mixers_run_on_the_kernels_unchanged(name):
    """RetNet (a decay per head) and Mamba-2 (a gate per token) with ``impl="triton"``, packed documents: the output
    and every parameter's gradient as with ``impl="chunk"``, fp32."""
    torch.manual_seed(0)
    mixer = build_mixer(name, 32, 2, causal=True, options=dict(chunk_size=CHUNK)).to(DEVICE)
    x = torch.randn(1, 30, 32, device=DEVICE)
    cu = torch.tensor([0, 11, 30], dtype=torch.int32, device=DEVICE)
    found = []
    for impl in ("triton", "chunk"):
        mixer.impl = impl
        y = mixer(x, cu_seqlens=cu)
        found.append([y.detach(), *torch.autograd.grad(y.square().sum(), list(mixer.parameters()))])
    for got, want in zip(*found, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
