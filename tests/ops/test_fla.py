"""``impl="fla"``: flash-linear-attention as the CUDA backend of decayed linear attention and the delta rule, tested
on CPU up to the call.

fla's kernels need a GPU, so a stand-in ``fla`` package is installed in ``sys.modules``: its functions take fla's
arguments with fla's meaning (q scaled by ``K^-1/2`` unless ``scale`` is given, int64 offsets, batch 1 with them,
``chunk_delta_rule`` refusing fp32, ...) and compute them with our naive references. So a mapping mistake in the
adapters (a forgotten scale, a state in the wrong layout, a gate sign) makes ``impl="fla"`` differ from
``impl="chunk"``, checked in fp64 at 1e-10, outputs, final states and every gradient. Then: what ``auto`` takes, the
refusals, and (``-m gpu``, with CUDA and fla installed) the real kernels against our chunked form.
"""
import importlib
import importlib.machinery
import sys
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

from pretrain.ops import flash_linear
from pretrain.ops.decayed_linear_attention import decayed_linear_attention
from pretrain.ops.decayed_linear_attention.naive import decayed_linear_attention_naive
from pretrain.ops.delta_rule import delta_rule
from pretrain.ops.delta_rule.naive import delta_rule_naive
from pretrain.ops.linear_attention.state import LinearAttentionState

pytestmark = pytest.mark.usefixtures("fresh_verdicts")  # tests/ops/conftest.py: no verdict carried between tests
TOL = {"rtol": 1e-10, "atol": 1e-10}
CHUNK = 8
DOCUMENTS = [0, 1, 2, 5, 13, 16, 29, 44, 45]  # one-token documents, documents inside and across chunks


class StandIn:
    """fla's three entry points, computed by our naive references in fla's calling convention; counts calls."""

    def __init__(self, wrong=1.0):
        self.calls = {"chunk_simple_gla": 0, "chunk_gated_delta_rule": 0, "chunk_delta_rule": 0}
        self.wrong = wrong  # an output factor: 1.0 is a correct stand-in

    @staticmethod
    def _offsets(q, cu_seqlens, initial_state):
        if cu_seqlens is None:
            return q.shape[0]
        if cu_seqlens.dtype != torch.long or cu_seqlens.device != q.device:
            raise TypeError(f"fla wants int64 cu_seqlens on q's device; got {cu_seqlens.dtype} on {cu_seqlens.device}")
        if q.shape[0] != 1:
            raise ValueError("The batch size is expected to be 1 when using `cu_seqlens`")
        if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
            raise ValueError("The number of initial states is expected to be equal to the number of sequences")
        return len(cu_seqlens) - 1

    def chunk_simple_gla(self, q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                         output_final_state=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                         **kwargs):
        self.calls["chunk_simple_gla"] += 1
        self._offsets(q, cu_seqlens, initial_state)
        scale = k.shape[-1] ** -0.5 if scale is None else scale
        g = g_gamma.expand(q.shape[:3]) if g is None else g
        if state_v_first and initial_state is not None:
            initial_state = initial_state.transpose(-1, -2)
        o, final = decayed_linear_attention_naive(
            q * scale, k, v, g, normalize="none", eps=0.0, cu_seqlens=cu_seqlens,
            initial_state=None if initial_state is None else LinearAttentionState(initial_state),
            output_final_state=True)
        final = final.S.transpose(-1, -2) if state_v_first else final.S
        return (o * self.wrong).to(q.dtype), final.float() if q.dtype != torch.float64 else final

    def chunk_gated_delta_rule(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                               allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                               **kwargs):
        self.calls["chunk_gated_delta_rule"] += 1
        return self._delta(q, k, v, beta, g, scale, initial_state, use_qk_l2norm_in_kernel,
                           use_beta_sigmoid_in_kernel, state_v_first, cu_seqlens)

    def chunk_delta_rule(self, q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
                         use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
        self.calls["chunk_delta_rule"] += 1
        assert q.dtype != torch.float32, "ChunkDeltaRuleFunction does not support float32. Please use bfloat16."
        return self._delta(q, k, v, beta, beta.new_zeros(beta.shape), scale, initial_state,
                           use_qk_l2norm_in_kernel, False, False, cu_seqlens)

    def _delta(self, q, k, v, beta, g, scale, initial_state, l2norm, beta_sigmoid, state_v_first, cu_seqlens):
        self._offsets(q, cu_seqlens, initial_state)
        scale = k.shape[-1] ** -0.5 if scale is None else scale
        if l2norm:
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        beta = beta.sigmoid() if beta_sigmoid else beta
        if state_v_first and initial_state is not None:
            initial_state = initial_state.transpose(-1, -2)
        o, final = delta_rule_naive(q * scale, k, v, beta, g, cu_seqlens=cu_seqlens, initial_state=initial_state,
                                    output_final_state=True)
        final = final.transpose(-1, -2) if state_v_first else final
        return (o * self.wrong).to(q.dtype), final.float() if q.dtype != torch.float64 else final


def install(monkeypatch, stand_in):
    """Put ``stand_in``'s functions where fla keeps them, and let fla's device check pass on CPU."""
    homes = {"fla.ops.simple_gla": ["chunk_simple_gla"], "fla.ops.gated_delta_rule": ["chunk_gated_delta_rule"],
             "fla.ops.delta_rule": ["chunk_delta_rule"]}
    for name in ("fla", "fla.ops", *homes):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        for function in homes.get(name, []):
            setattr(module, function, getattr(stand_in, function))
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(flash_linear, "on_cuda", lambda x: True)
    return stand_in


def leaves(*tensors):
    return [None if x is None else x.detach().clone().requires_grad_() for x in tensors]


def outputs_and_grads(fn, tensors, seed=3):
    """fn's output and final state, and the gradients of a fixed random function of both w.r.t. ``tensors``."""
    o, final = fn(*tensors)
    gen = torch.Generator().manual_seed(seed)
    loss = sum((x * torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x)).sum() for x in (o, final))
    given = [x for x in tensors if x is not None]
    return [o.detach(), final.detach(), *torch.autograd.grad(loss, given)]


