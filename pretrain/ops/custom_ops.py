"""Our ops as ``torch.library`` custom ops, so ``torch.compile`` sees each as one opaque node.

The chunked forms walk their chunks and documents in Python loops and read ``cu_seqlens`` on the host: traced,
they would unroll per length, break the graph at every ``tolist()`` and recompile for every packing. Registered
as ``torch.ops.pretrain.<name>``, an op is a schema, a fake implementation (output shapes and dtypes from input
shapes) and a backward that is itself one op; its body is the op's public entry run eagerly, so a compiled model
computes exactly what eager mode computes, and the compiler fuses what surrounds the op.

The backward op recomputes the forward under autograd and differentiates it: one extra forward per backward, the
price of keeping the compiler away from the implementations' own autograd functions. Each entry calls its op only
while being compiled (``torch.compiler.is_compiling()``); eager code keeps the direct call.
"""
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch

ABSENT = (0,)  # shape of the placeholder that stands for an absent output (custom ops return no None)


def absent(like: torch.Tensor) -> torch.Tensor:
    """The empty placeholder for an output that is not there (an op's outputs are all tensors)."""
    return like.new_empty(ABSENT, dtype=torch.float32)


def register(name: str, run: Callable, fake: Callable, *, tensors: Sequence[str], options: str) -> Callable:
    """``run`` as the op ``torch.ops.pretrain.<name>``, with the backward op ``<name>_backward``; returns the op.

    ``tensors``: the names of the op's leading tensor arguments, each of which may be None (an absent state, an
    unpacked batch's ``cu_seqlens``); ``options``: the schema of the arguments after them, e.g.
    ``"bool causal, int chunk_size, str impl"``. ``run(*tensors, *options)`` is the eager op returning a list of
    tensors (``absent`` placeholders for outputs that are not there); ``fake`` takes the same arguments and returns
    empty tensors of the outputs' shapes and dtypes, contiguous, as ``run``'s outputs are made.
    """
    count = len(tensors)
    arguments = ", ".join(f"Tensor? {t}" for t in tensors)

    def forward(*args):
        outputs = [t.contiguous() for t in run(*args)]  # the fake's strides, which the compiled graph relies on
        return _unshared(outputs, [t for t in args[:count] if isinstance(t, torch.Tensor)])

    def backward(*args):
        inputs, (grads, wanted), rest = args[:count], args[count:count + 2], args[count + 2:]
        leaves = [None if t is None else t.detach().requires_grad_(want) for t, want in zip(inputs, wanted)]
        with recording_autograd():
            used = [(out, g) for out, g in zip(run(*leaves, *rest), grads) if g is not None and out.requires_grad]
            wrt = [t for t, want in zip(leaves, wanted) if want]
            found = torch.autograd.grad([out for out, _ in used], wrt, [g for _, g in used], allow_unused=True)
        # contiguous, as the fake says: a gradient may be a strided slice; and owning its memory: autograd may hand
        # an incoming gradient straight through (a final state's gradient to the initial state's)
        found = [torch.zeros_like(t) if g is None else g.contiguous() for t, g in zip(wrt, found)]
        return _unshared(found, [g for g in grads if g is not None])

    def backward_fake(*args):
        inputs, wanted = args[:count], args[count + 1]
        return [t.new_empty(t.shape) for t, want in zip(inputs, wanted) if want]

    op = torch.library.custom_op(f"pretrain::{name}", forward, mutates_args=(),
                                 schema=f"({arguments}, {options}) -> Tensor[]")
    op.register_fake(fake)
    backward_op = torch.library.custom_op(f"pretrain::{name}_backward", backward, mutates_args=(),
                                          schema=f"({arguments}, Tensor?[] grads, bool[] wanted, {options}) "
                                                 "-> Tensor[]")
    backward_op.register_fake(backward_fake)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:count])
        ctx.options = inputs[count:]

    def autograd_backward(ctx, grads):
        inputs = ctx.saved_tensors
        wanted = [bool(need) and t is not None and t.is_floating_point()
                  for t, need in zip(inputs, ctx.needs_input_grad)]
        found = iter(backward_op(*inputs, list(grads), wanted, *ctx.options))
        return *(next(found) if want else None for want in wanted), *(None for _ in ctx.options)

    op.register_autograd(autograd_backward, setup_context=setup_context)
    return op


def _unshared(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``outputs`` with a copy of each one whose memory an input or an earlier output already uses: a custom op's
    outputs must own their memory."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    fresh = []
    for t in outputs:
        if t.numel() and t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        fresh.append(t)
    return fresh


@contextmanager
def recording_autograd():
    """Record autograd, even inside a custom op's body, which the dispatcher runs with autograd's keys excluded (the
    backward op's recomputation; a first-use check, ``first_use.py``, that a compiled model's first call reaches)."""
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (keys.AutogradFunctionality, keys.AutogradOther, keys.AutogradNestedTensor):
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield
