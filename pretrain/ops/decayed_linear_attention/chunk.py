"""Chunked decayed linear attention (docs/MIXERS.md#decay): quadratic inside a chunk, a decayed state between chunks.

Within a chunk, ``b_i`` is the log-decay from the chunk's start through token i (a cumsum of g). Token i reads
token j of its chunk with weight ``exp(b_i − b_j)``: the exponent is built in log space and masked to −∞ outside
causal ∧ same document *before* ``exp``, so no factor ``exp(−b_j)`` ever overflows (it would once the cumulative
log-decay passes ~−88 in fp32), and every exponent that reaches ``exp`` is ≤ 0. Token i reads the state entering
its chunk with weight ``exp(b_i)``; the state handed to the next chunk is the chunk's tokens weighted by
``exp(b_last − b_j)`` plus the entering state times ``exp(b_last)`` (when the document runs on). Packed documents
share chunks as in ``ops/linear_attention/chunk.py``, whose layout (``Chunks``) this module reuses; each document
starts from its own initial state, decayed by its own tokens only.

Gradients are autograd's (exact), except through the scan across chunks, a small Function with one fused op per
chunk each way. Unlike the undecayed op, which keeps only q, k, v and recomputes its chunk states in backward,
autograd keeps the chunked copies of q, k, v, the per-chunk states and the C×C decay and weight matrices: measured
at C = 64, D = Dv = 64 in fp32, 2,328 bytes per token and head (2,600 divisive) against the undecayed op's 768
(1,036) — about 3× the activation memory (docs/CONTRACTS.md).
"""
from functools import partial

import torch
import torch.nn.functional as F

from ..documents import stream_offsets
from ..linear_attention.chunk import Chunks
from ..linear_attention.normalize import normalized
from ..linear_attention.runs import gather_runs
from .state import log_decay_after


def decayed_linear_attention_chunk(q, k, v, g, *, normalize, eps, cu_seqlens, initial_state, output_final_state,
                                   chunk_size):
    """``decayed_linear_attention`` in chunks of ``chunk_size`` tokens (g ``[B, T, H]``)."""
    return normalized(partial(chunked_core, g=g, chunk_size=chunk_size), q, k, v, causal=True, normalize=normalize,
                      eps=eps, cu_seqlens=cu_seqlens, initial_state=initial_state,
                      output_final_state=output_final_state)


