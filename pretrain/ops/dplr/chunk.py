"""The diagonal-plus-low-rank rule in chunks (docs/MIXERS.md#dplr): a UT form inside a chunk, a state between chunks.

Per chunk of C tokens, with ``D_t`` the log-decay summed per key channel from the chunk's start (or the token's
document's start, if later) through t, ``D⁻_t`` the same through t − 1, and the decayed products (one document,
causal; ``e^{·}`` per channel inside the sum)

    P^{xy}_ij = Σ_c x_ic y_jc e^{E_ic − D_jc}      E = D⁻ with j < i for x = b; E = D with j ≤ i for x = q

each token's read ``u_t = S_{t−1}ᵀ b_t`` is a lower-triangular system in the chunk:

    U = A (P^{bk} V) + W S,   A = (I − P^{ba})⁻¹,   W = A (B ⊙ e^{D⁻})      independent of S: all chunks at once
    O = (Q ⊙ e^D) S + P^{qa} U + P^{qk} V
    S ← e^{D_C} ⊙ S + (A ⊙ e^{D_C − D})ᵀ U + (K ⊙ e^{D_C − D})ᵀ V     the one sequential step, chunk after chunk

The gated delta rule's chunked form (``delta_rule/chunk.py``) with one more term, and per-channel decay in the
products: ``P`` is no longer a masked matrix product times a C×C decay. It is computed in sub-chunks of at most
16 tokens: between sub-chunks it factors as a matrix product through the decay at the earlier sub-chunk's last
token r, ``e^{E_i − D_j} = e^{E_i − D_r} · e^{D_r − D_j}``, both factors ≤ 1 when the gates are ≤ 0; inside a
sub-chunk each pair's exponent is formed on its own. Every exponent is masked before ``exp``, so gates near −20
per channel neither overflow nor turn into NaN; a pair whose decay underflows contributes its true, negligible
value.

Packed documents, initial and final states, and the lean backward (blocks recomputed, ``ops/recompute.py``) are
the delta rule's, whose layout and helpers this module reuses.
"""
from functools import partial

import torch

from ..delta_rule.chunk import _exp_where, _Layout, _own_initial_reads, _rows
from ..documents import stream_offsets
from ..linear_attention.runs import gather_runs
from ..precision import upcast
from ..recompute import in_blocks

SUB_CHUNK = 16  # the most tokens whose pairwise decays are formed one by one (C·SUB_CHUNK·Dk exponentials per chunk)


def dplr_chunk(q, k, v, a, b, g, *, cu_seqlens, initial_state, output_final_state, chunk_size):
    """Same arguments and results as ``dplr_delta_rule`` (checked there)."""
    batch, length, heads, dk = q.shape
    dtype, total, dv = q.dtype, batch * length, v.shape[-1]
    cu = stream_offsets(batch, length, cu_seqlens, q.device)
    tokens = tuple(x.reshape(total, heads, x.shape[-1]) for x in upcast(q, k, v, a, b, g))
    layout = _Layout(cu, total, chunk_size)
    zeros = tokens[0].new_zeros(1, heads, dk, dv)
    given = zeros.expand(layout.num_docs, -1, -1, -1) if initial_state is None else initial_state.to(zeros.dtype)
    initial = torch.cat([given, zeros])  # row N: what follows the last document
    sub = max(size for size in range(1, min(SUB_CHUNK, chunk_size) + 1) if chunk_size % size == 0)
    blocks = layout.blocks(heads, max(sub * dk, dv))  # a sub-chunk's pairs hold sub·Dk numbers per token
    block = partial(_block, has_initial=initial_state is not None, want_final=output_final_state, layout=layout,
                    sub=sub)
    o, _, finals = in_blocks(block, blocks, chunk_size, tokens, initial[layout.first_doc], initial)
    o = o.view(batch, length, heads, -1).to(dtype)
    return (o, torch.cat(finals)) if output_final_state else o


def _block(lo: int, hi: int, q, k, v, a, b, g, entering, initial, *, has_initial, want_final, layout: _Layout,
           sub: int):
    """Chunks ``lo … hi-1`` from ``entering`` (the state of chunk lo's first document before it) → their outputs as
    ``[(hi − lo)·C, H, Dv]`` rows, the state entering chunk hi and, when ``want_final``, the final states of the
    documents ending in them."""
    Q, K, V, A, B, G = (layout.split(x, 0, hi - lo) for x in (q, k, v, a, b, g))  # [n, H, C, *]
    same_doc = layout.mask[lo:hi]  # [n, 1, C, C]: causal and one document
    before = same_doc & ~torch.eye(layout.size, dtype=torch.bool, device=same_doc.device)
    reads = layout.reads_state[lo:hi]  # [n, 1, C, 1]: the token continues the chunk's first document
    feeds = layout.feeds_next[lo:hi]  # its document runs into the next chunk
    D = same_doc.to(G.dtype) @ G  # [n, H, C, Dk]
    D_before = before.to(G.dtype) @ G
    P_ba, P_bk = decayed_products(B, D_before, torch.stack([A, K]), D, before, sub)
    P_qa, P_qk = decayed_products(Q, D, torch.stack([A, K]), D, same_doc, sub)
    rhs = torch.cat([P_bk @ V, B * D_before.exp()], dim=-1)
    U, W = torch.linalg.solve_triangular(-P_ba, rhs, upper=False, unitriangular=True).split(
        [V.shape[-1], K.shape[-1]], dim=-1)
    QD = Q * D.exp()
    own_reads = _own_initial_reads(torch.stack([W, QD], dim=-2), initial, layout, lo, hi) if has_initial else None

    last = D[..., -1:, :]  # [n, H, 1, Dk]: the log-decay at the chunk's last token, whose document runs on (if any)
    to_end = _exp_where(feeds, last - D)
    hands, kv = A * to_end, (K * to_end).mT @ V
    carry = last.mT.exp()  # [n, H, Dk, 1]
    begins = layout.next_begins_inside[lo:hi].view(-1, 1, 1, 1)
    fresh = initial[layout.next_doc[lo:hi]] * torch.where(begins, carry, 1.0)  # a document beginning next
    written = U + own_reads[:, :, :, 0] if has_initial else U  # plus what a document's own initial state gives
    steps = zip(written.unbind(), (W * reads).unbind(), hands.unbind(), kv.unbind(), carry.unbind(), fresh.unbind())
    states, read_list = [], []
    state = entering
    for c, (writes, predicts, hand, adds, decays, new) in enumerate(steps):
        states.append(state)
        read = writes + predicts @ state
        read_list.append(read)
        state = (decays * state if layout.carries_list[lo + c] else new) + hand.mT @ read + adds
    states, U = torch.stack(states), torch.stack(read_list)
    out = (QD * reads) @ states + P_qa @ U + P_qk @ V
    if has_initial:
        out = out + own_reads[:, :, :, 1]
    if not want_final:
        return _rows(out), state
    return _rows(out), state, _final_states(torch.stack([A, K], -2), torch.stack([U, V], -2), D, states, initial,
                                            layout, lo, hi)


