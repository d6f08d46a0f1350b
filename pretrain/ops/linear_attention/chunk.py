"""Chunked parallel linear attention (REFERENCE §7): quadratic inside a chunk, a recurrent state between chunks.

The unnormalized core ``o_t = q_tᵀ S_t`` (``normalize.py`` builds the normalizations on it). Packed documents
share chunks: one chunk may hold the end of a document, several short ones and the start of the next. Inside a
chunk the C×C weights are masked to causal ∧ same document; between chunks the state handed on is that of the
document running into the next chunk — its sum so far, or its initial state where it begins.

The autograd Function keeps only q, k, v and the initial states; backward recomputes the T/C chunk states, so
activation memory is O(T·d) per head rather than O(T/C·d²). Two corrections sit outside it, as small gathers:
the tokens of a document that begins inside a chunk read that document's initial state, and a document's final
state adds its tokens in its last chunk to the state at that chunk's start.
"""
from functools import partial

import torch
import torch.nn.functional as F

from ..documents import document_ids
from .normalize import normalized
from .runs import gather_runs, repack, unpack


def linear_attention_chunk(q, k, v, *, causal, normalize, eps, cu_seqlens, initial_state, output_final_state,
                           chunk_size):
    """``linear_attention`` in chunks of ``chunk_size`` tokens; the non-causal form needs no chunks."""
    core = partial(chunked_core, chunk_size=chunk_size) if causal else global_core
    return normalized(core, q, k, v, normalize=normalize, eps=eps, cu_seqlens=cu_seqlens,
                      initial_state=initial_state, output_final_state=output_final_state)


