"""What the delta-rule family's Triton tests share: a relative-error check, a Triton form against the chunked form
in fp64 (outputs, final states and the gradients of every input and of the initial state), and a mixer run on
either."""
import warnings

import torch


def run_with_grads(op, inputs, state, dtype, *, impl, seed, **kwargs):
    """``op``'s output, final state and the gradients of a fixed random function of both w.r.t. every input given,
    with the inputs cast to ``dtype`` (the state to fp32 at most)."""
    leaves = [None if x is None else x.detach().to(dtype).requires_grad_() for x in inputs]
    S = None if state is None else state.detach().to(torch.promote_types(dtype, torch.float32)).requires_grad_()
    o, final = op(*leaves, initial_state=S, output_final_state=True, impl=impl, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.device) for x in (o, final)]
    loss = sum((x * w.to(x.dtype)).sum() for x, w in zip((o, final), weights))
    given = [x for x in (*leaves, S) if x is not None]
    return [o, final, *torch.autograd.grad(loss, given)]


def assert_close(got, want, tol, what):
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err < tol, f"{what}: relative error {err:.2e} ≥ {tol:.0e}"


def compare(op, inputs, state, *, dtype, tol, seed, names=("q", "k", "v", "β", "g"), **kwargs):
    """``op(*inputs)`` (named ``names``; by default q, k, v, β, g) with ``impl="triton"`` in ``dtype`` against
    ``impl="chunk"`` in fp64 (``tol``: a number, or a function of the result's name); returns the Triton form's
    results."""
    got = run_with_grads(op, inputs, state, dtype, impl="triton", seed=seed, **kwargs)
    want = run_with_grads(op, inputs, state, torch.float64, impl="chunk", seed=seed, **kwargs)
    names = ["o", "final state"] + [f"d{name}" for name, x in zip(names, inputs) if x is not None] + (
        ["d initial state"] if state is not None else [])
    assert len(got) == len(names)
    for name, a, b in zip(names, got, want):
        assert_close(a, b, tol(name) if callable(tol) else tol, name)
    return got


def compare_from_random_state(op, inputs, cu, chunk_size, *, seed, **kwargs):
    """``compare`` in fp32 within 1e-5, from a random initial state per sequence or per document (``cu``: the
    document offsets, a list, or None); ``kwargs``: ``compare``'s ``names``."""
    batch, _, heads, dk = inputs[0].shape
    device = inputs[0].device
    num = batch if cu is None else len(cu) - 1
    state = torch.randn(num, heads, dk, inputs[2].shape[-1], dtype=torch.float64,
                        generator=torch.Generator().manual_seed(seed)).to(device)
    cu_seqlens = None if cu is None else torch.tensor(cu, device=device)
    compare(op, inputs, state, dtype=torch.float32, tol=1e-5, seed=seed, cu_seqlens=cu_seqlens,
            chunk_size=chunk_size, **kwargs)


def assert_layer_matches_chunk(layer):
    """A mixer layer of width 32 (its ``impl`` set to ``triton``, then ``chunk``) on two packed documents of 7 and
    23 tokens: the output and the gradients of the input and of every parameter within 1e-5 relative."""
    device = next(layer.parameters()).device
    x = torch.randn(1, 30, 32, device=device, requires_grad=True)
    cu = torch.tensor([0, 7, 30], device=device)
    results = []
    for impl in ("triton", "chunk"):
        layer.impl = impl
        y = layer(x, cu_seqlens=cu)
        results.append([y, *torch.autograd.grad(y.square().sum(), [x, *layer.parameters()])])
    for name, got, want in zip(["y", "dx", *(n for n, _ in layer.named_parameters())], *results):
        assert_close(got, want, 1e-5, name)


def assert_auto_takes_ours_after_its_check(monkeypatch, module, name, op, inputs):
    """On CUDA (stood in for by the interpreter) ``op``'s ``auto`` runs our kernels (``module.<name>``) once they
    matched ``chunk``: the check's call, then the request's (chunks of 16); on CPU ``auto`` is ``chunk``."""
    calls = []
    ours = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args, **kwargs: calls.append(1) or ours(*args, **kwargs))
    if not inputs[0].is_cuda:
        op(*inputs, chunk_size=16)
        assert not calls
    monkeypatch.setattr(module, "_triton_may_run", lambda q, v: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = op(*inputs, chunk_size=16)
    assert len(calls) == 1 + 1
    assert_close(got, op(*inputs, chunk_size=16, impl="chunk"), 1e-5, "o")
