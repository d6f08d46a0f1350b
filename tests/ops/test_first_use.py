"""``impl="auto"`` takes a kernel nobody has run on this device only after its first-use check (ops/first_use.py).

On CPU the check is exercised by injecting kernels: a wrong one (output, or only its backward), one that raises, and
a correct one, in place of the Triton linear-attention kernel and of softmax's flash-attn and varlen_attn.
"""
import importlib
import re
import warnings

import pytest
import torch

# the modules, not the functions of the same name that pretrain.ops re-exports over them
la = importlib.import_module("pretrain.ops.linear_attention")
sm = importlib.import_module("pretrain.ops.softmax")
pytestmark = pytest.mark.usefixtures("fresh_verdicts")  # tests/ops/conftest.py: no verdict carried between tests


class Counted:
    """A stand-in kernel that counts its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


class _WrongBackward(torch.autograd.Function):
    """The identity forward, a doubled gradient: a kernel whose forward passes and whose backward does not."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


def chunk_form(q, k, v, **kwargs):
    return la.linear_attention_chunk(q, k, v, **kwargs)


def scaled_output(q, k, v, **kwargs):
    out = chunk_form(q, k, v, **kwargs)
    return (out[0] * 1.1, out[1]) if isinstance(out, tuple) else out * 1.1


def wrong_backward(q, k, v, **kwargs):
    out = chunk_form(q, k, v, **kwargs)
    return (_WrongBackward.apply(out[0]), out[1]) if isinstance(out, tuple) else _WrongBackward.apply(out)


def raises(*args, **kwargs):
    raise RuntimeError("no kernel image is available for execution on the device")