def chunked_core(q, k, v, initial, cu_seqlens, output_final, *, g, chunk_size):
    """``o_t = q_tᵀ S_t`` over ``[B, T, H, *]`` with ``S_t = exp(g_t) S_{t−1} + k_t v_tᵀ``; and, if asked, each
    sequence's (document's) final ``S``."""
    batch, length, heads, _ = q.shape
    total = batch * length
    cu = stream_offsets(batch, length, cu_seqlens, q.device)
    q, k, v = (x.reshape(total, heads, x.shape[-1]) for x in (q, k, v))
    g = g.to(q.dtype).reshape(total, heads)
    chunks = Chunks(cu, total, chunk_size)
    o, entering = _chunk_scan(q, k, v, g, initial, chunks)

    starts, ends = cu[:-1], cu[1:]
    if initial is not None:  # documents that begin inside a chunk read their own initial state, decayed from start
        inside = starts % chunk_size != 0
        run_start = starts[inside]
        run_end = torch.minimum(ends[inside], (run_start // chunk_size + 1) * chunk_size)
        rows_q, index, valid = gather_runs(q, run_start, run_end - run_start)
        rows_g, _, _ = gather_runs(g, run_start, run_end - run_start)
        reads = torch.einsum("mlhk,mhkv->mlhv", rows_q * rows_g.cumsum(1).exp()[..., None], initial[inside])
        o = o.index_add(0, index[valid], reads[valid])
    final = None
    if output_final:  # the state entering each document's last chunk, decayed and added to by its tokens there
        last_start = chunks.last_chunk * chunk_size
        run_start = torch.maximum(starts, last_start)
        rows_k, rows_v, rows_g = (gather_runs(x, run_start, ends - run_start)[0] for x in (k, v, g))
        after = log_decay_after(rows_g)  # zeros past each run: its tokens' decay to the document's end
        began_before = (starts < last_start)[:, None, None, None]
        base = torch.where(began_before, entering[chunks.last_chunk], 0 if initial is None else initial)
        final = (rows_g.sum(1).exp()[..., None, None] * base
                 + torch.einsum("mlhk,mlhv->mhkv", rows_k * after.exp()[..., None], rows_v))
    return o.view(batch, length, heads, -1), final


def _chunk_scan(q, k, v, g, initial, chunks: Chunks):
    """``o [T, H, Dv]`` from the chunk-start documents' states and the chunks' own tokens, and those states
    ``[n, H, D, Dv]`` (the state of each chunk's first document before the chunk)."""
    count, size = chunks.count, chunks.size
    Q, K, V = (chunks.split(x, 0, count) for x in (q, k, v))  # [n, H, C, D]
    gates = chunks.split(g[..., None], 0, count)[..., 0]  # [n, H, C]
    b = gates.cumsum(-1)  # log-decay from the chunk's start through each token
    exponent = (b[..., :, None] - b[..., None, :]).masked_fill(~chunks.mask, float("-inf"))
    o = ((Q @ K.transpose(-1, -2)) * exponent.exp()) @ V

    feeds_next = chunks.feeds_next[..., 0]  # [n, 1, C]: the token's document runs into the next chunk
    to_end = (b[..., -1:] - b).exp() * feeds_next
    handed_on = (K * to_end[..., None]).transpose(-1, -2) @ V  # what the chunk's tail document hands on
    if initial is not None:  # a document starting in (or right after) the chunk hands on its initial state, decayed
        padded = torch.cat([initial, torch.zeros_like(initial[:1])])  # row N: after the last document
        tail_decay = torch.where(chunks.carries[:, None], 0.0, (gates * feeds_next).sum(-1).exp())  # [n, H]
        handed_on = handed_on + tail_decay[..., None, None] * padded[chunks.next_doc]
    runs_on = torch.where(chunks.carries[:, None], b[..., -1].exp(), 0.0)  # [n, H]: decay of the carried state

    first = q.new_zeros(q.shape[1], k.shape[-1], v.shape[-1]) if initial is None else initial[chunks.first_doc]
    entering = _DecayedScan.apply(runs_on, handed_on, first)
    reads = b.exp() * chunks.reads_state[..., 0]  # [n, H, C]: the token continues the chunk-start document
    o = o + (Q * reads[..., None]) @ entering
    return o.transpose(1, 2).reshape(count * size, *o.shape[1:2], o.shape[-1])[: q.shape[0]], entering


class _DecayedScan(torch.autograd.Function):
    """``E [n, H, D, Dv]`` with ``E_0 = first`` and ``E_{c+1} = decay_c·E_c + handed_c``: the states entering the
    chunks, one fused op per chunk each way. (Autograd through a Python loop records several small ops per chunk,
    whose overhead, not their arithmetic, dominated at long T.)"""

    @staticmethod
    def forward(ctx, decay, handed, first):
        states = handed.new_empty(handed.shape)
        states[0] = first
        for c in range(1, handed.shape[0]):
            torch.addcmul(handed[c - 1], states[c - 1], decay[c - 1, :, None, None], out=states[c])
        ctx.save_for_backward(decay, states)
        return states

    @staticmethod
    def backward(ctx, grad):
        """``dE_c = grad_c + decay_c·dE_{c+1}``; ``handed_c`` and ``decay_c`` reach ``E_{c+1}`` (the last ones reach
        nothing returned)."""
        decay, states = ctx.saved_tensors
        d_states = torch.empty_like(states)
        d_states[-1] = grad[-1]
        for c in range(states.shape[0] - 2, -1, -1):
            torch.addcmul(grad[c], d_states[c + 1], decay[c, :, None, None], out=d_states[c])
        d_handed = torch.cat([d_states[1:], torch.zeros_like(d_states[:1])])
        d_decay = F.pad((d_states[1:] * states[:-1]).sum((-1, -2)), (0, 0, 0, 1))
        return d_decay, d_handed, d_states[0] if ctx.needs_input_grad[2] else None
