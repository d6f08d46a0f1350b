"""The gated delta rule in chunks (docs/MIXERS.md#deltanet): the WY/UT form inside a chunk, a state between chunks.

Per chunk of C tokens (DeltaNet, arXiv 2406.06484 §3; Gated DeltaNet, arXiv 2412.06464 §3.3), with ``D_t`` the
log-gate summed from the chunk's start (or the token's document's start, if later) to t, and
``Γ_ij = e^{D_i − D_j}`` for j ≤ i in one document (0 elsewhere):

    A = (I + strictly_lower(diag(β)(Γ ⊙ K Kᵀ)))⁻¹      a unit lower-triangular solve
    U = A (β V),   W = A (β K ⊙ e^D)                   independent of the state: every chunk of a block at once
    Δ = U − W S                                        what each token writes: v less what the state predicts
    O = (Q ⊙ e^D) S + (Q Kᵀ ⊙ Γ) Δ
    S ← e^{D_C} S + (K ⊙ e^{D_C − D})ᵀ Δ               the one sequential step, chunk after chunk

Decays stay in log space: only differences ``D_i − D_j ≤ 0`` are exponentiated, masked before ``exp``.

Packed documents share chunks as in linear attention: Γ is masked to one document (so A is block-diagonal by
document), the tokens of a chunk's first document read the carried state, and a document that begins inside a
chunk reads its own initial state there (a gather of its few tokens).

Memory: the chunks are walked in blocks, each run without autograd and recomputed once in backward
(``ops/recompute.py``), so backward keeps per block only its inputs (q, k, v, β, g, already held by the caller; fp32
copies for bf16) and the state entering it. Plain autograd through the solve would keep C-wide
rows of the C×C factors and W, U, Δ per token and head besides: 7× the inputs at C = Dk = Dv = 64 (MIXERS.md).
"""
from functools import partial

import torch

from ..linear_attention.chunk import BLOCK_ELEMENTS, Chunks
from ..linear_attention.runs import gather_runs
from ..precision import upcast
from ..recompute import bounded_blocks, in_blocks


def delta_rule_chunk(q, k, v, beta, g, *, cu_seqlens, initial_state, output_final_state, chunk_size):
    """Same arguments and results as ``delta_rule`` (checked there)."""
    batch, length, heads, dk = q.shape
    dtype, total = q.dtype, batch * length
    if cu_seqlens is None:
        cu = torch.arange(batch + 1, device=q.device) * length  # rows of a batch are documents of one stream
    else:
        cu = cu_seqlens.to(device=q.device, dtype=torch.long)
    q, k, v = (x.reshape(total, heads, x.shape[-1]) for x in upcast(q, k, v))
    beta, g = (x.reshape(total, heads, 1) for x in upcast(beta, g))
    layout = _Layout(cu, total, chunk_size)
    zeros = q.new_zeros(1, heads, dk, v.shape[-1])
    given = zeros.expand(layout.num_docs, -1, -1, -1) if initial_state is None else initial_state.to(q.dtype)
    initial = torch.cat([given, zeros])  # row N: what follows the last document
    state = initial[layout.first_doc]
    blocks = layout.blocks(heads, max(dk, v.shape[-1]))
    block = partial(_block, has_initial=initial_state is not None, want_final=output_final_state, layout=layout)
    o, _, finals = in_blocks(block, blocks, chunk_size, (q, k, v, beta, g), state, initial)
    o = o.view(batch, length, heads, -1).to(dtype)
    return (o, torch.cat(finals)) if output_final_state else o


def _block(lo: int, hi: int, q, k, v, beta, g, entering, initial, *, has_initial, want_final, layout: "_Layout"):
    """Chunks ``lo … hi-1`` (their tokens ``q, k, v, beta, g``, ``[≤ (hi − lo)·C, H, *]``) from ``entering`` (the
    state of chunk lo's first document before it) → their outputs as ``[(hi − lo)·C, H, Dv]`` rows, the state
    entering chunk hi and, when ``want_final``, the final states of the documents ending in them."""
    Q, K, V, B, G = (layout.split(x, 0, hi - lo) for x in (q, k, v, beta, g))  # [n, H, C, *]
    B, G = B[..., 0], G[..., 0]
    same_doc = layout.mask[lo:hi]  # [n, 1, C, C]: causal and one document
    reads = layout.reads_state[lo:hi]  # [n, 1, C, 1]: the token continues the chunk's first document
    feeds = layout.feeds_next[lo:hi]  # its document runs into the next chunk
    D = (same_doc.to(G.dtype) @ G[..., None])[..., 0]  # [n, H, C]
    decay = _exp_where(same_doc, D[..., :, None] - D[..., None, :])  # Γ
    lower = (B[..., None] * decay * (K @ K.mT)).tril(-1)  # the unit diagonal is implied
    rhs = torch.cat([V, K * D.exp()[..., None]], dim=-1) * B[..., None]
    U, W = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True).split(
        [V.shape[-1], K.shape[-1]], dim=-1)
    QD = Q * D.exp()[..., None]
    own_reads = _own_initial_reads(torch.stack([W, QD], dim=-2), initial, layout, lo, hi) if has_initial else 0

    last = D[..., -1:]  # [n, H, 1]: the log-decay of the chunk's last token, whose document runs on (if any)
    handing = K * _exp_where(feeds, last[..., None] - D[..., None])
    carry = last.exp()[..., None]  # [n, H, 1, 1]
    begins = layout.next_begins_inside[lo:hi].view(-1, 1, 1, 1)
    fresh = initial[layout.next_doc[lo:hi]] * torch.where(begins, carry, 1.0)  # a document beginning next
    written = U - own_reads[:, :, :, 0] if has_initial else U  # less what a document's own initial state predicts
    # unbind, not chunk-by-chunk indexing: each index's backward would write a zero tensor of the whole block
    steps = zip(written.unbind(), (W * reads).unbind(), handing.unbind(), carry.unbind(), fresh.unbind())
    states, deltas = [], []
    state = entering
    for c, (writes, predicts, hands, decays, new) in enumerate(steps):
        states.append(state)
        delta = writes - predicts @ state
        deltas.append(delta)
        state = (decays * state if layout.carries_list[lo + c] else new) + hands.mT @ delta
    states, delta = torch.stack(states), torch.stack(deltas)
    out = (QD * reads) @ states + (Q @ K.mT * decay) @ delta
    if has_initial:
        out = out + own_reads[:, :, :, 1]
    if not want_final:
        return _rows(out), state
    return _rows(out), state, _final_states(K, D, delta, states, initial, layout, lo, hi)


