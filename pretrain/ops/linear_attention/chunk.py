"""Chunked parallel linear attention (docs/MIXERS.md#chunked): quadratic inside a chunk, a state between chunks.

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

from ..documents import causal_same_document, chunked_document_ids, stream_offsets
from .normalize import normalized
from .runs import gather_runs, repack, unpack


def linear_attention_chunk(q, k, v, *, causal, normalize, eps, cu_seqlens, initial_state, output_final_state,
                           chunk_size):
    """``linear_attention`` in chunks of ``chunk_size`` tokens; the non-causal form needs no chunks."""
    core = partial(chunked_core, chunk_size=chunk_size) if causal else global_core
    return normalized(core, q, k, v, causal=causal, normalize=normalize, eps=eps, cu_seqlens=cu_seqlens,
                      initial_state=initial_state, output_final_state=output_final_state)


def chunked_core(q, k, v, initial, cu_seqlens, output_final, *, chunk_size):
    """Causal ``o_t = q_tᵀ S_t`` over ``[B, T, H, *]`` and, if asked, each sequence's final ``S``."""
    batch, length, heads, _ = q.shape
    total = batch * length
    cu = stream_offsets(batch, length, cu_seqlens, q.device)
    q, k, v = (x.reshape(total, heads, x.shape[-1]) for x in (q, k, v))
    chunks = Chunks(cu, total, chunk_size)
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


# On CPU, walk blocks of chunks whose C×C and d×dv temporaries hold about this many numbers: they stay in cache
# and in the allocator's reused memory (fresh large buffers cost a page fault per 4 KiB). CUDA takes all at once.
BLOCK_ELEMENTS = 1 << 20