def chunked_core(q, k, v, initial, cu_seqlens, output_final, *, chunk_size):
    """Causal ``o_t = q_tᵀ S_t`` over ``[B, T, H, *]`` and, if asked, each sequence's final ``S``."""
    batch, length, heads, _ = q.shape
    total = batch * length
    if cu_seqlens is None:
        cu = torch.arange(batch + 1, device=q.device) * length  # rows of a batch are documents of one stream
    else:
        cu = cu_seqlens.to(device=q.device, dtype=torch.long)
    q, k, v = (x.reshape(total, heads, x.shape[-1]) for x in (q, k, v))
    chunks = _Chunks(cu, total, chunk_size)
    padded_initial = None if initial is None else torch.cat([initial, torch.zeros_like(initial[:1])])  # row N: padding
    o, at_last_chunk = _ChunkScan.apply(q, k, v, padded_initial, chunks)

    starts, ends = cu[:-1], cu[1:]
    if initial is not None:  # documents that begin inside a chunk: there, their tokens read their own initial state
        inside = starts % chunk_size != 0
        run_start = starts[inside]
        run_end = torch.minimum(ends[inside], (run_start // chunk_size + 1) * chunk_size)
        rows, index, valid = gather_runs(q, run_start, run_end - run_start)
        reads = torch.einsum("mlhk,mhkv->mlhv", rows, initial[inside])
        o = o.index_add(0, index[valid], reads[valid])
    final = None
    if output_final:  # the state at the start of each document's last chunk, plus its tokens in that chunk
        last_start = chunks.last_chunk * chunk_size
        run_start = torch.maximum(starts, last_start)
        rows_k, _, _ = gather_runs(k, run_start, ends - run_start)
        rows_v, _, _ = gather_runs(v, run_start, ends - run_start)
        began_before = (starts < last_start)[:, None, None, None]
        base = torch.where(began_before, at_last_chunk, 0 if initial is None else initial)
        final = base + torch.einsum("mlhk,mlhv->mhkv", rows_k, rows_v)
    return o.view(batch, length, heads, -1), final


def global_core(q, k, v, initial, cu_seqlens, output_final):
    """Non-causal: every token reads its document's whole state, ``S_0 + Σ_j k_j v_jᵀ``."""
    (q, valid), (k, _), (v, _) = (unpack(x, cu_seqlens) for x in (q, k, v))
    S = torch.einsum("nlhk,nlhv->nhkv", k, v)
    if initial is not None:
        S = S + initial
    return repack(torch.einsum("nlhk,nhkv->nlhv", q, S), valid), S


class _Chunks:
    """Where the documents of a packed stream fall in chunks of C tokens (the tail padding is document N)."""

    def __init__(self, cu: torch.Tensor, total: int, size: int):
        self.size, self.total = size, total
        self.num_docs = cu.numel() - 1
        self.count = -(-total // size)
        doc = F.pad(document_ids(total, cu, cu.device), (0, self.count * size - total), value=self.num_docs)
        doc = doc.view(self.count, size)
        first = doc[:, 0]
        self.first_doc = int(first[0])
        self.next_doc = torch.cat([first[1:], first.new_full((1,), self.num_docs)])  # document at the next start
        self.carries = self.next_doc == first  # the document of this chunk's start runs into the next chunk
        self.restarts = torch.cat([self.carries.new_ones(1), ~self.carries[:-1]])  # chunk starts a document
        self.one_segment = bool(self.carries[:-1].all())  # one document runs through every chunk
        self.last_chunk = (cu[1:] - 1) // size  # the chunk holding each document's last token
        self.reads_state = (doc == first[:, None])[:, None, :, None]  # token continues the chunk-start document
        self.feeds_next = (doc == self.next_doc[:, None])[:, None, :, None]  # token's document runs on
        causal = torch.ones(size, size, dtype=torch.bool, device=cu.device).tril()
        self.mask = (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]  # [NC, 1, C, C]

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H, D]`` → ``[NC, H, C, D]``, zero-padded."""
        x = F.pad(x, (0, 0, 0, 0, 0, self.count * self.size - self.total))
        return x.view(self.count, self.size, *x.shape[1:]).transpose(1, 2).contiguous()

    def join(self, x: torch.Tensor) -> torch.Tensor:
        """``[NC, H, C, D]`` → ``[T, H, D]``."""
        return x.transpose(1, 2).reshape(self.count * self.size, *x.shape[1:2], x.shape[-1])[: self.total]


def _chunk_start_states(K, V, initial, chunks: _Chunks):
    """``[NC, H, D, Dv]``: the state of each chunk's first document before the chunk (initial state included)."""
    handed_on = (K * chunks.feeds_next).transpose(-1, -2) @ V  # what each chunk adds for the next one
    if initial is None:
        first = torch.zeros_like(handed_on[:1])
    else:
        first = initial[chunks.first_doc][None]
        handed_on = torch.where(chunks.carries[:, None, None, None], handed_on, handed_on + initial[chunks.next_doc])
    entering = torch.cat([first, handed_on[:-1]])  # what enters each chunk start
    return _segment_cumsum(entering, chunks.restarts, chunks.one_segment)


def _segment_cumsum(x: torch.Tensor, restart: torch.Tensor, one_segment: bool) -> torch.Tensor:
    """Inclusive cumsum along dim 0 that starts afresh wherever ``restart`` is True.

    With several segments it sums in fp64, so that subtracting the sum before a segment loses nothing that a
    sequential fp32 scan would keep.
    """
    if one_segment:
        return x.cumsum(0)
    total = x.double().cumsum(0)
    index = torch.arange(x.shape[0], device=x.device)
    first = torch.where(restart, index, 0).cummax(0).values  # start of each position's segment
    before = torch.where((first > 0)[:, None, None, None], total[(first - 1).clamp(min=0)], 0)
    return (total - before).to(x.dtype)


class _ChunkScan(torch.autograd.Function):
    """``o_t = q_tᵀ S_t`` by chunks; also the chunk-start state of each document's last chunk."""

    @staticmethod
    def forward(ctx, q, k, v, initial, chunks: _Chunks):
        Q, K, V = (chunks.split(x) for x in (q, k, v))
        states = _chunk_start_states(K, V, initial, chunks)
        o = (Q @ K.transpose(-1, -2)).mul_(chunks.mask) @ V
        o += (Q @ states).mul_(chunks.reads_state)
        ctx.save_for_backward(q, k, v, initial)
        ctx.chunks = chunks
        ctx.set_materialize_grads(False)
        return chunks.join(o), states[chunks.last_chunk]

    @staticmethod
    def backward(ctx, d_o, d_at_last_chunk):
        q, k, v, initial = ctx.saved_tensors
        chunks: _Chunks = ctx.chunks
        Q, K, V = (chunks.split(x) for x in (q, k, v))
        dO = chunks.split(d_o) if d_o is not None else torch.zeros_like(V)
        states = _chunk_start_states(K, V, initial, chunks)  # recomputed, never stored

        d_states = (Q * chunks.reads_state).transpose(-1, -2) @ dO
        if d_at_last_chunk is not None:
            d_states.index_add_(0, chunks.last_chunk, d_at_last_chunk)
        # reverse scan: the gradient of the state entering chunk c sums chunks c … to where its document stops
        d_entering = _segment_cumsum(d_states.flip(0), ~chunks.carries.flip(0), chunks.one_segment).flip(0)
        d_handed_on = torch.cat([d_entering[1:], torch.zeros_like(d_entering[:1])])  # enters chunk c + 1

        d_weights = (dO @ V.transpose(-1, -2)).mul_(chunks.mask)
        weights = (Q @ K.transpose(-1, -2)).mul_(chunks.mask)
        dQ = (dO @ states.transpose(-1, -2)).mul_(chunks.reads_state).add_(d_weights @ K)
        dK = (V @ d_handed_on.transpose(-1, -2)).mul_(chunks.feeds_next).add_(d_weights.transpose(-1, -2) @ Q)
        dV = (K @ d_handed_on).mul_(chunks.feeds_next).add_(weights.transpose(-1, -2) @ dO)
        d_initial = None
        if ctx.needs_input_grad[3]:
            d_initial = torch.zeros_like(initial)
            d_initial[chunks.first_doc] += d_entering[0]
            starts_doc = ~chunks.carries
            d_initial.index_add_(0, chunks.next_doc[starts_doc], d_handed_on[starts_doc])
        return chunks.join(dQ), chunks.join(dK), chunks.join(dV), d_initial, None
