"""The diagonal-plus-low-rank rule token by token, straight from the math (docs/MIXERS.md#dplr): the oracle.

``S_t = (Diag(e^{g_t}) + a_t b_tᵀ) S_{t−1} + k_t v_tᵀ``, ``o_t = S_tᵀ q_t``, with the transition written out as a
matrix. Every fast form (chunk, recurrent) is tested against this file, so it stays as plain as possible.
"""
import torch

from ..documents import document_slices
from ..precision import upcast


def dplr_naive(q, k, v, a, b, g, *, cu_seqlens, initial_state, output_final_state, chunk_size=None):
    """Same arguments and results as ``dplr_delta_rule`` (checked there); ``chunk_size`` is ignored."""
    del chunk_size
    pieces = [(row, slice(None)) for row in range(q.shape[0])] if cu_seqlens is None else [
        (0, piece) for piece in document_slices(cu_seqlens)]
    outputs, finals = [], []
    for doc, (row, piece) in enumerate(pieces):
        initial = None if initial_state is None else initial_state[doc]
        o, final = _one_sequence(*upcast(*(x[row, piece] for x in (q, k, v, a, b, g))), initial)
        outputs.append(o.to(q.dtype))
        finals.append(final)
    o = torch.stack(outputs) if cu_seqlens is None else torch.cat(outputs).unsqueeze(0)
    return (o, torch.stack(finals)) if output_final_state else o


def _one_sequence(q, k, v, a, b, g, initial):
    """One document ``[T, H, *]`` from ``initial [H, Dk, Dv]`` (None: zeros) → ``o [T, H, Dv]``, ``S [H, Dk, Dv]``."""
    length, heads, dk = k.shape
    S = q.new_zeros(heads, dk, v.shape[-1]) if initial is None else initial.to(q.dtype)
    outputs = []
    for t in range(length):
        transition = torch.diag_embed(g[t].exp()) + a[t][:, :, None] * b[t][:, None, :]  # [H, Dk, Dk]
        S = transition @ S + k[t][:, :, None] * v[t][:, None, :]
        outputs.append(torch.einsum("hkv,hk->hv", S, q[t]))
    return torch.stack(outputs), S