def decay_inputs(batch, T, per_token, num, dtype=torch.float64, heads=2, dk=3, dv=5):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.rand(batch, T, heads, dk, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(batch, T, heads, dv, generator=gen, dtype=torch.float64)
    g = -torch.rand((batch, T, heads) if per_token else (heads,), generator=gen, dtype=torch.float64)
    S = torch.randn(num, heads, dk, dv, generator=gen, dtype=torch.float64)
    return [x.to(dtype) for x in (q, k, v, g)] + [S]


def decayed(impl, cu=None):
    def run(q, k, v, g, S):
        o, final = decayed_linear_attention(q, k, v, g, cu_seqlens=cu, chunk_size=CHUNK, impl=impl,
                                            initial_state=None if S is None else LinearAttentionState(S),
                                            output_final_state=True)
        return o, final.S
    return run


@pytest.mark.parametrize("with_state", [True, False], ids=["state", "zeros"])
@pytest.mark.parametrize("per_token", [True, False], ids=["per_token", "per_head"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "documents"])
def test_decayed_fla_equals_chunk(monkeypatch, packed, per_token, with_state):
    fla = install(monkeypatch, StandIn())
    cu = torch.tensor(DOCUMENTS, dtype=torch.int32) if packed else None  # flash-attn's int32; fla wants int64
    batch, T = (1, 45) if packed else (2, 37)
    *xs, S = leaves(*decay_inputs(batch, T, per_token, len(DOCUMENTS) - 1 if packed else batch))
    tensors = [*xs, S if with_state else None]
    want = outputs_and_grads(decayed("chunk", cu), tensors)
    got = outputs_and_grads(decayed("fla", cu), tensors)
    assert fla.calls["chunk_simple_gla"] == 1
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def delta_inputs(batch, T, num, dtype=torch.float64, heads=2, dk=3, dv=5):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(batch, T, heads, dk, generator=gen, dtype=torch.float64)
    k = F.normalize(torch.randn(batch, T, heads, dk, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(batch, T, heads, dv, generator=gen, dtype=torch.float64)
    beta = torch.rand(batch, T, heads, generator=gen, dtype=torch.float64)
    g = -torch.rand(batch, T, heads, generator=gen, dtype=torch.float64)
    S = torch.randn(num, heads, dk, dv, generator=gen, dtype=torch.float64)
    return [x.to(dtype) for x in (q, k, v, beta, g)] + [S]


def delta(impl, cu=None, gated=True):
    def run(q, k, v, beta, g, S):
        return delta_rule(q, k, v, beta, g if gated else None, cu_seqlens=cu, initial_state=S,
                          output_final_state=True, chunk_size=CHUNK, impl=impl)
    return run


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "deltanet"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "documents"])
def test_delta_rule_fla_equals_chunk(monkeypatch, packed, gated):
    fla = install(monkeypatch, StandIn())
    cu = torch.tensor(DOCUMENTS) if packed else None
    batch, T = (1, 45) if packed else (2, 37)
    q, k, v, beta, g, S = leaves(*delta_inputs(batch, T, len(DOCUMENTS) - 1 if packed else batch))
    tensors = [q, k, v, beta, g if gated else None, S]
    want = outputs_and_grads(delta("chunk", cu, gated), tensors)
    got = outputs_and_grads(delta("fla", cu, gated), tensors)
    assert fla.calls["chunk_gated_delta_rule" if gated else "chunk_delta_rule"] == 1
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_ungated_fp32_takes_the_gated_kernel(monkeypatch):
    """fla's ``chunk_delta_rule`` refuses fp32: an fp32 DeltaNet request goes to the gated kernel with g = 0."""
    fla = install(monkeypatch, StandIn())
    q, k, v, beta, _, S = delta_inputs(2, 37, 2, dtype=torch.float32)
    want = delta("chunk", gated=False)(q, k, v, beta, None, S.float())
    got = delta("fla", gated=False)(q, k, v, beta, None, S.float())
    assert fla.calls == {"chunk_simple_gla": 0, "chunk_gated_delta_rule": 1, "chunk_delta_rule": 0}
    assert got[1].dtype == torch.float32
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def fp32_requests(packed=False):
    """One decayed and one delta-rule request in fp32 (a dtype fla takes), run by ``impl``."""
    cu = torch.tensor([0, 20, 45]) if packed else None
    batch = 1 if packed else 2
    dq, dk, dv, dg, dS = decay_inputs(batch, 45, True, 2, dtype=torch.float32)
    rq, rk, rv, rb, rg, rS = delta_inputs(batch, 45, 2, dtype=torch.float32)
    return {"decayed": lambda impl: decayed(impl, cu)(dq, dk, dv, dg, dS.float()),
            "delta": lambda impl: delta(impl, cu)(rq, rk, rv, rb, rg, rS.float())}


KERNEL = {"decayed": "chunk_simple_gla", "delta": "chunk_gated_delta_rule"}


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "documents"])
@pytest.mark.parametrize("op", ["decayed", "delta"])
def test_auto_takes_fla_on_cuda_after_its_check(monkeypatch, op, packed):
    fla = install(monkeypatch, StandIn())
    request = fp32_requests(packed)[op]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = request("auto")
        request("auto")
    assert fla.calls[KERNEL[op]] == 1 + 2  # the first-use check once, then both requests
    for a, b in zip(got, request("chunk")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["decayed", "delta"])
