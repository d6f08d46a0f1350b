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
chunk each way. The chunks are walked in blocks (about 2²⁰ numbers of temporaries each), run without autograd and
run again with it in backward (``ops/recompute.py``, as the delta rule's): backward keeps q, k, v, g and one
D×Dv state per block, ``4·(2D + Dv + 1)`` bytes per token and head in fp32 — 772 at D = Dv = 64 (1,036 divisive,
with v's column of ones and the quotient), plus the blocks' states (about H bytes at C = D = Dv = 64) — against
2,328 (2,600) when autograd kept the chunked copies of q, k, v, the chunk states and the C×C decay and weight
matrices (docs/CONTRACTS.md). The price: one more forward per block, in backward.
"""
from functools import partial

import torch

from ..documents import stream_offsets
from ..linear_attention.chunk import BLOCK_ELEMENTS, Chunks
from ..linear_attention.normalize import normalized
from ..linear_attention.runs import gather_runs
from ..recompute import bounded_blocks, in_blocks
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
    padded = None if initial is None else torch.cat([initial, torch.zeros_like(initial[:1])])  # row N: after the last
    entering = q.new_zeros(heads, k.shape[-1], v.shape[-1]) if initial is None else initial[chunks.first_doc]
    blocks = bounded_blocks(chunks.count, heads, chunk_size, max(k.shape[-1], v.shape[-1]), BLOCK_ELEMENTS)
    block = partial(_block, chunks=chunks, want_final=output_final)
    o, _, at_last_chunk = in_blocks(block, blocks, chunk_size, (q, k, v, g), entering, padded)

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
        base = torch.where(began_before, torch.cat(at_last_chunk), 0 if initial is None else initial)
        final = (rows_g.sum(1).exp()[..., None, None] * base
                 + torch.einsum("mlhk,mlhv->mhkv", rows_k * after.exp()[..., None], rows_v))
    return o.view(batch, length, heads, -1), final


def _block(lo: int, hi: int, q, k, v, g, entering, initial, *, chunks: Chunks, want_final: bool):
    """Chunks ``lo … hi-1`` (their tokens: q, k, v ``[≤ (hi − lo)·C, H, *]``, g ``[≤ (hi − lo)·C, H]``) from
    ``entering`` (the state of chunk lo's first document before it; ``initial`` padded with a zero row N) → their
    outputs (as many rows as q), the state entering chunk hi and, when ``want_final``, the states entering the last
    chunks of the documents that end in them."""
    count = hi - lo
    Q, K, V = (chunks.split(x, 0, count) for x in (q, k, v))  # [n, H, C, D]
    gates = chunks.split(g[..., None], 0, count)[..., 0]  # [n, H, C]
    b = gates.cumsum(-1)  # log-decay from the chunk's start through each token
    exponent = (b[..., :, None] - b[..., None, :]).masked_fill(~chunks.mask[lo:hi], float("-inf"))
    o = ((Q @ K.transpose(-1, -2)) * exponent.exp()) @ V

    feeds_next = chunks.feeds_next[lo:hi, ..., 0]  # [n, 1, C]: the token's document runs into the next chunk
    to_end = (b[..., -1:] - b).exp() * feeds_next
    handed_on = (K * to_end[..., None]).transpose(-1, -2) @ V  # what the chunk's tail document hands on
    carries = chunks.carries[lo:hi, None]  # [n, 1]
    if initial is not None:  # a document starting in (or right after) the chunk hands on its initial state, decayed
        tail_decay = torch.where(carries, 0.0, (gates * feeds_next).sum(-1).exp())  # [n, H]
        handed_on = handed_on + tail_decay[..., None, None] * initial[chunks.next_doc[lo:hi]]
    runs_on = torch.where(carries, b[..., -1].exp(), 0.0)  # [n, H]: decay of the carried state

    states = _DecayedScan.apply(runs_on, handed_on, entering)  # [n + 1, H, D, Dv]
    reads = b.exp() * chunks.reads_state[lo:hi, ..., 0]  # [n, H, C]: the token continues the chunk-start document
    o = o + (Q * reads[..., None]) @ states[:-1]
    rows = o.transpose(1, 2).reshape(count * chunks.size, o.shape[1], o.shape[-1])[: q.shape[0]]
    after = states[-1].clone()  # not a view: the next block keeps it, and must not keep this block's states
    if not want_final:
        return rows, after
    _, at = chunks.ending_in(lo, hi)
    return rows, after, states[at]


class _DecayedScan(torch.autograd.Function):
    """``E [n + 1, H, D, Dv]`` with ``E_0 = first`` and ``E_{c+1} = decay_c·E_c + handed_c``: the states entering a
    block's n chunks and the one after them, one fused op per chunk each way. (Autograd through a Python loop records
    several small ops per chunk, whose overhead, not their arithmetic, dominated at long T.)"""

    @staticmethod
    def forward(ctx, decay, handed, first):
        states = handed.new_empty(handed.shape[0] + 1, *handed.shape[1:])
        states[0] = first
        for c in range(handed.shape[0]):
            torch.addcmul(handed[c], states[c], decay[c, :, None, None], out=states[c + 1])
        ctx.save_for_backward(decay, states)
        return states

    @staticmethod
    def backward(ctx, grad):
        """``dE_c = grad_c + decay_c·dE_{c+1}``; ``handed_c`` and ``decay_c`` reach ``E_{c+1}``."""
        decay, states = ctx.saved_tensors
        d_states = torch.empty_like(states)
        d_states[-1] = grad[-1]
        for c in range(decay.shape[0] - 1, -1, -1):
            torch.addcmul(grad[c], d_states[c + 1], decay[c, :, None, None], out=d_states[c])
        d_decay = (d_states[1:] * states[:-1]).sum((-1, -2))
        return d_decay, d_states[1:], d_states[0] if ctx.needs_input_grad[2] else None
