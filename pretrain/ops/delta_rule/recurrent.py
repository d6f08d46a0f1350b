"""The gated delta rule one token at a time, as rank-1 updates: the decoding form (docs/MIXERS.md#deltanet).

O(1) memory per generated token, state in and out. Packed documents run as a padded batch: a padding slot has
β = 0 and g = 0, an identity transition that adds nothing. Slow for long prompts — prefill with ``chunk``.
"""
import torch

from ..linear_attention.runs import repack, unpack
from ..precision import upcast


def delta_rule_recurrent(q, k, v, beta, g, *, cu_seqlens, initial_state, output_final_state, chunk_size=None):
    """Same arguments and results as ``delta_rule`` (checked there); ``chunk_size`` is ignored."""
    del chunk_size
    dtype = q.dtype
    (q, valid), (k, _), (v, _), (beta, _), (g, _) = (unpack(x, cu_seqlens) for x in upcast(q, k, v, beta, g))
    S = q.new_zeros(*q.shape[:1], q.shape[2], q.shape[3], v.shape[3]) if initial_state is None else \
        initial_state.to(q.dtype)
    outputs = []
    for t in range(q.shape[1]):
        k_t, alpha_t, b_t = k[:, t], g[:, t].exp()[..., None, None], beta[:, t][..., None]
        S = alpha_t * S  # α_t S_{t−1}, then replace what it predicts for k_t by v_t, a β_t part of the way
        error = v[:, t] - torch.einsum("nhkv,nhk->nhv", S, k_t)
        S = S + k_t[..., :, None] * (b_t * error)[..., None, :]
        outputs.append(torch.einsum("nhkv,nhk->nhv", S, q[:, t]))
    o = repack(torch.stack(outputs, dim=1), valid).to(dtype)
    return (o, S) if output_final_state else o