def test_a_wrong_fla_warns_once_and_auto_keeps_to_chunk(monkeypatch, op):
    fla = install(monkeypatch, StandIn(wrong=1.1))
    request = fp32_requests()[op]
    with pytest.warns(RuntimeWarning, match=f"flash-linear-attention's {KERNEL[op]} failed its first-use check"):
        got = request("auto")
    request("auto")
    assert fla.calls[KERNEL[op]] == 1  # the check's call only
    for a, b in zip(got, request("chunk")):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def assert_auto_is_chunk(request, fla):
    """``request(impl)`` under ``auto`` is the chunked form's result exactly, and fla is never called."""
    for a, b in zip(request("auto"), request("chunk")):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert sum(fla.calls.values()) == 0


def test_auto_leaves_fla_alone_where_it_cannot_run(monkeypatch):
    fla = install(monkeypatch, StandIn())
    # a normalizer fla has not
    q, k, v, g, S = decay_inputs(2, 20, True, 2, dtype=torch.float32)
    state = LinearAttentionState(S.float(), torch.rand(2, 2, 3))
    assert_auto_is_chunk(lambda impl: decayed_linear_attention(q, k, v, g, normalize="divisive", impl=impl,
                                                               initial_state=state, output_final_state=True), fla)
    # fp64, which fla's kernels are not written for
    d, r = decay_inputs(2, 20, True, 2), delta_inputs(2, 20, 2)
    assert_auto_is_chunk(lambda impl: decayed(impl)(*d), fla)
    assert_auto_is_chunk(lambda impl: delta(impl)(*r), fla)
    # a CPU tensor
    monkeypatch.setattr(flash_linear, "on_cuda", lambda x: x.is_cuda)
    for request in fp32_requests().values():
        assert_auto_is_chunk(request, fla)


