"""``decayed_linear_attention`` as the custom op ``torch.ops.pretrain.decayed_linear_attention``
(``ops/custom_ops.py``): under ``torch.compile`` one opaque node whose body is the package's entry run eagerly, so
the compiler never traces the chunk loops or reads the decay's values."""
from ..custom_ops import absent, register
from ..linear_attention.library import documents, present_fields, state_fakes
from ..linear_attention.state import LinearAttentionState


def decayed_linear_attention_op(q, k, v, g, *, normalize, eps, cu_seqlens, initial_state, output_final_state,
                                chunk_size, impl):
    """``decayed_linear_attention`` with the same arguments and results, safe to call inside ``torch.compile``."""
    S, z = (None, None) if initial_state is None else tuple(LinearAttentionState(*initial_state))[:2]
    o, *final = _forward(q, k, v, g, S, z, cu_seqlens, normalize, eps, chunk_size, impl)
    return (o, present_fields(final, normalize)) if output_final_state else o


def _run(q, k, v, g, S, z, cu_seqlens, normalize, eps, chunk_size, impl):
    from . import decayed_linear_attention  # the package's entry, which imports this module; eager here
    initial = None if S is None else LinearAttentionState(S, z)
    o, final = decayed_linear_attention(q, k, v, g, normalize=normalize, eps=eps, cu_seqlens=cu_seqlens,
                                        initial_state=initial, output_final_state=True, chunk_size=chunk_size,
                                        impl=impl)
    return [o, *(absent(q) if f is None else f for f in final)]


def _fake(q, k, v, g, S, z, cu_seqlens, normalize, eps, chunk_size, impl):
    return [v.new_empty(v.shape, dtype=q.dtype), *state_fakes(q, v, documents(q, cu_seqlens), normalize)]


_forward = register("decayed_linear_attention", _run, _fake, tensors=("q", "k", "v", "g", "S", "z", "cu_seqlens"),
                    options="str normalize, float eps, int chunk_size, str impl")