def _exp_where(mask: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """``e^exponent`` where ``mask``, 0 elsewhere, never exponentiating a masked value (it may be large)."""
    return torch.where(mask, exponent, float("-inf")).exp()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """Chunks ``[n, H, C, *]`` as token rows ``[n·C, H, *]``."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], *x.shape[3:])


def _own_initial_reads(rows_of, initial, layout: "_Layout", lo: int, hi: int) -> torch.Tensor:
    """``[n, H, C, 2, Dv]``: for the tokens of documents that begin inside chunks ``lo … hi-1``, ``rows_of``
    (``[n, H, C, 2, Dk]``: W and Q ⊙ e^D) times their own document's initial state; zero elsewhere."""
    docs, start, count = layout.beginning_inside(lo, hi)
    tokens = _rows(rows_of)
    rows, index, valid = gather_runs(tokens, start, count)
    reads = torch.einsum("mlhik,mhkv->mlhiv", rows, initial[docs])
    out = tokens.new_zeros(*tokens.shape[:-1], initial.shape[-1]).index_add(0, index[valid], reads[valid])
    return out.view(hi - lo, layout.size, *out.shape[1:]).transpose(1, 2)


def _final_states(K, D, delta, states, initial, layout: "_Layout", lo: int, hi: int) -> torch.Tensor:
    """The state after the last token of each document that ends in chunks ``lo … hi-1``: its state entering its
    last chunk (the carried one, or its own initial state if it began there), decayed, plus its tokens there."""
    docs, at, local, count, carried = layout.ending_inside(lo, hi)
    (k_rows, index, valid), (d_rows, _, _), (log_rows, _, _) = (
        gather_runs(_rows(x), local, count) for x in (K, delta, D[..., None]))
    log_end = _rows(D[..., None])[local + count - 1]  # [M, H, 1]: at the document's last token
    weights = _exp_where(valid[:, :, None, None], log_end[:, None] - log_rows)
    entering = torch.where(carried.view(-1, 1, 1, 1), states[at], initial[docs])
    return entering * log_end.exp()[..., None] + torch.einsum("mlhk,mlhv->mhkv", k_rows * weights, d_rows)


class _Layout(Chunks):
    """Linear attention's chunk layout of a packed stream, plus where documents begin inside chunks; blocks are
    bounded on every device (each is a unit of recomputation in backward)."""

    def __init__(self, cu: torch.Tensor, total: int, size: int):
        super().__init__(cu, total, size)
        self.starts, self.ends = cu[:-1], cu[1:]
        # the next chunk's first document has tokens here without being this chunk's first: it begins inside
        self.next_begins_inside = self.feeds_next[:, 0, :, 0].any(1) & ~self.carries

    def blocks(self, heads: int, width: int) -> list[tuple[int, int]]:
        return bounded_blocks(self.count, heads, self.size, width, BLOCK_ELEMENTS)

    def ending_inside(self, lo: int, hi: int):
        """The documents that end in chunks ``lo … hi-1``: which, the block's chunk holding their end, the
        block-local index of their first token there and how many it holds, and whether their state enters that chunk
        carried (they began before it) rather than as their own initial state."""
        docs, at = self.ending_in(lo, hi)
        chunk_start = (lo + at) * self.size
        run_start = torch.maximum(self.starts[docs], chunk_start)
        return docs, at, run_start - lo * self.size, self.ends[docs] - run_start, self.starts[docs] < chunk_start

    def beginning_inside(self, lo: int, hi: int):
        """The documents that begin inside (not at the start of) chunks ``lo … hi-1``; the block-local index of
        their first token, and how many of their tokens that chunk holds."""
        size = self.size
        docs = ((self.starts % size != 0) & (self.starts >= lo * size) & (self.starts < hi * size)).nonzero()[:, 0]
        start = self.starts[docs]
        end = torch.minimum(self.ends[docs], (start // size + 1) * size)
        return docs, start - lo * size, end - start
