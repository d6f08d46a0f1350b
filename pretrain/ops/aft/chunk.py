"""Causal AFT-local and AFT-simple over packed documents, all chunks at once (docs/MIXERS.md#aft_local).

``num_t = Σ_{t' ≤ t} e^{K_{t'}} V_{t'} + Σ_{t − t' < s} (e^{w(t − t')} − 1) e^{K_{t'}} V_{t'}`` over the
tokens of t's document (den: V → 1). Cut into chunks of L ≥ s tokens, so the band reaches one chunk back at most:

- inside a chunk, one ``[L, L]`` matmul with weights ``causal ∧ same document · (1 + band)``, and a second one
  with the band's part that reaches into the previous chunk;
- between chunks, the plain prefix sum of the document that runs through the boundary. It is a recurrence
  over chunks, ``T_c = a_c T_{c−1} + S_c``, solved by a log₂(n)-step scan rather than a loop over chunks.

Stability: a piece (the tokens of one document inside one chunk) is exponentiated against its document's running
max of K through the chunk's end, so every ``e^{K − ref}`` is ≤ 1 and a document's reference depends on its own
keys only. A token whose visible keys all lie ~80 below a later key of its own piece underflows (0/0), far
outside what learned keys do.
"""
import torch
import torch.nn.functional as F

from ..documents import causal_same_document, chunked_document_ids
from ..precision import upcast


def causal_aft(q, k, v, w_rel, *, chunk, cu_seqlens=None):
    """q, k, v ``[B, T, C]`` (B = 1 with ``cu_seqlens``); ``w_rel [window ≤ chunk]`` or None (AFT-simple)."""
    q, k, v_acc = upcast(q, k, v)
    batch, total, channels = k.shape
    layout = _Layout(total, chunk, cu_seqlens, k.device)
    k, v_acc = (F.pad(x, (0, 0, 0, layout.padded - total)) for x in (k, v_acc))  # padding: a document of its own
    ref, running_max = _references(k.detach(), layout)

    exp_k = (k.view(ref.shape) - ref).exp()
    values = torch.cat([exp_k, exp_k * v_acc.view(ref.shape)], dim=-1)  # denominator and numerator side by side
    plain = layout.same_doc.to(k.dtype)
    if w_rel is None:
        summed = torch.matmul(plain, values)
        reach_back = 0
    else:
        band_now, band_back = _band(w_rel.to(k.dtype), chunk)
        summed = torch.matmul(plain * (1 + band_now), values)
        reach_back = torch.matmul(layout.same_doc_back[1:] * band_back, values[:, :-1])
        reach_back = F.pad(reach_back, (0, 0, 0, 0, 1, 0))  # the first chunk has nothing behind it

    # the plain prefix of each chunk's last document, carried chunk to chunk (each relative to running_max)
    tail_sums = torch.einsum("nl,bnlc->bnc", layout.in_tail.to(k.dtype), values)
    with torch.no_grad():
        decay = torch.where(layout.tail_runs_on[:, None], (running_max[:, :-1] - running_max[:, 1:]).exp(), 0)
        decay = F.pad(decay, (0, 0, 1, 0)).repeat(1, 1, 2)
        # chunk c's first document goes on from c − 1: rescale c − 1's sums to that document's reference in c
        onto_first = torch.where(layout.continues[1:, None], (running_max[:, :-1] - ref[:, 1:, 0]).exp(), 0)
        onto_first = F.pad(onto_first, (0, 0, 1, 0)).repeat(1, 1, 2)
    carried = F.pad(affine_scan(decay, tail_sums, torch.mul, torch.add)[:, :-1], (0, 0, 1, 0))
    from_behind = (reach_back + carried[:, :, None]) * onto_first[:, :, None]  # the band and the prefix before c
    summed = summed + layout.reads_carry.to(k.dtype)[..., None] * from_behind

    den, num = summed.reshape(batch, layout.padded, 2 * channels)[:, :total].chunk(2, dim=-1)
    return (torch.sigmoid(q) * num / den).to(v.dtype)