@pytest.mark.parametrize("ours", ["trusted", "raises"])
def test_auto_takes_our_kernel_first_and_fla_where_ours_fails(monkeypatch, ours):
    """As on CUDA with both installed: ours once it passed its check; fla only where ours failed it."""
    fla = install(monkeypatch, StandIn())
    decayed_module = importlib.import_module("pretrain.ops.decayed_linear_attention")

    def kernel(*args, **kwargs):
        if ours == "raises":
            raise RuntimeError("no kernel image is available for execution on the device")
        return decayed_module.decayed_linear_attention_chunk(*args, **kwargs)

    monkeypatch.setattr(decayed_module, "_triton_may_run", lambda q: True)
    monkeypatch.setitem(decayed_module._RUN, "triton", kernel)
    request = fp32_requests()["decayed"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = request("auto")
    assert fla.calls["chunk_simple_gla"] == (0 if ours == "trusted" else 1 + 1)  # fla's own check, then the request
    assert [str(w.message).split(" failed")[0] for w in caught] == \
        ([] if ours == "trusted" else ["the Triton decayed linear-attention kernel"])
    for a, b in zip(got, request("chunk")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_auto_without_fla_installed_is_chunk(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # as if not installed: import fails, find_spec finds nothing
    monkeypatch.setattr(flash_linear, "on_cuda", lambda x: True)
    for request in fp32_requests().values():
        for a, b in zip(request("auto"), request("chunk")):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("op", ["decayed", "delta"])
def test_fla_without_the_package_is_refused(monkeypatch, op):
    monkeypatch.setitem(sys.modules, "fla", None)
    monkeypatch.setattr(flash_linear, "on_cuda", lambda x: True)
    with pytest.raises(ValueError, match=r"impl='fla' needs flash-linear-attention \(pip install "
                                         r"flash-linear-attention\)"):
        fp32_requests()[op]("fla")


@pytest.mark.parametrize("op", ["decayed", "delta"])
def test_fla_on_a_cpu_tensor_is_refused(monkeypatch, op):
    fla = install(monkeypatch, StandIn())
    monkeypatch.setattr(flash_linear, "on_cuda", lambda x: x.is_cuda)
    with pytest.raises(ValueError, match=r"impl='fla'\) runs flash-linear-attention's Triton kernels, which need "
                                         r"CUDA tensors; got q on cpu"):
        fp32_requests()[op]("fla")
    assert sum(fla.calls.values()) == 0


def test_fla_with_a_normalizer_is_refused(monkeypatch):
    install(monkeypatch, StandIn())
    q, k, v, g, _ = decay_inputs(1, 10, True, 1, dtype=torch.float32)
    with pytest.raises(ValueError, match="takes normalize='none' only; got 'divisive'"):
        decayed_linear_attention(q, k, v, g, normalize="divisive", impl="fla")


def _real_fla():
    return torch.cuda.is_available() and importlib.util.find_spec("fla") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not _real_fla(), reason="needs a CUDA device and flash-linear-attention installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["decayed", "delta", "deltanet"])
def test_real_fla_on_cuda_matches_chunk(op, dtype):
    """The real kernels against our chunked form on the device: packed documents (one inside a chunk), per-token
    decay, an initial state in and the final state out, and every gradient; relative error as the first-use check's
    tolerance (fp32 kernels may multiply in TF32)."""
    cu = torch.tensor([0, 3, 70, 75, 200], dtype=torch.int32, device="cuda")
    if op == "decayed":
        *xs, S = decay_inputs(1, 200, True, 4, heads=4, dk=64, dv=64)
        xs = [xs[0] * 64 ** -0.5, *xs[1:]]
        run, names = decayed, ["q", "k", "v", "g", "initial state"]
    else:
        *xs, S = delta_inputs(1, 200, 4, heads=4, dk=64, dv=64)
        run = lambda impl, cu: delta(impl, cu, gated=op == "delta")
        names = ["q", "k", "v", "beta", "g", "initial state"]
    tensors = leaves(*(x.to("cuda", dtype) for x in xs), S.float().cuda())
    if op == "deltanet":
        tensors[4] = None  # no gate
    want = outputs_and_grads(run("chunk", cu), tensors)
    try:
        got = outputs_and_grads(run("fla", cu), tensors)
    except RuntimeError as err:  # fla's own guard, e.g. its gated backward on Hopper with Triton in [3.4, 3.7.1)
        if "upgrade Triton" not in str(err):
            raise
        pytest.skip(f"fla refuses this op on this device's Triton (auto's first-use check falls back): {err}")
    grads = [f"grad of {name}" for name, x in zip(names, tensors, strict=True) if x is not None]
    compared = ["output", "final state", *grads]
    errors = {name: ((a.double() - b.double()).norm() / b.double().norm()).item()
              for name, a, b in zip(compared, got, want, strict=True)}
    tolerance = {torch.float32: 5e-3, torch.bfloat16: 3e-2}[dtype]
    # every tensor's error in the message: a device session is short, and the first failure must say it all
    assert max(errors.values()) < tolerance, f"relative errors (tolerance {tolerance}): " + ", ".join(
        f"{name} {error:.2g}" for name, error in errors.items())
