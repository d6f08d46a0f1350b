"""The diagonal-plus-low-rank rule token by token as rank-1 updates (docs/MIXERS.md#dplr): decoding's form.

Packed documents run as a zero-padded batch, as the delta rule's recurrent form: a padding slot has a = k = 0 and
g = 0, an identity transition that adds nothing. Slow for long prompts — prefill with ``chunk``.
"""
import torch

from ..linear_attention.runs import repack, unpack
from ..precision import upcast


def dplr_recurrent(q, k, v, a, b, g, *, cu_seqlens, initial_state, output_final_state, chunk_size=None):
    """Same arguments and results as ``dplr_delta_rule`` (checked there); ``chunk_size`` is ignored."""
    del chunk_size
    dtype = q.dtype
    (q, valid), (k, _), (v, _), (a, _), (b, _), (g, _) = (unpack(x, cu_seqlens) for x in upcast(q, k, v, a, b, g))
    S = q.new_zeros(*q.shape[:1], q.shape[2], q.shape[3], v.shape[3]) if initial_state is None else \
        initial_state.to(q.dtype)
    outputs = []
    for t in range(q.shape[1]):
        read = torch.einsum("nhkv,nhk->nhv", S, b[:, t])  # b_tᵀ S_{t−1}, before the decay
        S = g[:, t].exp()[..., None] * S + a[:, t][..., :, None] * read[..., None, :] \
            + k[:, t][..., :, None] * v[:, t][..., None, :]
        outputs.append(torch.einsum("nhkv,nhk->nhv", S, q[:, t]))
    o = repack(torch.stack(outputs, dim=1), valid).to(dtype)
    return (o, S) if output_final_state else o
