"""The gated delta rule token by token, straight from the math (docs/MIXERS.md#deltanet): the oracle.

``S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ``, ``o_t = S_tᵀ q_t``, with the transition written out as a
matrix. Every fast form (chunk, recurrent) is tested against this file, so it stays as plain as possible.
"""
import torch

from ..documents import document_slices
from ..precision import upcast


def delta_rule_naive(q, k, v, beta, g, *, cu_seqlens, initial_state, output_final_state, chunk_size=None):
    """Same arguments and results as ``delta_rule`` (checked there); ``chunk_size`` is ignored."""
    del chunk_size
    pieces = [(b, slice(None)) for b in range(q.shape[0])] if cu_seqlens is None else [
        (0, piece) for piece in document_slices(cu_seqlens)]
    outputs, finals = [], []
    for doc, (row, piece) in enumerate(pieces):
        initial = None if initial_state is None else initial_state[doc]
        o, final = _one_sequence(*upcast(q[row, piece], k[row, piece], v[row, piece], beta[row, piece],
                                         g[row, piece]), initial)
        outputs.append(o.to(q.dtype))
        finals.append(final)
    o = torch.stack(outputs) if cu_seqlens is None else torch.cat(outputs).unsqueeze(0)
    return (o, torch.stack(finals)) if output_final_state else o


def _one_sequence(q, k, v, beta, g, initial):
    """One document ``[T, H, *]`` from ``initial [H, Dk, Dv]`` (None: zeros) → ``o [T, H, Dv]``, ``S [H, Dk, Dv]``."""
    length, heads, dk = k.shape
    S = q.new_zeros(heads, dk, v.shape[-1]) if initial is None else initial.to(q.dtype)
    eye = torch.eye(dk, dtype=q.dtype, device=q.device)
    outputs = []
    for t in range(length):
        k_t, b_t, alpha_t = k[t], beta[t][:, None, None], g[t].exp()[:, None, None]
        transition = alpha_t * (eye - b_t * k_t[:, :, None] * k_t[:, None, :])  # [H, Dk, Dk]
        S = transition @ S + b_t * k_t[:, :, None] * v[t][:, None, :]
        outputs.append(torch.einsum("hkv,hk->hv", S, q[t]))
    return torch.stack(outputs), S
