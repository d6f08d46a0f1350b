"""Decayed linear attention: ``S_t = exp(g_t) S_{t−1} + k_t v_tᵀ``, ``o_t = q_tᵀ S_t`` (docs/MIXERS.md#decay).

The state forgets at a rate given in log space, ``g ≤ 0``: a constant per head ``[H]`` (RetNet, Lightning
Attention) or a gate per token and head ``[B, T, H]`` (Mamba-2, simple GLA), applied at token t before k_t v_tᵀ is
added — flash-linear-attention's ``chunk_simple_gla`` convention without its scale, so one can be checked against the
other. A sibling of ``ops.linear_attention``: it shares that family's state type, its normalization-by-augmented-v
(``normalize.py``), its packed-document layout (``Chunks``) and runs (``runs.py``).

One public entry, ``decayed_linear_attention``, checks its inputs once and hands them to ``naive`` (the O(T²)
definition with the decay matrix, the oracle), ``chunk`` (chunked parallel form) or ``recurrent`` (token by
token, for decoding); each exposes ``decayed_linear_attention_<impl>(q, k, v, g, *, normalize, eps, cu_seqlens,
initial_state, output_final_state, chunk_size)`` with g already ``[B, T, H]``.
"""
import torch

from ..linear_attention import check_inputs, check_offsets
from ..linear_attention.state import LinearAttentionState, check_state
from .chunk import decayed_linear_attention_chunk
from .naive import decayed_linear_attention_naive
from .recurrent import decayed_linear_attention_recurrent

NORMALIZATIONS = ("none", "divisive")
IMPLS = ("auto", "naive", "chunk", "recurrent")
_RUN = {"naive": decayed_linear_attention_naive, "chunk": decayed_linear_attention_chunk,
        "recurrent": decayed_linear_attention_recurrent}


def decayed_linear_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *, normalize: str = "none",
    eps: float = 1e-6, cu_seqlens: torch.Tensor | None = None, initial_state: LinearAttentionState | None = None,
    output_final_state: bool = False, chunk_size: int = 64, impl: str = "auto",
):
    """Causal decayed linear attention over q, k ``[B, T, H, D]`` (already feature-mapped and scaled), v
    ``[B, T, H, Dv]`` and the log-decay g ``[H]`` or ``[B, T, H]`` (finite, ≤ 0).

    normalize: ``none`` (q_tᵀS_t) or ``divisive`` (q_tᵀS_t / (q_t·z_t + eps), with ``z_t = exp(g_t) z_{t−1} + k_t``
    decaying as S does). cu_seqlens: int offsets of packed documents along T (B = 1); each document starts from
    its own initial state (zeros by default) and its decay starts there. initial_state / output_final_state: a
    ``LinearAttentionState`` (S, and z when divisive) per sequence or document. Returns ``o`` in the input dtype,
    or ``(o, final_state)`` with an fp32 state (fp64 for fp64 inputs).
    """
    if normalize == "subtractive":
        raise ValueError("normalize='subtractive' does not combine with decay: InLine's correction divides by the "
                         "count of tokens seen and subtracts their plain mean, which a decaying state no longer "
                         f"holds; use one of {NORMALIZATIONS}")
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS} for decayed_linear_attention; got {normalize!r}")
    if impl == "triton":
        raise ValueError("decayed_linear_attention has no Triton kernel (ours covers only the undecayed op); on CUDA "
                         "use impl='chunk', or flash-linear-attention's chunk_simple_gla (issue 30)")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
    check_inputs(q, k, v, normalize, cu_seqlens, chunk_size, impl)
    g = _checked_decay(g, q)
    if cu_seqlens is not None:
        check_offsets(cu_seqlens, q.shape[1])
    if initial_state is not None:
        num = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        initial_state = check_state(initial_state, num, q.shape[2], q.shape[3], v.shape[3], normalize)
    run = _RUN["chunk" if impl == "auto" else impl]
    return run(q, k, v, g, normalize=normalize, eps=eps, cu_seqlens=cu_seqlens, initial_state=initial_state,
               output_final_state=output_final_state, chunk_size=chunk_size)


def _checked_decay(g: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """g as ``[B, T, H]``, refusing a shape, dtype or value that is not a log-decay."""
    batch, length, heads, _ = q.shape
    if not isinstance(g, torch.Tensor) or not g.is_floating_point():
        raise ValueError(f"g (the log-decay) must be a floating tensor; got {getattr(g, 'dtype', type(g).__name__)}")
    if tuple(g.shape) not in ((heads,), (batch, length, heads)):
        raise ValueError(f"g (the log-decay) must be [H] = [{heads}] or [B, T, H] = [{batch}, {length}, {heads}]; "
                         f"got {tuple(g.shape)}")
    if not bool(torch.isfinite(g).all()) or bool((g > 0).any()):
        raise ValueError("g is a log-decay: every value must be finite and ≤ 0 (exp(g) in (0, 1]); got "
                         f"min {g.min().item():.3g}, max {g.max().item():.3g}")
    return g.expand(batch, length, heads)


__all__ = ["decayed_linear_attention", "LinearAttentionState", "NORMALIZATIONS", "IMPLS"]