class Chunks:
    """Where the documents of a packed stream fall in chunks of C tokens (the tail padding is a document of its
    own; the state entering after the last chunk is the initial states' padding row N)."""

    def __init__(self, cu: torch.Tensor, total: int, size: int):
        self.size, self.total = size, total
        self.num_docs = cu.numel() - 1
        doc = chunked_document_ids(total, cu, size, cu.device)
        self.count = doc.shape[0]
        first = doc[:, 0]
        self.first_doc = int(first[0])
        self.next_doc = torch.cat([first[1:], first.new_full((1,), self.num_docs)])  # after the last: row N, zeros
        self.carries = self.next_doc == first  # the document of this chunk's start runs into the next chunk
        self.carries_list = self.carries.tolist()
        self.last_chunk = (cu[1:] - 1) // size  # the chunk holding each document's last token
        self.reads_state = (doc == first[:, None])[:, None, :, None]  # token continues the chunk-start document
        self.feeds_next = (doc == self.next_doc[:, None])[:, None, :, None]  # token's document runs on
        self.mask = causal_same_document(doc)[:, None]  # [NC, 1, C, C]

    def blocks(self, heads: int, width: int) -> list[tuple[int, int]]:
        """Consecutive ranges of chunks, small enough on CPU that their temporaries stay in cache-sized buffers."""
        step = self.count
        if self.mask.device.type == "cpu":
            step = max(1, BLOCK_ELEMENTS // (heads * self.size * max(self.size, width)))
        return [(lo, min(lo + step, self.count)) for lo in range(0, self.count, step)]

    def split(self, x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Chunks ``lo … hi-1`` of ``x [T, H, D]`` as ``[hi - lo, H, C, D]``, zero-padded past the end."""
        piece = x[lo * self.size: hi * self.size]
        piece = F.pad(piece, (0, 0, 0, 0, 0, (hi - lo) * self.size - piece.shape[0]))
        return piece.view(hi - lo, self.size, *x.shape[1:]).transpose(1, 2).contiguous()

    def join(self, out: torch.Tensor, x: torch.Tensor, lo: int):
        """Write chunks ``[n, H, C, D]`` starting at chunk ``lo`` back into the rows of ``out [T, H, D]``."""
        rows = out[lo * self.size: (lo + x.shape[0]) * self.size]
        rows.copy_(x.transpose(1, 2).reshape(-1, *x.shape[1:2], x.shape[-1])[: rows.shape[0]])

    def ending_in(self, lo: int, hi: int):
        """The documents whose last chunk lies in ``lo … hi-1``, and that chunk's index within the block."""
        docs = ((self.last_chunk >= lo) & (self.last_chunk < hi)).nonzero().squeeze(1)
        return docs, self.last_chunk[docs] - lo


def _block_states(K, V, initial, entering, chunks: Chunks, lo: int, hi: int):
    """For chunks ``lo … hi-1``: the state of each chunk's first document before the chunk (``entering`` is the
    one before chunk ``lo``), what each chunk hands on, and the state entering chunk ``hi``."""
    handed_on = (K * chunks.feeds_next[lo:hi]).transpose(-1, -2) @ V
    starts = ~chunks.carries[lo:hi]  # the next chunk begins with a new document: hand on its initial state
    if initial is not None:
        handed_on = handed_on + starts[:, None, None, None] * initial[chunks.next_doc[lo:hi]]
    entries = torch.cat([entering[None], handed_on[:-1]])
    restarts = torch.cat([starts.new_ones(1), starts[:-1]])
    states = _segment_cumsum(entries, restarts, one_segment=all(chunks.carries_list[lo:hi - 1]))
    after = states[-1] + handed_on[-1] if chunks.carries_list[hi - 1] else handed_on[-1]
    return states, after


def _segment_cumsum(x: torch.Tensor, restart: torch.Tensor, one_segment: bool) -> torch.Tensor:
    """Inclusive cumsum along dim 0 that starts afresh wherever ``restart`` is True.

    On CPU, row by row: torch's CPU cumsum walks each column with a stride, ~4× slower on these
    ``[chunks, H, D, Dv]`` blocks than a loop over their few rows.
    """
    if x.device.type == "cpu":
        return _scan_rows(x, restart)
    return x.cumsum(0) if one_segment else _cumsum_in_segments(x, restart)


def _scan_rows(x: torch.Tensor, restart: torch.Tensor) -> torch.Tensor:
    """The sequential fp32 scan, one row at a time."""
    out = torch.empty_like(x)
    out[0] = x[0]
    for i, fresh in enumerate(restart.tolist()[1:], start=1):
        if fresh:
            out[i].copy_(x[i])
        else:
            torch.add(out[i - 1], x[i], out=out[i])
    return out


def _cumsum_in_segments(x: torch.Tensor, restart: torch.Tensor) -> torch.Tensor:
    """One cumsum in fp64, less the sum before each segment: the subtraction loses nothing that the sequential
    fp32 scan would keep."""
    total = x.double().cumsum(0)
    index = torch.arange(x.shape[0], device=x.device)
    first = torch.where(restart, index, 0).cummax(0).values  # start of each position's segment
    before = torch.where((first > 0)[:, None, None, None], total[(first - 1).clamp(min=0)], 0)
    return (total - before).to(x.dtype)


class _ChunkScan(torch.autograd.Function):
    """``o_t = q_tᵀ S_t`` by chunks; also the chunk-start state of each document's last chunk.

    Both directions walk blocks of chunks in order, carrying one d×dv state between blocks.
    """

    @staticmethod
    def forward(ctx, q, k, v, initial, chunks: Chunks):
        heads, dk, dv = q.shape[1], q.shape[2], v.shape[2]
        o = v.new_empty(chunks.total, heads, dv)
        at_last_chunk = q.new_zeros(chunks.num_docs, heads, dk, dv)
        entering = q.new_zeros(heads, dk, dv) if initial is None else initial[chunks.first_doc]
        for lo, hi in chunks.blocks(heads, max(dk, dv)):
            Q, K, V = (chunks.split(x, lo, hi) for x in (q, k, v))
            states, entering = _block_states(K, V, initial, entering, chunks, lo, hi)
            o_block = (Q @ K.transpose(-1, -2)).mul_(chunks.mask[lo:hi]) @ V
            o_block += (Q @ states).mul_(chunks.reads_state[lo:hi])
            chunks.join(o, o_block, lo)
            docs, at = chunks.ending_in(lo, hi)
            at_last_chunk[docs] = states[at]
        ctx.save_for_backward(q, k, v, initial)
        ctx.chunks = chunks
        ctx.set_materialize_grads(False)
        return o, at_last_chunk

    @staticmethod
    def backward(ctx, d_o, d_at_last_chunk):
        q, k, v, initial = ctx.saved_tensors
        chunks: Chunks = ctx.chunks
        heads, dk, dv = q.shape[1], q.shape[2], v.shape[2]
        blocks = chunks.blocks(heads, max(dk, dv))
        d_o = torch.zeros_like(v) if d_o is None else d_o

        # forward sweep: the state entering each block, recomputed (one d×dv state per block, never stored)
        entering = [q.new_zeros(heads, dk, dv) if initial is None else initial[chunks.first_doc]]
        for lo, hi in blocks[:-1]:
            entering.append(_block_states(chunks.split(k, lo, hi), chunks.split(v, lo, hi), initial, entering[-1],
                                          chunks, lo, hi)[1])

        # reverse sweep: the gradient of the state entering chunk c sums chunks c … to where its document stops
        dq, dk_, dv_ = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        d_initial = torch.zeros_like(initial) if ctx.needs_input_grad[3] else None
        d_after = q.new_zeros(heads, dk, dv)  # gradient of the state entering the chunk after the block
        for (lo, hi), before in zip(reversed(blocks), reversed(entering)):
            Q, K, V, dO = (chunks.split(x, lo, hi) for x in (q, k, v, d_o))
            states, _ = _block_states(K, V, initial, before, chunks, lo, hi)
            d_states = (Q * chunks.reads_state[lo:hi]).transpose(-1, -2) @ dO
            if d_at_last_chunk is not None:
                docs, at = chunks.ending_in(lo, hi)
                d_states.index_add_(0, at, d_at_last_chunk[docs])
            if chunks.carries_list[hi - 1]:
                d_states[-1] += d_after
            restarts = ~chunks.carries[lo:hi].flip(0)
            d_entries = _segment_cumsum(d_states.flip(0), restarts, all(chunks.carries_list[lo:hi - 1])).flip(0)
            d_handed_on = torch.cat([d_entries[1:], d_after[None]])
            if d_initial is not None:
                starts = ~chunks.carries[lo:hi]
                d_initial.index_add_(0, chunks.next_doc[lo:hi][starts], d_handed_on[starts])
            d_after = d_entries[0]

            mask = chunks.mask[lo:hi]
            d_weights = (dO @ V.transpose(-1, -2)).mul_(mask)
            weights = (Q @ K.transpose(-1, -2)).mul_(mask)
            feeds_next = chunks.feeds_next[lo:hi]
            chunks.join(dq, (dO @ states.transpose(-1, -2)).mul_(chunks.reads_state[lo:hi]).add_(d_weights @ K), lo)
            chunks.join(dk_, (V @ d_handed_on.transpose(-1, -2)).mul_(feeds_next).add_(d_weights.transpose(-1, -2) @ Q),
                        lo)
            chunks.join(dv_, (K @ d_handed_on).mul_(feeds_next).add_(weights.transpose(-1, -2) @ dO), lo)
        if d_initial is not None:
            d_initial[chunks.first_doc] += d_after
        return dq, dk_, dv_, d_initial, None