def decayed_products(X, E, Ys, F, mask, sub: int) -> torch.Tensor:
    """``P[y, …, i, j] = Σ_c X_ic Ys[y]_jc e^{E_ic − F_jc}`` where ``mask [n, 1, C, C]`` allows (one document, j ≤ i),
    0 elsewhere, for ``X, E, F [n, H, C, Dk]`` and ``Ys [Y, n, H, C, Dk]``. ``E_i ≤ F_r`` for every r of i's
    document with j ≤ r < i (log-decays summed from the document's start, gates ≤ 0), so no factor exceeds 1."""
    size = X.shape[-2]
    count = size // sub

    def blocks(x):  # [..., C, *] → [..., count, sub, *]
        return x.unflatten(-2, (count, sub))

    E_b, F_b, X_b, Ys_b = blocks(E), blocks(F), blocks(X), blocks(Ys)
    # inside a sub-chunk: every pair's exponent on its own
    inner_mask = mask.unflatten(-1, (count, sub)).unflatten(2, (count, sub)).diagonal(dim1=2, dim2=4).movedim(-1, 2)
    decay = _exp_where(inner_mask[..., None], E_b[..., :, None, :] - F_b[..., None, :, :])  # [n, H, m, s, s, Dk]
    inner = torch.einsum("nhmijc,ynhmjc->ynhmij", X_b[..., :, None, :] * decay, Ys_b)
    out = inner.new_zeros(*inner.shape[:3], count, sub, count, sub)
    out.diagonal(dim1=-4, dim2=-2).copy_(inner.movedim(-3, -1))
    if count > 1:  # between sub-chunks: through the decay at the earlier one's last token r
        ref = F_b[..., -1, :]  # [n, H, m, Dk]
        ends = mask[..., sub - 1::sub]  # [n, 1, C, m]: may i see r (one document, r ≤ i)
        position = torch.arange(size, device=X.device) // sub
        later = position[None, :] > torch.arange(count, device=X.device)[:, None]  # [m, C]: i after sub-chunk J
        left = X[:, :, None] * _exp_where((ends.mT & later)[..., None], E[:, :, None] - ref[..., None, :])
        itself = torch.eye(size, dtype=torch.bool, device=X.device)[sub - 1::sub]  # r sees r, strict mask or not
        seen = (mask[..., sub - 1::sub, :] | itself).unflatten(-1, (count, sub)).diagonal(dim1=2, dim2=3)
        right = Ys_b * _exp_where(seen.movedim(-1, 2)[..., None], ref[..., None, :] - F_b)  # r sees j: [n, 1, m, s]
        across = left @ right.mT  # [Y, n, H, m, C, s]: row i, column j of sub-chunk J
        out = out + across.movedim(-3, -2).unflatten(-3, (count, sub))
    return out.flatten(-2).flatten(-3, -2)


def _final_states(keys, values, D, states, initial, layout: _Layout, lo: int, hi: int) -> torch.Tensor:
    """The state after the last token of each document that ends in chunks ``lo … hi-1``: its state entering its
    last chunk (the carried one, or its own initial state if it began there), decayed per channel, plus its tokens
    there (``keys [n, H, C, 2, Dk]``: a and k; ``values``: their reads u and v)."""
    docs, at = layout.ending_in(lo, hi)
    chunk_start = (lo + at) * layout.size
    run_start = torch.maximum(layout.starts[docs], chunk_start)
    count = layout.ends[docs] - run_start
    local = run_start - lo * layout.size
    (key_rows, _, valid), (value_rows, _, _), (log_rows, _, _) = (
        gather_runs(_rows(x), local, count) for x in (keys, values, D))
    log_end = _rows(D)[local + count - 1]  # [M, H, Dk]: at the document's last token
    weights = _exp_where(valid[:, :, None, None], log_end[:, None] - log_rows)
    entering = torch.where((layout.starts[docs] < chunk_start).view(-1, 1, 1, 1), states[at], initial[docs])
    return entering * log_end.exp()[..., None] + torch.einsum("mlhsk,mlhk,mlhsv->mhkv", key_rows, weights, value_rows)
