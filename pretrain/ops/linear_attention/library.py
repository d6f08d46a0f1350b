"""``linear_attention`` as the custom op ``torch.ops.pretrain.linear_attention`` (``ops/custom_ops.py``).

Inside, the op is the ordinary dispatcher (Triton on CUDA, the chunked form on CPU); outside, the compiler sees only
a schema, a fake implementation that gives output shapes, and a backward that is itself one op. ``linear_attention``
calls ``linear_attention_op`` whenever it is being compiled, so a model that uses it compiles as one graph (no breaks
on ``cu_seqlens.tolist()`` or on the implementations' Python loops) and computes exactly what eager mode computes.
"""
import torch

from ..custom_ops import absent, register
from .state import FIELDS, LinearAttentionState


def linear_attention_op(q, k, v, *, causal=True, normalize="divisive", eps=1e-6, cu_seqlens=None,
                        initial_state=None, output_final_state=False, chunk_size=64, impl="auto"):
    """``linear_attention`` with the same arguments and results, safe to call inside ``torch.compile``."""
    initial = (None,) * 4 if initial_state is None else tuple(LinearAttentionState(*initial_state))
    o, *final = _forward(q, k, v, *initial, cu_seqlens, causal, normalize, eps, chunk_size, impl)
    if not output_final_state:
        return o
    return o, present_fields(final, normalize)


def present_fields(final, normalize: str) -> LinearAttentionState:
    """The op's state outputs as a ``LinearAttentionState``: the fields ``normalize`` keeps, None for the rest."""
    return LinearAttentionState(*(f if name in FIELDS[normalize] else None
                                  for name, f in zip(LinearAttentionState._fields, final)))


def state_fakes(q, v, num: int, normalize: str) -> list[torch.Tensor]:
    """Fake final-state outputs, ``[N, H, ...]`` in the state dtype where ``normalize`` keeps the field, else the
    placeholder (shared by the decayed op, which keeps the same state)."""
    heads, dk, dv = q.shape[2], q.shape[3], v.shape[3]
    shapes = {"S": (num, heads, dk, dv), "z": (num, heads, dk), "u": (num, heads, dv), "n": (num, heads)}
    dtype = torch.promote_types(q.dtype, torch.float32)
    return [q.new_empty(shapes[f], dtype=dtype) if f in FIELDS[normalize] else absent(q)
            for f in LinearAttentionState._fields]


def documents(q, cu_seqlens) -> int:
    """N: the batch, or the number of packed documents (a symbolic size under compile)."""
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _run(q, k, v, S, z, u, n, cu_seqlens, causal, normalize, eps, chunk_size, impl):
    """The dispatcher with the final state always returned, absent fields as placeholders."""
    from . import linear_attention  # the package's entry, which imports this module; not compiling here: eager
    initial = None if S is None else LinearAttentionState(S, z, u, n)
    o, final = linear_attention(q, k, v, causal=causal, normalize=normalize, eps=eps, cu_seqlens=cu_seqlens,
                                initial_state=initial, output_final_state=True, chunk_size=chunk_size, impl=impl)
    return [o, *(absent(q) if f is None else f for f in final)]


def _fake(q, k, v, S, z, u, n, cu_seqlens, causal, normalize, eps, chunk_size, impl):
    return [v.new_empty(v.shape, dtype=q.dtype), *state_fakes(q, v, documents(q, cu_seqlens), normalize)]


_forward = register("linear_attention", _run, _fake, tensors=("q", "k", "v", "S", "z", "u", "n", "cu_seqlens"),
                    options="bool causal, str normalize, float eps, int chunk_size, str impl")
