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
products: ``P`` is no longer a masked matrix product times a C×C decay. Each ``P`` (b's with b's rows shifted up by
one, then the result shifted back down) is built as a binary tree of sub-chunks, every block a matrix product:

* the leaves, sub-chunks with themselves, through their first token f, ``e^{D_i − D_f} · e^{D_f − D_j}``: as long
  as the log-decay moves by at most ``FACTORED_SPREAD`` (40 in fp32) across every leaf, so that no factor
  overflows (the whole chunk, half of it, …; single tokens when the gates are steep, as trained KDA layers have
  them: a token with itself has no decay);
* at each level above, every later half with its earlier sibling, through the decay at the earlier one's last
  token r, ``e^{D_i − D_j} = e^{D_i − D_r} · e^{D_r − D_j}``: both factors ≤ 1 when the gates are ≤ 0, exact at any
  gate. Each pair (i, j) meets once, where its tokens part; a level's blocks are one batched product.

A chunk whose count of leaves is not a power of two is padded to one (padded tokens masked off). Every token is
scaled once per level (in a later half or an earlier one), so steep gates cost ``log₂(C)·C·Dk`` exponentials a
chunk, not the ``C·16·Dk`` of giving each pair of a 16-token sub-chunk its own (2.4× faster,
benchmarks/dplr_ops_cpu.md).

KDA's case (``kda_chunk``: ``a = −β k``, ``b = e^g ⊙ k``, keys ``β k``) needs only ``P^{q·k}`` and ``P^{k·k}``.

Exponents that may be large are clamped to ≤ 0 before ``exp`` and their pairs masked off after, so gates near −20
neither overflow nor turn into NaN; a pair whose decay underflows contributes its true, negligible value.