class _Layout:
    """Where documents fall in chunks of L tokens (the padding past T is a document of its own)."""

    def __init__(self, total: int, size: int, cu_seqlens, device):
        cu = None if cu_seqlens is None else cu_seqlens.to(device=device, dtype=torch.long)
        by_chunk = chunked_document_ids(total, cu, size, device)
        self.count, self.padded = by_chunk.shape[0], by_chunk.numel()
        first, last = by_chunk[:, 0], by_chunk[:, -1]
        # chunk c starts inside the document that ended chunk c − 1 / c's last document began before c
        self.continues = torch.cat([first.new_zeros(1, dtype=torch.bool), first[1:] == last[:-1]])
        self.tail_runs_on = last[1:] == last[:-1]
        self.reads_carry = self.continues[:, None] & (by_chunk == first[:, None])  # [n, L]
        self.in_tail = by_chunk == last[:, None]  # [n, L]
        self.same_doc = causal_same_document(by_chunk)  # [n, L, L]
        behind = F.pad(by_chunk[:-1], (0, 0, 1, 0), value=-1)  # the previous chunk's documents (none for c = 0)
        self.same_doc_back = by_chunk[:, :, None] == behind[:, None, :]  # [n, L, L]
        # pieces: the tokens of one document inside one chunk
        doc = by_chunk.flatten()
        starts = torch.ones_like(doc, dtype=torch.bool)
        starts[1:] = doc[1:] != doc[:-1]
        starts[::size] = True
        self.piece = starts.cumsum(0) - 1
        self.pieces = int(self.piece[-1]) + 1
        self.first_piece = self.piece[::size]
        self.last_piece = self.piece[size - 1::size]


def _references(k, layout):
    """Per token, its document's running max of K through the end of its chunk (``[B, n, L, C]``); and per chunk,
    that of the chunk's last document (``[B, n, C]``)."""
    batch, _, channels = k.shape
    empty = k.new_full((batch, layout.pieces, channels), float("-inf"))
    piece_max = empty.scatter_reduce(1, layout.piece[None, :, None].expand_as(k), k, "amax")
    # the last document of chunk c: its running max, continued from c − 1 when it began before c
    reset = torch.where(layout.tail_runs_on, 0.0, float("-inf")).to(k.dtype)
    reset = F.pad(reset, (1, 0), value=float("-inf"))[None, :, None].expand(batch, -1, channels)
    running_max = affine_scan(reset, piece_max[:, layout.last_piece], torch.add, torch.maximum)
    # a chunk's first document, when it goes on from the previous chunk, also counts the keys before this chunk
    first = piece_max[:, layout.first_piece[1:]]
    carried = torch.where(layout.continues[1:, None], torch.maximum(first, running_max[:, :-1]), first)
    piece_ref = piece_max.index_copy(1, layout.first_piece[1:], carried)
    ref = piece_ref[:, layout.piece].view(batch, layout.count, -1, channels)
    return ref, running_max


def _band(w_rel, size):
    """``e^w − 1`` at offsets ``t − t'`` inside the window: ``[L, L]`` within a chunk and from the chunk before."""
    window = w_rel.shape[0]
    rows = torch.arange(size, device=w_rel.device)
    offset = rows[:, None] - rows[None, :]
    bias = w_rel.exp() - 1

    def at(offsets):
        inside = (offsets >= 0) & (offsets < window)
        return bias[offsets.clamp(0, window - 1)].masked_fill(~inside, 0)

    return at(offset), at(offset + size)


def affine_scan(a, b, times, plus):
    """``x_c = plus(times(x_{c−1}, a_c), b_c)`` along dim 1 with ``x_0 = b_0``, in log₂(n) parallel steps.

    Composing two affine steps is affine, so each round composes every element with the one ``shift`` behind it
    (Hillis–Steele). ``(torch.mul, torch.add)`` is a linear recurrence; ``(torch.add, torch.maximum)`` a running max
    that ``a = −∞`` resets.
    """
    shift = 1
    while shift < b.shape[1]:
        b = torch.cat([b[:, :shift], plus(times(b[:, :-shift], a[:, shift:]), b[:, shift:])], dim=1)
        a = torch.cat([a[:, :shift], times(a[:, :-shift], a[:, shift:])], dim=1)
        shift *= 2
    return b
