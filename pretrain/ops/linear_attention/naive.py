"""The O(T²) definition of linear attention, straight from the math (docs/MIXERS.md#linear, #inline): the oracle.

Every fast form (chunk, recurrent, triton) is tested against this file, so it is kept as plain as possible:
one ``[T, T]`` weight matrix per document and head, computed in fp32 (fp64 stays fp64), no tricks.
"""
import torch

from ..documents import document_slices
from ..precision import upcast
from .state import LinearAttentionState, zero_state


def linear_attention_naive(
    q, k, v, *, causal=True, normalize="divisive", eps=1e-6, cu_seqlens=None, initial_state=None,
    output_final_state=False, chunk_size=None,
):
    """Same arguments and results as ``linear_attention``; ``chunk_size`` is ignored (there are no chunks)."""
    del chunk_size
    batch = q.shape[0]
    pieces = [(b, slice(None)) for b in range(batch)] if cu_seqlens is None else [
        (0, piece) for piece in document_slices(cu_seqlens)]
    outputs, finals = [], []
    for doc, (row, piece) in enumerate(pieces):
        initial = None if initial_state is None else LinearAttentionState(
            *(None if s is None else s[doc] for s in initial_state))
        o, final = _one_sequence(*upcast(q[row, piece], k[row, piece], v[row, piece]), initial,
                                 causal=causal, normalize=normalize, eps=eps)
        outputs.append(o.to(q.dtype))
        finals.append(final)
    o = torch.stack(outputs) if cu_seqlens is None else torch.cat(outputs).unsqueeze(0)
    if not output_final_state:
        return o
    return o, LinearAttentionState(*(None if f[0] is None else torch.stack(f) for f in zip(*finals)))


def _one_sequence(q, k, v, initial, *, causal, normalize, eps):
    """One document, ``[T, H, D]``; ``initial`` holds this document's state (or None for zeros)."""
    length, heads, dk = q.shape
    zeros = zero_state(1, heads, dk, v.shape[-1], "subtractive", dtype=q.dtype, device=q.device)
    given = initial or LinearAttentionState(None)  # absent fields start at zero
    S0, z0, u0, n0 = (zero[0] if s is None else s.to(q.dtype) for s, zero in zip(given, zeros))
    visible = torch.ones(length, length, dtype=q.dtype, device=q.device)
    if causal:
        visible = visible.tril()  # row t sees columns j ≤ t
    weights = torch.einsum("thd,jhd->htj", q, k) * visible  # φ(q_t)·φ(k_j) where visible
    num = torch.einsum("htj,jhv->thv", weights, v) + torch.einsum("thd,hdv->thv", q, S0)  # φ(q_t)ᵀ S_t
    final_S = S0 + torch.einsum("jhd,jhv->hdv", k, v)
    if normalize == "none":
        return num, LinearAttentionState(final_S)
    den = weights.sum(-1).transpose(0, 1) + torch.einsum("thd,hd->th", q, z0)  # φ(q_t)·z_t
    final_z = z0 + k.sum(0)
    if normalize == "divisive":
        return num / (den + eps)[..., None], LinearAttentionState(final_S, final_z)
    n = visible.sum(-1)[:, None] + n0  # n_t, tokens seen (per head, as the state keeps it)
    u = torch.einsum("tj,jhv->thv", visible, v) + u0  # u_t = Σ v_j
    o = num / n[..., None] + (1 - den / n)[..., None] * u / n[..., None]
    return o, LinearAttentionState(final_S, final_z, u0 + v.sum(0), n0 + length)
