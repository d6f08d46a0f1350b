"""``efficient_attention`` as the custom op ``torch.ops.pretrain.efficient_attention`` (``ops/custom_ops.py``):
under ``torch.compile`` one opaque node whose body is the entry run eagerly, so the compiler never traces the
per-document loop or reads ``cu_seqlens``."""
import torch

from ..custom_ops import register


def efficient_attention_op(q, k, v, *, causal, cu_seqlens, initial_state, output_final_state, chunk_size, impl):
    """``efficient_attention`` with the same arguments and results, safe to call inside ``torch.compile``."""
    S, L = (None, None) if initial_state is None else initial_state
    o, *final = _forward(q, k, v, S, L, cu_seqlens, causal, output_final_state, chunk_size, impl)
    return (o, tuple(final)) if output_final_state else o


def _run(q, k, v, S, L, cu_seqlens, causal, output_final_state, chunk_size, impl):
    from . import efficient_attention  # the package's entry, which imports this module; eager here
    out = efficient_attention(q, k, v, causal=causal, cu_seqlens=cu_seqlens,
                              initial_state=None if S is None else (S, L), output_final_state=output_final_state,
                              chunk_size=chunk_size, impl=impl)
    return [out[0], *out[1]] if output_final_state else [out]


def _fake(q, k, v, S, L, cu_seqlens, causal, output_final_state, chunk_size, impl):
    o = v.new_empty(v.shape)
    if not output_final_state:
        return [o]
    batch, _, heads, dim = k.shape
    dtype = torch.promote_types(k.dtype, torch.float32)  # the state's, as the chunked form keeps it
    return [o, k.new_empty((batch, heads, dim, v.shape[-1]), dtype=dtype),
            k.new_empty((batch, heads, dim), dtype=dtype)]


_forward = register("efficient_attention", _run, _fake, tensors=("q", "k", "v", "S", "L", "cu_seqlens"),
                    options="bool causal, bool output_final_state, int chunk_size, str impl")
