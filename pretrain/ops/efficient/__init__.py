"""Efficient attention (Shen et al. 2021): softmax over Q's features and over K's positions, separately.

docs/MIXERS.md#efficient. Non-causal, as published: ``O = softmax_d(Q) · (softmax_T(K)ᵀ V)``.
Causal (derived): ``o_t = Σ_c softmax(q_t)_c · A_t[c]`` with ``A_t[c] = Σ_{j≤t} softmax_{j≤t}(k_{·c})_j v_j``,
a per-channel prefix softmax over the keys.

``naive.py`` holds the definition (the oracle), ``chunk.py`` the causal chunked form, ``state.py`` the state a
sequence-parallel rank hands on.
"""
import torch

from ..documents import per_document
from ..precision import upcast
from .chunk import causal_chunked
from .library import efficient_attention_op
from .naive import efficient_attention_naive
from .state import combine_efficient_states, efficient_state


def efficient_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    impl: str = "auto",
):
    """q, k ``[B, T, H, D]``, v ``[B, T, H, Dv]`` → o ``[B, T, H, Dv]`` (or ``(o, state)``).

    ``impl``: "naive" (the O(T²) definition), "chunk" (causal: chunks of ``chunk_size``; non-causal: the
    published two-matmul form) or "auto" (= "chunk"). ``initial_state``/``output_final_state`` carry the causal
    state ``(Ŝ [B,H,D,Dv], L [B,H,D])`` across calls, e.g. for token-by-token decoding.
    """
    if not (q.shape[:3] == k.shape[:3] == v.shape[:3] and q.shape[-1] == k.shape[-1]):
        raise ValueError(f"efficient_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    if impl not in ("auto", "naive", "chunk"):
        raise ValueError(f"efficient_attention: unknown impl {impl!r}; choose auto, naive or chunk")
    if (initial_state is not None or output_final_state) and not causal:
        raise ValueError("efficient_attention: a state exists only for causal=True")
    if (initial_state is not None or output_final_state) and cu_seqlens is not None:
        raise ValueError("efficient_attention: states and cu_seqlens together are not supported")
    if torch.compiler.is_compiling():  # one opaque op (library.py) whose body comes back here, eagerly
        return efficient_attention_op(q, k, v, causal=causal, cu_seqlens=cu_seqlens, initial_state=initial_state,
                                      output_final_state=output_final_state, chunk_size=chunk_size, impl=impl)
    if impl == "naive":
        if initial_state is not None or output_final_state:
            raise ValueError("efficient_attention: impl='naive' carries no state")
        return efficient_attention_naive(q, k, v, causal=causal, cu_seqlens=cu_seqlens)
    if not causal:
        run = _noncausal
    else:
        def run(q, k, v):
            return causal_chunked(q, k, v, chunk_size, initial_state, output_final_state)
    if cu_seqlens is not None:
        return per_document(run, cu_seqlens, q, k, v)
    return run(q, k, v)


def _noncausal(q, k, v):
    """As published: two softmaxes, then a d × dv context per head."""
    q, k, v_acc = upcast(q, k, v)
    p = torch.softmax(q, dim=-1)
    a = torch.softmax(k, dim=1)
    context = torch.einsum("bjhc,bjhv->bhcv", a, v_acc)
    return torch.einsum("bthc,bhcv->bthv", p, context).to(v.dtype)


__all__ = ["efficient_attention", "efficient_attention_naive", "efficient_state", "combine_efficient_states"]