Packed documents, initial and final states, and the lean backward (blocks recomputed, ``ops/recompute.py``) are
the delta rule's, whose layout and helpers this module reuses.
"""
from functools import partial

import torch
import torch.nn.functional as F

from ..delta_rule.chunk import _exp_where, _Layout, _own_initial_reads, _rows
from ..documents import stream_offsets
from ..linear_attention.runs import gather_runs
from ..precision import upcast
from ..recompute import in_blocks

# how far the log-decay may fall inside every leaf of the tree (per channel, across documents) for its pairs to
# factor through the leaf's first token: each factor within e^{±spread}, their products far from overflow
FACTORED_SPREAD = {torch.float32: 40.0, torch.float64: 300.0}


def dplr_chunk(q, k, v, a, b, g, *, cu_seqlens, initial_state, output_final_state, chunk_size):
    """Same arguments and results as ``dplr_delta_rule`` (checked there)."""
    return _chunked((q, k, v, a, b, g), _general_products, cu_seqlens=cu_seqlens, initial_state=initial_state,
                    output_final_state=output_final_state, chunk_size=chunk_size)


def kda_chunk(q, k, v, beta, g, *, cu_seqlens, initial_state, output_final_state, chunk_size):
    """Same arguments and results as ``kda_delta_rule`` (checked there): ``a = −β k``, ``b = e^g ⊙ k``, keys ``β k``,
    whose products all come from two, ``q·k`` and ``k·k`` (as the gated delta rule's)."""
    return _chunked((q, k, v, beta[..., None], g), _kda_products, cu_seqlens=cu_seqlens, initial_state=initial_state,
                    output_final_state=output_final_state, chunk_size=chunk_size)


def _chunked(inputs, products, *, cu_seqlens, initial_state, output_final_state, chunk_size):
    """The chunked form over ``inputs`` (q, k, v, what ``products`` reads, g; ``[B, T, H, *]``)."""
    q, v = inputs[0], inputs[2]
    batch, length, heads, dk = q.shape
    dtype, total, dv = q.dtype, batch * length, v.shape[-1]
    cu = stream_offsets(batch, length, cu_seqlens, q.device)
    tokens = tuple(x.reshape(total, heads, x.shape[-1]) for x in upcast(*inputs))
    layout = _Layout(cu, total, chunk_size)
    zeros = tokens[0].new_zeros(1, heads, dk, dv)
    given = zeros.expand(layout.num_docs, -1, -1, -1) if initial_state is None else initial_state.to(zeros.dtype)
    initial = torch.cat([given, zeros])  # row N: what follows the last document
    blocks = layout.blocks(heads, max(dk, dv))
    block = partial(_block, has_initial=initial_state is not None, want_final=output_final_state, layout=layout,
                    products=products)
    o, _, finals = in_blocks(block, blocks, chunk_size, tokens, initial[layout.first_doc], initial)
    o = o.view(batch, length, heads, -1).to(dtype)
    return (o, torch.cat(finals)) if output_final_state else o


def _general_products(Q, K, parts, G, D, same_doc, before):
    """``(P^{qa}, P^{qk}, P^{ba}, P^{bk}, B ⊙ e^{D⁻}, A, K)`` of a chunk, ``parts`` its a and b."""
    A, B = parts
    # b_t reads the state before its own decay: its products are those of b_t in row t − 1, shifted down a row
    B_next = F.pad(B[..., 1:, :], (0, 0, 0, 1))
    (P_qa, P_qk), shifted = decayed_products([Q, B_next], D, [A, K], same_doc)
    P_ba, P_bk = (torch.where(before, F.pad(P[..., :-1, :], (0, 0, 1, 0)), 0.0) for P in shifted)
    return P_qa, P_qk, P_ba, P_bk, B * (before.to(G.dtype) @ G).exp(), A, K


def _kda_products(Q, K, parts, G, D, same_doc, before):
    """The same for KDA (``parts``: β ``[n, H, C, 1]``): with keys ``β k``, ``P^{qk} = P^{q·k} β_j = −P^{qa}``, and
    ``b_t e^{D⁻_t} = k_t e^{D_t}`` makes ``P^{bk} = P^{k·k} β_j = −P^{ba}`` below the diagonal; None stands for
    those negatives (the block then multiplies once: ``P^{qk} (V − U)``)."""
    (beta,) = parts
    (P_qk,), (P_kk,) = decayed_products([Q, K], D, [K], same_doc) * beta.mT
    write = beta * K
    return None, P_qk, None, torch.where(before, P_kk, 0.0), K * D.exp(), -write, write


def _block(lo: int, hi: int, q, k, v, *rest, has_initial, want_final, layout: _Layout, products):
    """Chunks ``lo … hi-1`` from ``entering`` (the state of chunk lo's first document before it; ``rest`` ends with
    it and the initial states) → their outputs as ``[(hi − lo)·C, H, Dv]`` rows, the state entering chunk hi and,
    when ``want_final``, the final states of the documents ending in them."""
    *parts, g, entering, initial = rest
    Q, K, V, G, *parts = (layout.split(x, 0, hi - lo) for x in (q, k, v, g, *parts))  # [n, H, C, *]
    same_doc = layout.mask[lo:hi]  # [n, 1, C, C]: causal and one document
    before = same_doc & ~torch.eye(layout.size, dtype=torch.bool, device=same_doc.device)
    reads = layout.reads_state[lo:hi]  # [n, 1, C, 1]: the token continues the chunk's first document
    feeds = layout.feeds_next[lo:hi]  # its document runs into the next chunk
    D = same_doc.to(G.dtype) @ G  # [n, H, C, Dk]
    P_qa, P_qk, P_ba, P_bk, B_read, A, K = products(Q, K, parts, G, D, same_doc, before)
    rhs = torch.cat([P_bk @ V, B_read], dim=-1)
    lower = P_bk if P_ba is None else -P_ba
    U, W = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True).split(
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
    out = (QD * reads) @ states + (P_qk @ (V - U) if P_qa is None else P_qa @ U + P_qk @ V)
    if has_initial:
        out = out + own_reads[:, :, :, 1]
    if not want_final:
        return _rows(out), state
    return _rows(out), state, _final_states(torch.stack([A, K], -2), torch.stack([U, V], -2), D, states, initial,
                                            layout, lo, hi)


def decayed_products(Xs, D, Ys, mask) -> torch.Tensor:
    """``P[x, y, …, i, j] = Σ_c Xs[x]_ic Ys[y]_jc e^{D_ic − D_jc}`` where ``mask [n, 1, C, C]`` allows (one document,
    j ≤ i), 0 elsewhere, for ``Xs``, ``Ys`` lists of ``[n, H, C, Dk]`` and ``D`` summed from the document's start,
    gates ≤ 0. A binary tree of sub-chunks (module docstring), all the x's and y's in one matrix product per level.
    Exponents that may be large are clamped to ≤ 0 before ``exp`` (the pairs allowed have them so already; the others
    are masked off after)."""
    n, heads, size, dk = D.shape
    leaf = _factored_sub_chunk(D)
    padded = leaf << (size // leaf - 1).bit_length()  # a power of two leaves
    X, Y = torch.stack(Xs, 3), torch.stack(Ys, 3)  # [n, H, C, X or Y, Dk]: a token's rows side by side
    if padded > size:
        X, Y = (F.pad(t, (0, 0, 0, 0, 0, padded - size)) for t in (X, Y))
        D = torch.cat([D, D[..., -1:, :].expand(-1, -1, padded - size, -1)], dim=2)
    D = D[..., None, :]  # [n, H, C, 1, Dk]: the same decay for all of a token's rows
    grid = X.new_zeros(n, heads, padded, len(Xs), padded, len(Ys))
    count = padded // leaf
    D_l, X_l, Y_l = (t.unflatten(2, (count, leaf)) for t in (D, X, Y))
    if leaf > 1:  # through each leaf's first token f: e^{D_i − D_f} · e^{D_f − D_j}, no factor overflows
        spread = D_l - D_l[:, :, :, :1]
        X_l, Y_l = X_l * spread.exp(), Y_l * (-spread).exp()
    _place(grid, X_l, Y_l, later=0, earlier=0)  # each leaf with itself (a single token has no decay)
    half = leaf
    while half < padded:  # each later half with its earlier sibling, through the decay at the earlier one's last token
        D_h, X_h, Y_h = (t.unflatten(2, (padded // (2 * half), 2, half)) for t in (D, X, Y))
        ref = D_h[:, :, :, 0, -1:]  # [n, H, m, 1, 1, Dk]
        left = X_h[:, :, :, 1] * (D_h[:, :, :, 1] - ref).clamp(max=0).exp()
        right = Y_h[:, :, :, 0] * (ref - D_h[:, :, :, 0]).clamp(max=0).exp()
        _place(grid, left, right, later=1, earlier=0)
        half *= 2
    return torch.where(mask, grid.permute(3, 5, 0, 1, 2, 4)[..., :size, :size], 0.0)


def _place(grid, left, right, *, later: int, earlier: int):
    """Writes ``left @ rightᵀ`` (``[n, H, m, s, X or Y, Dk]``: m blocks of s tokens) into ``grid [n, H, P, X, P, Y]``,
    block b at rows ``b·P/m + later·s`` and columns ``b·P/m + earlier·s`` (a tree level's sibling halves)."""
    n, heads, count, rows, nx, dk = left.shape
    ny, padded = right.shape[4], grid.shape[2]
    block = left.reshape(n, heads, count, rows * nx, dk) @ right.reshape(n, heads, count, rows * ny, dk).mT
    parts = padded // (count * rows)
    blocks = grid.view(n, heads, count, parts, rows, nx, count, parts, rows, ny).diagonal(dim1=2, dim2=6)
    block = block.view(n, heads, count, rows, nx, rows, ny).permute(0, 1, 3, 4, 5, 6, 2)
    blocks[:, :, later, :, :, earlier].copy_(block)


def _factored_sub_chunk(D) -> int:
    """The longest sub-chunk (a divisor of C) across which ``D [n, H, C, Dk]`` moves by at most ``FACTORED_SPREAD`` in
    every channel: its pairs may factor through its first token. One token always does."""
    *lead, size, dk = D.shape
    for sub in (d for d in range(size, 1, -1) if size % d == 0):
        blocks = D.detach().view(*lead, size // sub, sub, dk)
        if float((blocks - blocks[..., :1, :]).abs().amax()) <= FACTORED_SPREAD[D.dtype]:
            return sub
    return 1


def _final_states(keys, values, D, states, initial, layout: _Layout, lo: int, hi: int) -> torch.Tensor:
    """The state after the last token of each document that ends in chunks ``lo … hi-1``: its state entering its
    last chunk (the carried one, or its own initial state if it began there), decayed per channel, plus its tokens
    there (``keys [n, H, C, 2, Dk]``: a and k; ``values``: their reads u and v)."""
    docs, at, local, count, carried = layout.ending_inside(lo, hi)
    (key_rows, _, valid), (value_rows, _, _), (log_rows, _, _) = (
        gather_runs(_rows(x), local, count) for x in (keys, values, D))
    log_end = _rows(D)[local + count - 1]  # [M, H, Dk]: at the document's last token
    weights = _exp_where(valid[:, :, None, None], log_end[:, None] - log_rows)
    entering = torch.where(carried.view(-1, 1, 1, 1), states[at], initial[docs])
    return entering * log_end.exp()[..., None] + torch.einsum("mlhsk,mlhk,mlhsv->mhkv", key_rows, weights, value_rows)
