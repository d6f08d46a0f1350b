"""The O(T²) definition of decayed linear attention, straight from the math (docs/MIXERS.md#decay): the oracle.

Per document and head, with ``G_t = g_1 + … + g_t`` counted from the document's start,
``o_t = Σ_{j ≤ t} exp(G_t − G_j) (q_t·k_j) v_j + exp(G_t) q_tᵀ S_0``: one ``[T, T]`` decay matrix, its exponent
masked to −∞ above the diagonal before ``exp``. Computed in fp32 (fp64 stays fp64), no tricks.
"""
import torch

from ..documents import document_slices
from ..linear_attention.state import LinearAttentionState
from ..precision import upcast


def decayed_linear_attention_naive(q, k, v, g, *, normalize, eps, cu_seqlens, initial_state, output_final_state,
                                   chunk_size=None):
    """Same arguments and results as ``decayed_linear_attention`` (g ``[B, T, H]``); ``chunk_size`` is ignored."""
    del chunk_size
    pieces = [(b, slice(None)) for b in range(q.shape[0])] if cu_seqlens is None else [
        (0, piece) for piece in document_slices(cu_seqlens)]
    outputs, finals = [], []
    for doc, (row, piece) in enumerate(pieces):
        initial = None if initial_state is None else LinearAttentionState(
            *(None if s is None else s[doc] for s in initial_state))
        o, final = _one_sequence(*upcast(q[row, piece], k[row, piece], v[row, piece], g[row, piece]), initial,
                                 normalize=normalize, eps=eps)
        outputs.append(o.to(q.dtype))
        finals.append(final)
    o = torch.stack(outputs) if cu_seqlens is None else torch.cat(outputs).unsqueeze(0)
    if not output_final_state:
        return o
    return o, LinearAttentionState(*(None if f[0] is None else torch.stack(f) for f in zip(*finals)))


def _one_sequence(q, k, v, g, initial, *, normalize, eps):
    """One document: q, k ``[T, H, D]``, v ``[T, H, Dv]``, g ``[T, H]``; ``initial`` its state (None for zeros)."""
    length, heads, dk = q.shape
    G = g.cumsum(0).transpose(0, 1)  # [H, T]
    later = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
    decay = (G[:, :, None] - G[:, None, :]).masked_fill(later, float("-inf")).exp()  # [H, t, j]: exp(G_t − G_j)
    weights = torch.einsum("thd,jhd->htj", q, k) * decay
    from_start = G.exp().transpose(0, 1)  # [T, H]: exp(G_t), what is left of S_0 at t
    to_end = (G[:, -1:] - G).exp().transpose(0, 1)  # [T, H]: exp(G_T − G_j), what is left of token j at the end
    S0 = q.new_zeros(heads, dk, v.shape[-1]) if initial is None else initial.S.to(q.dtype)
    num = torch.einsum("htj,jhv->thv", weights, v) + from_start[..., None] * torch.einsum("thd,hdv->thv", q, S0)
    final_S = from_start[-1][:, None, None] * S0 + torch.einsum("jh,jhd,jhv->hdv", to_end, k, v)
    if normalize == "none":
        return num, LinearAttentionState(final_S)
    z0 = q.new_zeros(heads, dk) if initial is None else initial.z.to(q.dtype)
    den = weights.sum(-1).transpose(0, 1) + from_start * torch.einsum("thd,hd->th", q, z0)  # q_t·z_t
    final_z = from_start[-1][:, None] * z0 + torch.einsum("jh,jhd->hd", to_end, k)
    return num / (den + eps)[..., None], LinearAttentionState(final_S, final_z)
