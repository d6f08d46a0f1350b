"""Recurrent decayed linear attention: ``S_t = exp(g_t) S_{t−1} + k_t v_tᵀ``, ``o_t = q_tᵀ S_t``, one token at a time.

The decoding form (O(1) memory per generated token, state in and out). Packed documents run as a padded batch:
padding has g = 0 and k = 0, so it leaves the state as it was. Slow for long prompts — prefill with ``chunk``.
"""
from functools import partial

import torch

from ..linear_attention.normalize import normalized
from ..linear_attention.runs import repack, unpack


def decayed_linear_attention_recurrent(q, k, v, g, *, normalize, eps, cu_seqlens, initial_state, output_final_state,
                                       chunk_size=None):
    """``decayed_linear_attention`` token by token (``chunk_size`` is ignored)."""
    del chunk_size
    return normalized(partial(recurrent_core, g=g), q, k, v, causal=True, normalize=normalize, eps=eps,
                      cu_seqlens=cu_seqlens, initial_state=initial_state, output_final_state=output_final_state)


def recurrent_core(q, k, v, initial, cu_seqlens, output_final, *, g):
    """``o_t = q_tᵀ S_t`` over ``[B, T, H, *]`` with ``g [B, T, H]``, one step per token; returns the final ``S``."""
    (q, valid), (k, _), (v, _), (g, _) = (unpack(x, cu_seqlens) for x in (q, k, v, g.to(q.dtype)))
    S = initial if initial is not None else q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    alpha = g.exp()[..., None, None]
    outputs = []
    for t in range(q.shape[1]):
        S = alpha[:, t] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outputs.append(torch.einsum("nhk,nhkv->nhv", q[:, t], S))
    return repack(torch.stack(outputs, dim=1), valid), S
