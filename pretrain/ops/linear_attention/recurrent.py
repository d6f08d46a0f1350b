"""Recurrent linear attention (docs/MIXERS.md#linear): ``S_t = S_{t-1} + φ(k_t) v_tᵀ``, one token at a time.

The decoding form: O(1) memory per generated token, state in and out. Packed documents run as a padded batch
(padding adds nothing to the state). Slow for long prompts — prefill with ``chunk`` and continue from its state.
"""
import torch

from .normalize import normalized
from .runs import repack, unpack


def linear_attention_recurrent(q, k, v, *, causal, normalize, eps, cu_seqlens, initial_state,
                               output_final_state, chunk_size=None):
    """``linear_attention`` token by token; causal only (``chunk_size`` is ignored)."""
    del chunk_size
    if not causal:
        raise ValueError("impl='recurrent' is causal only; use impl='chunk' or 'naive' for causal=False")
    return normalized(recurrent_core, q, k, v, causal=True, normalize=normalize, eps=eps, cu_seqlens=cu_seqlens,
                      initial_state=initial_state, output_final_state=output_final_state)


def recurrent_core(q, k, v, initial, cu_seqlens, output_final):
    """Causal ``o_t = q_tᵀ S_t`` over ``[B, T, H, *]``, one step per token; returns the final ``S``."""
    (q, valid), (k, _), (v, _) = (unpack(x, cu_seqlens) for x in (q, k, v))
    S = initial if initial is not None else q.new_zeros(*q.shape[:1], q.shape[2], q.shape[3], v.shape[3])
    outputs = []
    for t in range(q.shape[1]):
        S = S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outputs.append(torch.einsum("nhk,nhkv->nhv", q[:, t], S))
    return repack(torch.stack(outputs, dim=1), valid), S