def features(length=150, heads=3, dk=8, dv=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(1, length, heads, dk, generator=gen), torch.rand(1, length, heads, dk, generator=gen), \
        torch.randn(1, length, heads, dv, generator=gen)


def use_kernel(monkeypatch, kernel):
    monkeypatch.setattr(la, "linear_attention_triton", kernel)
    monkeypatch.setattr(la, "_triton_may_run", lambda q: True)  # as on CUDA with triton installed


@pytest.mark.parametrize("broken", [scaled_output, wrong_backward, raises], ids=["output", "backward", "raises"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_a_wrong_kernel_warns_once_and_auto_falls_back(monkeypatch, broken, packed):
    kernel = Counted(broken)
    use_kernel(monkeypatch, kernel)
    q, k, v = features()
    cu = torch.tensor([0, 40, 41, 150]) if packed else None
    want = la.linear_attention(q, k, v, cu_seqlens=cu, impl="chunk")
    with pytest.warns(RuntimeWarning, match=r"Triton linear-attention kernel failed its first-use check on cpu in "
                                            r"float32 .*impl='auto' uses the chunked form") as record:
        got = la.linear_attention(q, k, v, cu_seqlens=cu, impl="auto")
    assert len(record) == 1
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    checked = kernel.calls
    assert checked == 1  # the check's own call, never the request's
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the verdict is remembered: no second warning, no second check
        la.linear_attention(q, k, v, cu_seqlens=cu, impl="auto")
    assert kernel.calls == checked


def test_the_warning_names_what_differed(monkeypatch):
    use_kernel(monkeypatch, Counted(wrong_backward))
    with pytest.warns(RuntimeWarning, match=r"gradient of input \d off by"):
        la.linear_attention(*features(), impl="auto")


def test_a_correct_kernel_is_taken_after_its_check(monkeypatch):
    kernel = Counted(chunk_form)
    use_kernel(monkeypatch, kernel)
    q, k, v = features()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        la.linear_attention(q, k, v, impl="auto")
        la.linear_attention(q, k, v, impl="auto")
    assert kernel.calls == 2 + 2  # checked whole and cut into segments, then used for both requests


def test_a_correct_kernel_is_taken_when_first_asked_inside_a_custom_op(monkeypatch):
    """A compiled model's first call reaches the kernel inside the op's body (ops/custom_ops.py), where the dispatcher
    has turned autograd off: the check records its own gradients regardless, and the kernel passes."""
    from pretrain.ops.linear_attention.library import linear_attention_op

    kernel = Counted(chunk_form)
    use_kernel(monkeypatch, kernel)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linear_attention_op(*(x.requires_grad_() for x in features()), impl="auto")
    assert kernel.calls == 2 + 1


def test_each_request_class_is_checked_once(monkeypatch):
    kernel = Counted(chunk_form)
    use_kernel(monkeypatch, kernel)
    q, k, v = features()
    la.linear_attention(q, k, v, normalize="divisive", impl="auto")
    la.linear_attention(q, k, v, normalize="none", impl="auto")
    la.linear_attention(q, k, v, normalize="none", impl="auto")
    assert kernel.calls == 2 * 2 + 3  # two classes checked (whole and cut), three requests run


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_a_kernel_wrong_only_on_cut_documents_is_caught(monkeypatch, packed):
    """The check runs the kernel a second time with its documents cut into one-chunk segments (the rule never cuts
    inputs this small): a kernel right when whole and wrong when cut fails, and the warning says which."""
    kernels = importlib.import_module("pretrain.ops.linear_attention.triton")
    cut_calls = []

    def wrong_when_cut(q, k, v, **kwargs):
        cut_calls.append(kernels.SEGMENT_CHUNKS)
        return scaled_output(q, k, v, **kwargs) if kernels.SEGMENT_CHUNKS else chunk_form(q, k, v, **kwargs)

    use_kernel(monkeypatch, Counted(wrong_when_cut))
    q, k, v = features()
    cu = torch.tensor([0, 40, 41, 150]) if packed else None
    with pytest.warns(RuntimeWarning, match=r"linear-attention kernel \(documents cut into segments\) failed its "
                                            r"first-use check .*output off by"):
        got = la.linear_attention(q, k, v, cu_seqlens=cu, impl="auto")
    assert cut_calls == [0, 1]  # whole, then cut; the request itself went to the chunked form
    assert kernels.SEGMENT_CHUNKS is None  # the rule's choice again after the check
    torch.testing.assert_close(got, la.linear_attention(q, k, v, cu_seqlens=cu, impl="chunk"), rtol=0, atol=0)


def test_a_kernel_asked_for_by_name_is_not_checked(monkeypatch):
    kernel = Counted(raises)
    use_kernel(monkeypatch, kernel)
    with pytest.raises(RuntimeError, match="no kernel image"):
        la.linear_attention(*features(), impl="triton")
    assert kernel.calls == 1


def test_the_check_leaves_the_random_streams_alone(monkeypatch):
    use_kernel(monkeypatch, Counted(chunk_form))
    q, k, v = features()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    la.linear_attention(q, k, v, impl="auto")
    torch.testing.assert_close(torch.rand(3), expected, rtol=0, atol=0)


def test_the_check_runs_under_no_grad(monkeypatch):
    """Evaluation runs under no_grad; the check needs gradients of its own and must still decide."""
    use_kernel(monkeypatch, Counted(wrong_backward))
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="gradient"):
        la.linear_attention(*features(), impl="auto")


def use_softmax_kernels(monkeypatch, **kernels):
    """``kernels`` in place of flash-attn's and varlen_attn's, auto's candidates in this order (as on CUDA with
    them installed)."""
    for name, kernel in kernels.items():
        monkeypatch.setitem(sm.KERNELS, name, kernel)
    monkeypatch.setattr(sm, "_candidates", lambda q, packed: list(kernels))


def per_document_sdpa(q, k, v, causal, cu_seqlens, max_seqlen):
    return sm.sdpa(q, k, v, causal, cu_seqlens)


def shuffled_sdpa(q, k, v, causal, cu_seqlens, max_seqlen):
    return sm.sdpa(q, k, v, causal, cu_seqlens).flip(1)  # every token gets another token's output


@pytest.mark.parametrize("name", ["flash", "varlen"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_softmax_kernels_are_checked_against_sdpa(monkeypatch, name, packed):
    kernel = Counted(shuffled_sdpa)
    use_softmax_kernels(monkeypatch, **{name: kernel})
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 50, 2, 8, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 20, 50]) if packed else None
    with pytest.warns(RuntimeWarning, match=re.escape(sm.NAMES[name]) + " failed its first-use check.*"
                                            "scaled_dot_product_attention"):
        got = sm.softmax_attention(q, k, v, cu_seqlens=cu)
    torch.testing.assert_close(got, sm.sdpa(q, k, v, True, cu), rtol=0, atol=0)
    sm.softmax_attention(q, k, v, cu_seqlens=cu)
    assert kernel.calls == 1


def test_a_correct_softmax_kernel_is_taken_after_a_wrong_one(monkeypatch):
    """flash-attn first; when it fails its check, varlen_attn is checked and, matching, taken from then on."""
    flash, varlen = Counted(shuffled_sdpa), Counted(per_document_sdpa)
    use_softmax_kernels(monkeypatch, flash=flash, varlen=varlen)
    q = k = v = torch.randn(1, 30, 2, 8)
    cu = torch.tensor([0, 1, 30])
    with pytest.warns(RuntimeWarning, match="flash-attn failed"):
        sm.softmax_attention(q, k, v, cu_seqlens=cu)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sm.softmax_attention(q, k, v, cu_seqlens=cu)
    assert (flash.calls, varlen.calls) == (1, 3)  # each check once, then varlen for both requests


def test_a_decided_softmax_check_makes_nothing_on_the_device(monkeypatch):
    """Once a request class has its verdict, auto builds no check inputs (on a GPU, copying them there waits for
    the device: a host sync on every layer of every step)."""
    use_softmax_kernels(monkeypatch, varlen=Counted(per_document_sdpa))
    made = Counted(sm.sample_inputs)
    monkeypatch.setattr(sm, "sample_inputs", made)
    q = k = v = torch.randn(1, 30, 2, 8)
    for _ in range(3):
        sm.softmax_attention(q, k, v, cu_seqlens=torch.tensor([0, 1, 30]))
    assert made.calls == 1
