"""``linear_attention`` as a ``torch.library`` custom op, so ``torch.compile`` sees one opaque node.

Inside, the op is the ordinary dispatcher (Triton on CUDA, the chunked form on CPU); outside, the compiler
sees only a schema, a fake implementation that gives output shapes, and a backward that is itself one op.
``linear_attention`` calls ``linear_attention_op`` whenever it is being compiled, so a model that uses it compiles
as one graph (no breaks on ``cu_seqlens.tolist()`` or on the implementations' Python loops) and computes exactly
what eager mode computes.

The backward op recomputes the forward under autograd and differentiates it: one extra forward per backward,
the price of keeping the compiler away from the implementations' own autograd functions.
"""
from contextlib import contextmanager

import torch

from .state import FIELDS, LinearAttentionState

_ABSENT = (0,)  # shape of the placeholder that stands for an absent state field (custom ops return no None)


def linear_attention_op(q, k, v, *, causal=True, normalize="divisive", eps=1e-6, cu_seqlens=None,
                        initial_state=None, output_final_state=False, chunk_size=64, impl="auto"):
    """``linear_attention`` with the same arguments and results, safe to call inside ``torch.compile``."""
    initial = (None,) * 4 if initial_state is None else tuple(LinearAttentionState(*initial_state))
    o, *final = _forward(q, k, v, *initial, cu_seqlens, causal, normalize, eps, chunk_size, impl)
    if not output_final_state:
        return o
    kept = FIELDS[normalize]
    return o, LinearAttentionState(*(f if name in kept else None
                                     for name, f in zip(LinearAttentionState._fields, final)))


def _run(q, k, v, S, z, u, n, cu_seqlens, causal, normalize, eps, chunk_size, impl):
    """The dispatcher with the final state always returned, absent fields as empty placeholders."""
    from . import linear_attention  # the package's entry, which imports this module; not compiling here: eager
    initial = None if S is None else LinearAttentionState(S, z, u, n)
    o, final = linear_attention(q, k, v, causal=causal, normalize=normalize, eps=eps, cu_seqlens=cu_seqlens,
                                initial_state=initial, output_final_state=True, chunk_size=chunk_size, impl=impl)
    # fields may be views of one augmented state; a custom op's outputs must not share memory, and must have
    # the fake implementation's (contiguous) strides, which the compiled graph's views rely on
    return o.contiguous(), *(q.new_empty(_ABSENT, dtype=torch.float32) if f is None
                             else f.clone(memory_format=torch.contiguous_format) for f in final)


@torch.library.custom_op("pretrain::linear_attention", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S: torch.Tensor | None, z: torch.Tensor | None,
             u: torch.Tensor | None, n: torch.Tensor | None, cu_seqlens: torch.Tensor | None, causal: bool,
             normalize: str, eps: float, chunk_size: int, impl: str
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _run(q, k, v, S, z, u, n, cu_seqlens, causal, normalize, eps, chunk_size, impl)


@_forward.register_fake
def _forward_fake(q, k, v, S, z, u, n, cu_seqlens, causal, normalize, eps, chunk_size, impl):
    num = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    heads, dk, dv = q.shape[2], q.shape[3], v.shape[3]
    state_dtype = torch.promote_types(q.dtype, torch.float32)
    shapes = {"S": (num, heads, dk, dv), "z": (num, heads, dk), "u": (num, heads, dv), "n": (num, heads)}
    final = [q.new_empty(shapes[f] if f in FIELDS[normalize] else _ABSENT, dtype=state_dtype if f in
                         FIELDS[normalize] else torch.float32) for f in LinearAttentionState._fields]
    return v.new_empty(v.shape, dtype=q.dtype), *final


@torch.library.custom_op("pretrain::linear_attention_backward", mutates_args=())
def _backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S: torch.Tensor | None, z: torch.Tensor | None,
              u: torch.Tensor | None, n: torch.Tensor | None, cu_seqlens: torch.Tensor | None, do: torch.Tensor,
              dS: torch.Tensor, dz: torch.Tensor, du: torch.Tensor, causal: bool, normalize: str, eps: float,
              chunk_size: int, impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                   torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v and of the initial S, z, u (empty placeholders where there is none)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    initial = [None if t is None else t.detach().requires_grad_(name != "n")
               for name, t in zip(LinearAttentionState._fields, (S, z, u, n))]
    with _autograd_inside_op():
        o, *final = _run(*leaves, *initial, cu_seqlens, causal, normalize, eps, chunk_size, impl)
        outputs, grads = [o], [do]
        for f, g in zip(final[:3], (dS, dz, du)):
            if f.numel() and g.numel():
                outputs.append(f)
                grads.append(g)
        wrt = leaves + [t for t in initial[:3] if t is not None]
        found = torch.autograd.grad(outputs, wrt, grads, allow_unused=True)
    # contiguous, as the fake implementation says: a gradient may be a strided slice (v's, of [v, 1]'s)
    found = [torch.zeros_like(t) if g is None else g.contiguous() for t, g in zip(wrt, found)]
    # autograd may hand an incoming gradient straight through (dS_T → dS_0); outputs must own their memory
    found = _unshared(found, [do, dS, dz, du])
    dq, dk, dv, *rest = found
    d_initial = iter(rest)
    return dq, dk, dv, *(q.new_empty(_ABSENT, dtype=torch.float32) if t is None else next(d_initial)
                         for t in initial[:3])


def _unshared(outputs, inputs):
    """``outputs`` with a copy of each one whose memory an input or an earlier output already uses."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    fresh = []
    for t in outputs:
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        fresh.append(t)
    return fresh


@contextmanager
def _autograd_inside_op():
    """Record autograd inside a custom op's body, which the dispatcher runs with autograd's keys excluded."""
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (keys.AutogradFunctionality, keys.AutogradOther, keys.AutogradNestedTensor):
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


@_backward.register_fake
def _backward_fake(q, k, v, S, z, u, n, cu_seqlens, do, dS, dz, du, causal, normalize, eps, chunk_size, impl):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            *(q.new_empty(_ABSENT, dtype=torch.float32) if t is None else t.new_empty(t.shape) for t in (S, z, u)))


def _setup_context(ctx, inputs, output):
    q, k, v, S, z, u, n, cu_seqlens, causal, normalize, eps, chunk_size, impl = inputs
    ctx.save_for_backward(q, k, v, S, z, u, n, cu_seqlens)
    ctx.options = (causal, normalize, eps, chunk_size, impl)


def _autograd_backward(ctx, do, dS, dz, du, _dn):
    q, k, v, S, z, u, n, cu_seqlens = ctx.saved_tensors
    do = torch.zeros_like(v, dtype=q.dtype) if do is None else do
    dS, dz, du = (q.new_empty(_ABSENT, dtype=torch.float32) if g is None else g for g in (dS, dz, du))
    dq, dk, dv, dS0, dz0, du0 = _backward(q, k, v, S, z, u, n, cu_seqlens, do, dS, dz, du, *ctx.options)
    d_initial = [None if t is None else d for t, d in zip((S, z, u), (dS0, dz0, du0))]
    return dq, dk, dv, *d_initial, None, None, None, None, None, None, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)
