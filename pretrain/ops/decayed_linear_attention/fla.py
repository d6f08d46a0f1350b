"""Decayed linear attention by flash-linear-attention's ``chunk_simple_gla`` (CUDA, ``normalize="none"``).

The conventions already agree (S_t = exp(g_t) S_{t−1} + k_t v_tᵀ, o_t = q_tᵀ S_t, state ``[N, H, Dk, Dv]``); what
differs is mapped here: fla scales q by ``Dk^-1/2`` unless told otherwise (ours is scaled by the caller: scale=1.0);
g goes in per token ``[B, T, H]`` even when it is one constant per head, because fla's per-head ``g_gamma`` gets no
gradient from its backward; offsets become int64; the final state comes back in our state dtype. fla tiles by its
own chunk size: ours (``chunk_size``) does not reach it.
"""
from ..flash_linear import check_fla_device, fla_function, fla_offsets, state_dtype
from ..linear_attention.state import LinearAttentionState


def decayed_linear_attention_fla(q, k, v, g, *, normalize, eps, cu_seqlens, initial_state, output_final_state,
                                 chunk_size):
    """Same arguments and results as ``decayed_linear_attention`` (g ``[B, T, H]``; ``eps``, ``chunk_size`` unused)."""
    del eps, chunk_size
    if normalize != "none":
        raise ValueError(f"impl='fla' (chunk_simple_gla) has no normalizer: it takes normalize='none' only; got "
                         f"{normalize!r} (use impl='chunk')")
    check_fla_device(q, "decayed_linear_attention")
    chunk_simple_gla = fla_function("fla.ops.simple_gla", "chunk_simple_gla")
    initial = None if initial_state is None else initial_state.S.to(state_dtype(q))
    o, final = chunk_simple_gla(q, k, v, g=g, scale=1.0, initial_state=initial,
                                output_final_state=output_final_state, **fla_offsets(cu_seqlens, q))
    return (o, LinearAttentionState(final.to(state_dtype(q)))) if output_final_state else o
