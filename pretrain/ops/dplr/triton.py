"""Kimi Delta Attention's chunked form in Triton (docs/MIXERS.md#kda, "Triton form"): the gated delta rule's Triton
form (``delta_rule/triton.py``) with a decay per key channel.

``S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t−1} + β_t k_t v_tᵀ``. Per chunk, ``D`` the log-gate summed per channel
from the chunk's start, and the decayed products (``e^{·}`` per channel inside the sum)

    P^{qk}_ij = Σ_c q_ic k_jc e^{D_ic − D_jc} (j ≤ i),     P^{kk}_ij = Σ_c k_ic k_jc e^{D_ic − D_jc} (j < i)

the delta rule's chunk holds with ``Γ ⊙ Q Kᵀ → P^{qk}``, ``Γ ⊙ K Kᵀ → P^{kk}`` and the gates scaling elements
instead of rows:

    A = (I + β P^{kk})⁻¹,   W = A (β K ⊙ e^D),   U = A (β V),   Δ = U − W S
    O = (Q ⊙ e^D) S + P^{qk} Δ,   S ← e^{D_C} ⊙ S + (K ⊙ e^{D_C − D})ᵀ Δ      (e^{D_C} per row of S)

Kernels, every block of chunks one autograd Function (``_Block``, run by the delta rule's ``run_in_blocks``):
- the products, one program per (chunk, head, sub-chunk of 16 rows), as ``dplr/chunk.py`` built them before its
  tree of sub-chunks: against an earlier sub-chunk through the decay at its last token r,
  ``e^{D_i − D_r} · e^{D_r − D_j}`` (both ≤ 1, exact at any gate), and within the sub-chunk each pair with its own
  exponent (a loop over its 16 columns); exponents clamped ≤ 0 before ``exp``, pairs masked after. No host check of
  the gates' size, nothing overflows at any gate ≤ 0.
  From the same loads it writes what the UT transform and the scan read besides: ``Q ⊙ e^D``, ``K ⊙ e^D`` and
  ``K ⊙ e^{D_C − D}`` (D and ``D_C − D`` are cumulative sums, batched);
- the UT transform, one program per (chunk, head): A by forward substitution (the delta rule's), W, U;
- the scan with the output inside, one program per (document, head, block of value channels), its state in
  registers, reading ``Q ⊙ e^D``, ``K ⊙ e^{D_C − D}`` and ``P^{qk}``;
- backward by hand, as the delta rule's: recompute, the scan again writing each chunk's entering state and Δ, the
  output stage's adjoint (``dS_out = (Q ⊙ e^D)ᵀ dO``, ``dΔ_out = P^{qkᵀ} dO``, ``dP^{qk} = dO Δᵀ``,
  ``d(Q ⊙ e^D) = dO Sᵀ``), the reverse scan (``dΔ = dΔ_out + (K ⊙ e^{D_C − D}) G``,
  ``G ← dS_out + e^{D_C} ⊙ G − Wᵀ dΔ``), what each chunk gets through the state, the UT transform's gradient (to
  ``dP^{kk}``), and the products' gradient, per sub-chunk as the forward: ``dX_i = Σ_j dP_ij y_j e^{D_i − D_j}``,
  ``dY_j = Σ_i dP_ij x_i e^{D_i − D_j}`` and the log-decay's ``x ⊙ dX − y ⊙ dY`` (pairs i ≠ j: a pair with itself
  has no decay), with the gradients of ``Q ⊙ e^D``, ``K ⊙ e^D`` and ``K ⊙ e^{D_C − D}``. g's gradient gathers
  D's, ``D_C − D``'s (a suffix sum of the later gates, as in the delta rule) and ``D_C``'s by cumulative sums over
  the chunk.

Chunks start at each document's first token and padded tokens write nothing (the delta rule's layout). The general
transition (arbitrary a, b: ``triton_general.py``) runs on these kernels but the products (its own, four per chunk)
and adds two state-independent terms to the scan (``ADDS``). Under ``TRITON_INTERPRET=1`` the kernels run on CPU;
the tests hold them to ``kda_chunk``.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..delta_rule.triton import (
    MAX_HEAD_DIM,
    _chunk_rows,
    _geometry,
    _keep_inputs,
    _kept_inputs,
    _launch,
    _mm,
    _per_chunk_geometry,
    _scaled_rows_backward,
    _scan_program,
    _through_state,
    _tile_offsets,
    _token_rows,
    _unit_lower_inverse,
    _ut_backward_geometry,
    _ut_geometry,
    run_in_blocks,
)

SUB = 16  # the sub-chunk: pairs inside one get their own exponents, pairs across two factor through the earlier's end
# Launch settings from the compiler's resource report for sm_90 (`tools/triton_resource_report.py --op kda`; C = 64,
# Dk = Dv = 128, TF32 products; no GPU timed yet). None of the kernels spills with these. The scans as the delta
# rule's: value blocks of 32 at 4 warps (the fused scan 235 registers; at blocks of 64 it spills 0.8 KB a thread, the
# reverse scan 40 B; at 16 none, 236).
CONFIG = dict(value_block=32, num_warps=4, num_stages=1)
# The kernels with one program per chunk and head, as the delta rule's UT_CONFIG (8 warps: 106 to 148 registers).
UT_CONFIG = dict(channel_block=32, num_warps=8, num_stages=1)
# The products' kernels, one program per (chunk, head, sub-chunk): 4 warps, 179 and 254 registers, 2 blocks per SM
# (8 warps: 179 and 186, 1 per SM; 2 warps: the gradient spills 0.5 KB). At Dk = Dv = 256 the products' kernels, the
# scans and the state gradients spill (0.3 to 1 KB a thread).
PRODUCTS_CONFIG = dict(num_warps=4, num_stages=1)

__all__ = ["MAX_HEAD_DIM", "kda_triton"]


@triton.jit
def _sub_chunk(tile, start, C: tl.constexpr, DK: tl.constexpr, SUB: tl.constexpr, BK: tl.constexpr):
    """Offsets and mask of rows [start, start + SUB) (those before C) of chunk tile ``tile`` of a [tiles, C, DK]
    tensor."""
    r = start + tl.arange(0, SUB)
    c = tl.arange(0, BK)
    return tile * (C * DK) + r[:, None] * DK + c[None, :], (r < C)[:, None] & (c < DK)[None, :]


@triton.jit
def _token(x, tile, row, C: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr):
    """Row ``row`` of chunk tile ``tile`` of a [tiles, C, DK] tensor (zeros past C)."""
    c = tl.arange(0, BK)
    return tl.load(x + tile * (C * DK) + row * DK + c, mask=(c < DK) & (row + 0 * c < C), other=0.0)


@triton.jit
def _pairs(tile, rows, cols, C: tl.constexpr):
    """Offsets and mask of entries (rows, cols) of chunk tile ``tile`` of a [tiles, C, C] tensor."""
    return tile * (C * C) + rows[:, None] * C + cols[None, :], (rows < C)[:, None] & (cols < C)[None, :]


@triton.jit
def _sub_chunk_program(q, k, log_decay, C: tl.constexpr, DK: tl.constexpr, SUB: tl.constexpr, BK: tl.constexpr):
    """A products kernel's program's chunk tile, first row, the offsets and mask of its sub-chunk's rows, and their
    Q, K and D ``[SUB, BK]``."""
    tile = tl.program_id(0).to(tl.int64)
    i0 = tl.program_id(1) * SUB
    at, mask = _sub_chunk(tile, i0, C, DK, SUB, BK)
    Q = tl.load(q + at, mask=mask, other=0.0)
    K = tl.load(k + at, mask=mask, other=0.0)
    return tile, i0, at, mask, Q, K, tl.load(log_decay + at, mask=mask, other=0.0)


@triton.jit
def _pair_weights(x, y, log_decay, D, tile, t, C: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr,
                  LATER: tl.constexpr):
    """Token t's rows of ``x`` and ``y`` ``[1, BK]`` (zeros past C) and its pairs' decays with the rows of
    ``D [SUB, BK]``, each its own exponent clamped ≤ 0: ``e^{D_i − D_t}`` (t the column), or ``e^{D_t − D_j}`` where
    ``LATER`` (t the row); pairs the other way round are the caller's to mask. (One function, no calls inside: the
    interpreter's cost is per call.)"""
    c = tl.arange(0, BK)
    at, mask = tile * (C * DK) + t * DK + c, (c < DK) & (c * 0 + t < C)
    d_t = tl.load(log_decay + at, mask=mask, other=0.0)[None, :]
    exponent = d_t - D if LATER else D - d_t
    return (tl.load(x + at, mask=mask, other=0.0)[None, :], tl.load(y + at, mask=mask, other=0.0)[None, :],
            tl.exp(tl.minimum(exponent, 0.0)))


@triton.jit
def _through_end(k, log_decay, D, tile, j0, C: tl.constexpr, DK: tl.constexpr, SUB: tl.constexpr,
                 BK: tl.constexpr):
    """For the rows of ``D`` against the earlier sub-chunk from ``j0``, with r its last token: the rows' factor
    ``e^{D_i − D_r}`` and its keys ``k_j e^{D_r − D_j}``, both ≤ 1 (the first is clamped: rows past C read D = 0,
    their q and k 0)."""
    d_r = _token(log_decay, tile, j0 + SUB - 1, C, DK, BK)[None, :]
    at_j, mask_j = _sub_chunk(tile, j0, C, DK, SUB, BK)
    K_j = tl.load(k + at_j, mask=mask_j, other=0.0) * tl.exp(
        tl.minimum(d_r - tl.load(log_decay + at_j, mask=mask_j, other=0.0), 0.0))
    return tl.exp(tl.minimum(D - d_r, 0.0)), K_j


@triton.jit
def _products_kernel(
    q, k, log_decay, after, p_qk, p_kk, qd, kd, hands,
    C: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr, SUB: tl.constexpr, PRECISION: tl.constexpr,
):
    """Rows of one sub-chunk I of ``P^{qk}`` (j ≤ i) and ``P^{kk}`` (j < i), per (chunk, head, I), zero above the
    diagonal; and of what the UT transform and the scan read besides, ``Q ⊙ e^D``, ``K ⊙ e^D`` and
    ``K ⊙ e^{D_C − D}`` (``after``: D_C − D)."""
    tile, i0, at, mask, Q, K, D = _sub_chunk_program(q, k, log_decay, C, DK, SUB, BK)
    e_d = tl.exp(D)
    tl.store(qd + at, Q * e_d, mask=mask)
    tl.store(kd + at, K * e_d, mask=mask)
    tl.store(hands + at, K * tl.exp(tl.load(after + at, mask=mask, other=0.0)), mask=mask)
    rows, cols = i0 + tl.arange(0, SUB), tl.arange(0, SUB)
    P_qk = tl.zeros([SUB, SUB], dtype=tl.float32)
    P_kk = tl.zeros([SUB, SUB], dtype=tl.float32)
    for j in range(SUB):  # the sub-chunk with itself: column j, each pair its own exponent (> 0 above: masked)
        k_j, _, decays = _pair_weights(k, k, log_decay, D, tile, i0 + j, C, DK, BK, False)
        weighted = k_j * decays
        P_qk = tl.where(cols[None, :] == j, tl.sum(Q * weighted, 1)[:, None], P_qk)
        P_kk = tl.where(cols[None, :] == j, tl.sum(K * weighted, 1)[:, None], P_kk)
    at_p, mask_p = _pairs(tile, rows, i0 + cols, C)
    tl.store(p_qk + at_p, tl.where(cols[None, :] <= cols[:, None], P_qk, 0.0), mask=mask_p)
    tl.store(p_kk + at_p, tl.where(cols[None, :] < cols[:, None], P_kk, 0.0), mask=mask_p)
    for j0 in range(0, i0, SUB):  # an earlier sub-chunk, through the decay at its last token r: factors ≤ 1
        e_i, K_j = _through_end(k, log_decay, D, tile, j0, C, DK, SUB, BK)
        at_p, mask_p = _pairs(tile, rows, j0 + cols, C)
        tl.store(p_qk + at_p, _mm(Q * e_i, tl.trans(K_j), None, PRECISION), mask=mask_p)
        tl.store(p_kk + at_p, _mm(K * e_i, tl.trans(K_j), None, PRECISION), mask=mask_p)
    for j0 in range(i0 + SUB, C, SUB):  # later ones: nothing (causal)
        at_p, mask_p = _pairs(tile, rows, j0 + cols, C)
        tl.store(p_qk + at_p, tl.zeros([SUB, SUB], dtype=tl.float32), mask=mask_p)
        tl.store(p_kk + at_p, tl.zeros([SUB, SUB], dtype=tl.float32), mask=mask_p)


@triton.jit
def _products_backward_kernel(
    q, k, log_decay, after, d_p_qk, d_p_kk, d_qd, d_kd, d_hands, dq, dk, dlog, d_after,
    C: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr, SUB: tl.constexpr, PRECISION: tl.constexpr,
):
    """The products' gradient on the rows of one sub-chunk I, per (chunk, head, I): as a row i (q's and k's rows
    against the columns j ≤ i, ``Σ_j dP_ij k_j e^{D_i − D_j}``) and as a column j (k's against the rows i ≥ j,
    ``Σ_i dP_ij x_i e^{D_i − D_j}``), whence dQ, dK and the log-decay's gradient ``x ⊙ dX − k ⊙ dK_col`` over the
    pairs i ≠ j; a pair with itself (``P^{qk}``'s diagonal, no decay) adds to dQ and dK only. With the gradients of
    ``Q ⊙ e^D``, ``K ⊙ e^D`` and ``K ⊙ e^{D_C − D}`` (the forward kernel's other outputs), the whole of dQ, dK, D's
    gradient and that of ``D_C − D``."""
    tile, i0, at, mask, Q, K, D = _sub_chunk_program(q, k, log_decay, C, DK, SUB, BK)
    rows, cols = i0 + tl.arange(0, SUB), tl.arange(0, SUB)
    dQ = tl.zeros([SUB, BK], dtype=tl.float32)  # as rows: of q (P^{qk}) and of k (P^{kk})
    dK_row = tl.zeros([SUB, BK], dtype=tl.float32)
    for j in range(SUB):  # inside the sub-chunk, pairs j < i one by one
        k_j, _, decays = _pair_weights(k, k, log_decay, D, tile, i0 + j, C, DK, BK, False)
        weighted = k_j * decays
        at_p = tile * (C * C) + rows * C + i0 + j  # column j, rows i > j
        below = (cols > j) & (rows < C)
        dQ += tl.load(d_p_qk + at_p, mask=below, other=0.0)[:, None] * weighted
        dK_row += tl.load(d_p_kk + at_p, mask=below, other=0.0)[:, None] * weighted
    for j0 in range(0, i0, SUB):  # earlier sub-chunks, through the decay at their last token
        e_i, K_j = _through_end(k, log_decay, D, tile, j0, C, DK, SUB, BK)
        at_p, mask_p = _pairs(tile, rows, j0 + cols, C)
        dQ += _mm(tl.load(d_p_qk + at_p, mask=mask_p, other=0.0), K_j, None, PRECISION) * e_i
        dK_row += _mm(tl.load(d_p_kk + at_p, mask=mask_p, other=0.0), K_j, None, PRECISION) * e_i
    dK_col = tl.zeros([SUB, BK], dtype=tl.float32)  # as columns: k's, against q's rows and k's
    for i in range(SUB):  # inside the sub-chunk, pairs i > j one by one
        q_i, k_i, decays = _pair_weights(q, k, log_decay, D, tile, i0 + i, C, DK, BK, True)
        at_p = tile * (C * C) + (i0 + i) * C + rows  # row i, columns j < i
        above = (cols < i) & (rows * 0 + i0 + i < C)
        dK_col += (tl.load(d_p_qk + at_p, mask=above, other=0.0)[:, None] * q_i
                   + tl.load(d_p_kk + at_p, mask=above, other=0.0)[:, None] * k_i) * decays
    d_r = _token(log_decay, tile, i0 + SUB - 1, C, DK, BK)[None, :]  # (read only when later sub-chunks exist)
    later = tl.zeros([SUB, BK], dtype=tl.float32)
    for l0 in range(i0 + SUB, C, SUB):  # later sub-chunks, through the decay at this one's last token
        at_l, mask_l = _sub_chunk(tile, l0, C, DK, SUB, BK)
        e_l = tl.exp(tl.minimum(tl.load(log_decay + at_l, mask=mask_l, other=0.0) - d_r, 0.0))
        at_p, mask_p = _pairs(tile, l0 + cols, rows, C)
        later = _mm(tl.trans(tl.load(d_p_qk + at_p, mask=mask_p, other=0.0)),
                    tl.load(q + at_l, mask=mask_l, other=0.0) * e_l, later, PRECISION)
        later = _mm(tl.trans(tl.load(d_p_kk + at_p, mask=mask_p, other=0.0)),
                    tl.load(k + at_l, mask=mask_l, other=0.0) * e_l, later, PRECISION)
    dK_col += later * tl.exp(tl.minimum(d_r - D, 0.0))
    e_d = tl.exp(D)
    d_QD = tl.load(d_qd + at, mask=mask, other=0.0) * e_d
    d_KD = tl.load(d_kd + at, mask=mask, other=0.0) * e_d
    tl.store(dlog + at, Q * (dQ + d_QD) + K * (dK_row + d_KD - dK_col), mask=mask)
    diagonal = tl.load(d_p_qk + tile * (C * C) + rows * (C + 1), mask=rows < C, other=0.0)[:, None]  # no decay
    tl.store(dq + at, dQ + diagonal * K + d_QD, mask=mask)
    d_H = tl.load(d_hands + at, mask=mask, other=0.0) * tl.exp(tl.load(after + at, mask=mask, other=0.0))
    tl.store(d_after + at, d_H * K, mask=mask)
    tl.store(dk + at, dK_row + dK_col + diagonal * Q + d_KD + d_H, mask=mask)


@triton.jit
def _ut_forward_kernel(
    p_kk, beta, kd, v, a, w, u,
    C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Per (chunk, head): ``A = (I + β P^{kk})⁻¹``, ``W = (A ⊙ β) (K ⊙ e^D)``, ``U = (A ⊙ β) V`` (columns of A
    scaled); writes A too, for backward. ``kd``: K ⊙ e^D."""
    tile = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BC)
    b = tl.load(beta + tile * C + rows, mask=rows < C, other=0.0)
    at_a, mask_a = _tile_offsets(tile, C, C, 0, BC, BC)
    A = _unit_lower_inverse(b[:, None] * tl.load(p_kk + at_a, mask=mask_a, other=0.0), C, BC)
    tl.store(a + at_a, A, mask=mask_a)
    at_k, mask_k = _tile_offsets(tile, C, DK, 0, BC, BK)
    tl.store(w + at_k, _mm(A * b[None, :], tl.load(kd + at_k, mask=mask_k, other=0.0), None, PRECISION), mask=mask_k)
    at_v, mask_v = _tile_offsets(tile, C, DV, 0, BC, BVF)
    tl.store(u + at_v, _mm(A * b[None, :], tl.load(v + at_v, mask=mask_v, other=0.0), None, PRECISION), mask=mask_v)


@triton.jit
def _ut_backward_kernel(
    p_kk, beta, kd, v, a, dw, du, d_p_kk, d_kd, dv, dbeta,
    C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BC: tl.constexpr, BW: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The UT transform's gradient per (chunk, head), with X = β (K ⊙ e^D), Y = β V: ``dX = Aᵀ dW``, ``dY = Aᵀ dU``,
    ``dA = dW Xᵀ + dU Yᵀ`` and through the inverse ``dM = −Aᵀ dA Aᵀ`` (strictly lower, M = β P^{kk}); writes the
    gradients of P^{kk}, K ⊙ e^D, V and β. Key and value channels in blocks of ``BW``."""
    tile = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BC)
    b = tl.load(beta + tile * C + rows, mask=rows < C, other=0.0)
    at_a, mask_a = _tile_offsets(tile, C, C, 0, BC, BC)
    A = tl.load(a + at_a, mask=mask_a, other=0.0)
    dA, db = _scaled_rows_backward(kd, dw, d_kd, A, b, tl.zeros([BC, BC], dtype=tl.float32),
                                   tl.zeros([BC], dtype=tl.float32), tile, C, DK, BC, BW, PRECISION)
    dA, db = _scaled_rows_backward(v, du, dv, A, b, dA, db, tile, C, DV, BC, BW, PRECISION)
    strict = (rows[:, None] > rows[None, :]) & (rows < C)[:, None]
    dM = tl.where(strict, -_mm(tl.trans(A), _mm(dA, tl.trans(A), None, PRECISION), None, PRECISION), 0.0)
    db += tl.sum(dM * tl.load(p_kk + at_a, mask=mask_a, other=0.0), 1)
    tl.store(dbeta + tile * C + rows, db, mask=rows < C)
    tl.store(d_p_kk + at_a, dM * b[:, None], mask=mask_a)


@triton.jit
def _scan_kernel(
    w, u, qd, hands, p_qk, decay, initial, out, final, states, delta, first_chunk, base, kv,
    H: tl.constexpr, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, OUTPUT: tl.constexpr, ADDS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Over the chunks of one document and head, from its state in ``initial``: Δ = U − W S, then (``OUTPUT``)
    O = (Q ⊙ e^D) S + P^{qk} Δ and the state after the chunks, or (backward's) the state entering each chunk and Δ;
    S ← e^{D_C} ⊙ S + (K ⊙ e^{D_C − D})ᵀ Δ. ``qd``: Q ⊙ e^D; ``hands``: K ⊙ e^{D_C − D}; ``decay``: e^{D_C} per
    chunk, head and key channel. ``ADDS`` (the general rule's, ``triton_general.py``): terms that do not depend on
    the state, ``base [n, H, C, Dv]`` added to O and ``kv [n, H, Dk, Dv]`` to the chunk's update."""
    i_h, c0, c1, v0, state_at, state_mask, S = _scan_program(first_chunk, initial, H, DK, DV, BK, BV)
    channels = tl.arange(0, BK)
    for c in range(c0, c1):
        tile = c * H + i_h  # int64: the offsets are loaded as such
        at_k, mask_k = _tile_offsets(tile, C, DK, 0, BC, BK)
        at_v, mask_v = _tile_offsets(tile, C, DV, v0, BC, BV)
        if not OUTPUT:
            at, mask = _tile_offsets(tile, DK, DV, v0, BK, BV)
            tl.store(states + at, S, mask=mask)
        d = tl.load(u + at_v, mask=mask_v, other=0.0) - _mm(tl.load(w + at_k, mask=mask_k, other=0.0), S, None,
                                                            PRECISION)
        if OUTPUT:
            at_a, mask_a = _tile_offsets(tile, C, C, 0, BC, BC)
            o = _mm(tl.load(p_qk + at_a, mask=mask_a, other=0.0), d,
                    _mm(tl.load(qd + at_k, mask=mask_k, other=0.0), S, None, PRECISION), PRECISION)
            if ADDS:
                o += tl.load(base + at_v, mask=mask_v, other=0.0)
            tl.store(out + at_v, o, mask=mask_v)
        else:
            tl.store(delta + at_v, d, mask=mask_v)
        e_last = tl.load(decay + tile * DK + channels, mask=channels < DK, other=0.0)
        S = _mm(tl.trans(tl.load(hands + at_k, mask=mask_k, other=0.0)), d, S * e_last[:, None], PRECISION)
        if ADDS:
            at, mask = _tile_offsets(tile, DK, DV, v0, BK, BV)
            S += tl.load(kv + at, mask=mask, other=0.0)
    if OUTPUT:
        tl.store(final + state_at, S, mask=state_mask)


@triton.jit
def _scan_backward_kernel(
    w, hands, decay, d_states, d_delta, d_final, grad_after, delta_grad, d_initial, first_chunk,
    H: tl.constexpr, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    """The scan's adjoint, chunks in reverse from the final states' gradient: writes G (the gradient of the state
    leaving each chunk), the total gradient of Δ per token, ``dΔ_out + (K ⊙ e^{D_C − D}) G``, and G before the first
    chunk (the initial state's gradient); ``G ← dS_out + e^{D_C} ⊙ G − Wᵀ dΔ``."""
    i_h, c0, c1, v0, state_at, state_mask, G = _scan_program(first_chunk, d_final, H, DK, DV, BK, BV)
    channels = tl.arange(0, BK)
    for i in range(c1 - c0):
        tile = (c1 - 1 - i) * H + i_h
        at, mask = _tile_offsets(tile, DK, DV, v0, BK, BV)
        tl.store(grad_after + at, G, mask=mask)
        at_k, mask_k = _tile_offsets(tile, C, DK, 0, BC, BK)
        at_v, mask_v = _tile_offsets(tile, C, DV, v0, BC, BV)
        dd = _mm(tl.load(hands + at_k, mask=mask_k, other=0.0), G, tl.load(d_delta + at_v, mask=mask_v, other=0.0),
                 PRECISION)
        tl.store(delta_grad + at_v, dd, mask=mask_v)
        e_last = tl.load(decay + tile * DK + channels, mask=channels < DK, other=0.0)
        G = tl.load(d_states + at, mask=mask, other=0.0) + G * e_last[:, None] \
            - _mm(tl.trans(tl.load(w + at_k, mask=mask_k, other=0.0)), dd, None, PRECISION)
    tl.store(d_initial + state_at, G, mask=state_mask)


@triton.jit
def _output_backward_kernel(
    qd, p_qk, states, delta, d_out, d_states, d_delta, d_p_qk, d_qd,
    C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    """The output stage's adjoint per (chunk, head), from dO and the chunk's entering state S and Δ: the gradients
    of S, ``(Q ⊙ e^D)ᵀ dO``, and of Δ, ``P^{qkᵀ} dO``, value block by value block, while those of P^{qk},
    ``dO Δᵀ`` (on its lower triangle), and of Q ⊙ e^D, ``dO Sᵀ``, sum over them."""
    tile = tl.program_id(0).to(tl.int64)
    at_k, mask_k = _tile_offsets(tile, C, DK, 0, BC, BK)
    at_a, mask_a = _tile_offsets(tile, C, C, 0, BC, BC)
    QD = tl.load(qd + at_k, mask=mask_k, other=0.0)
    P = tl.load(p_qk + at_a, mask=mask_a, other=0.0)
    dP = tl.zeros([BC, BC], dtype=tl.float32)
    dQD = tl.zeros([BC, BK], dtype=tl.float32)
    for v0 in range(0, DV, BV):
        at, mask = _tile_offsets(tile, DK, DV, v0, BK, BV)
        at_v, mask_v = _tile_offsets(tile, C, DV, v0, BC, BV)
        dO = tl.load(d_out + at_v, mask=mask_v, other=0.0)
        tl.store(d_states + at, _mm(tl.trans(QD), dO, None, PRECISION), mask=mask)
        tl.store(d_delta + at_v, _mm(tl.trans(P), dO, None, PRECISION), mask=mask_v)
        dP = _mm(dO, tl.trans(tl.load(delta + at_v, mask=mask_v, other=0.0)), dP, PRECISION)
        dQD = _mm(dO, tl.trans(tl.load(states + at, mask=mask, other=0.0)), dQD, PRECISION)
    rows = tl.arange(0, BC)
    tl.store(d_p_qk + at_a, tl.where(rows[:, None] >= rows[None, :], dP, 0.0), mask=mask_a)
    tl.store(d_qd + at_k, dQD, mask=mask_k)


@triton.jit
def _state_grads_kernel(
    decay, states, grad_after, delta, delta_grad, dw, d_hands, d_last,
    C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    """What a chunk's inputs get through the state, per (chunk, head), from its entering state S, G (the gradient of
    the state leaving it), Δ and dΔ: ``dW = −dΔ Sᵀ``, ``d(K ⊙ e^{D_C − D}) = Δ Gᵀ`` and, per key channel,
    ``e^{D_C}``'s ``Σ S ⊙ G`` times e^{D_C} (the gradient of the chunk's summed gate). All sum over value blocks."""
    tile = tl.program_id(0).to(tl.int64)
    d_w, d_h, through_decay = _through_state(states, grad_after, delta, delta_grad, tile, C, DK, DV, BC, BK, BV,
                                             PRECISION)
    at_k, mask_k = _tile_offsets(tile, C, DK, 0, BC, BK)
    tl.store(dw + at_k, -d_w, mask=mask_k)
    tl.store(d_hands + at_k, d_h, mask=mask_k)
    channels = tl.arange(0, BK)
    at_c = tile * DK + channels
    tl.store(d_last + at_c, through_decay * tl.load(decay + at_c, mask=channels < DK, other=0.0), mask=channels < DK)


def _products(Q, K, D, after, precision):
    """``(P^{qk}, P^{kk})`` ``[n, H, C, C]`` and ``Q ⊙ e^D``, ``K ⊙ e^D``, ``K ⊙ e^{D_C − D}`` of chunk tensors
    ``[n, H, C, Dk]``."""
    n, heads, size, dk = Q.shape
    p_qk, p_kk = (Q.new_empty(n, heads, size, size) for _ in range(2))
    qd, kd, hands = (torch.empty_like(Q) for _ in range(3))
    _products_kernel[(n * heads, triton.cdiv(size, SUB))](Q, K, D, after, p_qk, p_kk, qd, kd, hands,
                                                          **_products_geometry(size, dk, precision))
    return p_qk, p_kk, qd, kd, hands


def _products_backward(f: "_Factors", dP_qk, dP_kk, dQD, dKD, d_hands, precision):
    """The gradients of the forward products kernel's outputs → dQ, dK, and the gradients of D and of D_C − D."""
    n, heads, size, dk = f.Q.shape
    dq, dk_out, dlog, d_after = (torch.empty_like(f.Q) for _ in range(4))
    _products_backward_kernel[(n * heads, triton.cdiv(size, SUB))](
        f.Q, f.K, f.D, f.after, dP_qk, dP_kk, dQD, dKD, d_hands, dq, dk_out, dlog, d_after,
        **_products_geometry(size, dk, precision))
    return dq, dk_out, dlog, d_after


def _products_geometry(size, dk, precision) -> dict:
    return dict(C=size, DK=dk, BK=max(16, triton.next_power_of_2(dk)), SUB=SUB, PRECISION=precision,
                **_launch(PRODUCTS_CONFIG))


class _Factors:
    """A block's chunk tensors ``[n, H, C, *]`` (fp32) and what the scan reads, made once in forward and again in
    backward: D, ``D_C − D`` (a suffix sum of the later gates), the products, ``Q ⊙ e^D``, ``K ⊙ e^D``,
    ``K ⊙ e^{D_C − D}``, A, W, U and ``e^{D_C}``."""

    def __init__(self, q, k, v, beta, g, chunks, precision):
        self.Q, self.K, self.V, self.B, G = (_chunk_rows(x, chunks) for x in (q, k, v, beta, g))
        self.D, self.after = _log_decays(G)
        self.P_qk, self.P_kk, self.QD, self.KD, self.hands = _products(self.Q, self.K, self.D, self.after, precision)
        n, heads, size, dk = self.K.shape
        self.A, self.W, self.U = self.K.new_empty(n, heads, size, size), torch.empty_like(self.K), torch.empty_like(
            self.V)
        _ut_forward_kernel[(n * heads,)](self.P_kk, self.B, self.KD, self.V, self.A, self.W, self.U,
                                         **_ut_geometry(size, dk, self.V.shape[-1], precision, UT_CONFIG))
        self.decay = self.D[:, :, -1].exp().contiguous()  # [n, H, Dk]


def _scan(f: _Factors, p_delta, starting, first_chunk, precision, *, output: bool, adds=None):
    """The scan over chunks from ``starting``, ``p_delta`` the product that multiplies Δ in O (``f.P_qk``): (O, the
    state after each document) with ``output``, else (the state entering each chunk, Δ). ``adds``: None, or the
    general rule's (base, kv), ``_scan_kernel``'s."""
    n, heads, size, dk = f.W.shape
    dv, docs = f.U.shape[-1], first_chunk.numel() - 1
    if output:
        out, final = torch.empty_like(f.U), f.W.new_empty(docs, heads, dk, dv)
        states = delta = out  # not written
    else:
        states, delta = f.W.new_empty(n, heads, dk, dv), torch.empty_like(f.U)
        out = final = delta  # not written
    geometry = _geometry(size, dk, dv, precision, CONFIG)
    _scan_kernel[(docs * heads, triton.cdiv(dv, geometry["BV"]))](
        f.W, f.U, f.QD, f.hands, p_delta, f.decay, starting, out, final, states, delta, first_chunk,
        *(adds or (out, out)), H=heads, OUTPUT=output, ADDS=adds is not None, **geometry)
    return (out, final) if output else (states, delta)


class _Block(torch.autograd.Function):
    """One block of chunks, as the delta rule's ``_Block`` (same arguments and results; g ``[n·C, H, Dk]``).
    Forward: the products, the UT transform and the scan with the output inside; keeps only its inputs. Backward:
    all of those again (the scan writing each chunk's entering state and Δ instead of O), then by hand: the output
    stage's adjoint, the reverse scan, what each chunk gets through the state, the UT transform's gradient, the
    products', and the gates' shares gathered into g's gradient."""

    @staticmethod
    def forward(ctx, q, k, v, beta, g, starting, first_chunk, chunks, precision):
        f = _Factors(q, k, v, beta, g, chunks, precision)
        out, final = _scan(f, f.P_qk, starting, first_chunk, precision, output=True)
        _keep_inputs(ctx, (q, k, v, beta, g, starting, first_chunk), chunks, precision)
        return _token_rows(out, q.dtype), final

    @staticmethod
    def backward(ctx, d_rows, d_final):
        q, k, v, beta, g, starting, first_chunk, chunks, precision = _kept_inputs(ctx)
        f = _Factors(q, k, v, beta, g, chunks, precision)
        _, dP_qk, dQD, d_starting, _, d_delta, dW, d_hands, d_last = _through_scan(
            f, f.P_qk, starting, first_chunk, d_rows, d_final, chunks, precision)
        n, heads, size, dk = f.K.shape
        dP_kk, dKD, dV, dB = (torch.empty_like(x) for x in (f.P_kk, f.KD, f.V, f.B))
        _ut_backward_kernel[(n * heads,)](f.P_kk, f.B, f.KD, f.V, f.A, dW, d_delta, dP_kk, dKD, dV, dB,
                                          **_ut_backward_geometry(size, dk, f.V.shape[-1], precision, UT_CONFIG))
        dQ, dK, dD, d_after = _products_backward(f, dP_qk, dP_kk, dQD, dKD, d_hands, precision)
        grads = (_token_rows(x, t.dtype) for x, t in zip((dQ, dK, dV, dB, _gate_grad(dD, d_after, d_last)),
                                                        (q, k, v, beta, g)))
        return *grads, d_starting, None, None, None


def _through_scan(f, p_delta, starting, first_chunk, d_rows, d_final, chunks, precision, adds=None):
    """Backward's way through the scan, from the recomputed factors (``p_delta``, ``adds``: ``_scan``'s): the scan
    again (each chunk's entering state and Δ), the output stage's adjoint, the reverse scan and what each chunk gets
    through the state → (dO, dP of ``p_delta``, d(Q ⊙ e^D), the starting states' gradient, G (the gradient of the
    state leaving each chunk), dΔ, dW, d hands, and e^{D_C}'s share of the chunk's summed gate's gradient), chunk
    tensors. dO: zeros when o got no gradient."""
    states, delta = _scan(f, p_delta, starting, first_chunk, precision, output=False, adds=adds)
    dO = torch.zeros_like(f.U) if d_rows is None else _chunk_rows(d_rows, chunks)
    n, heads, size, dk = f.W.shape
    dv, docs = f.U.shape[-1], first_chunk.numel() - 1
    d_states, d_delta_out, dP, dQD = (torch.empty_like(x) for x in (states, delta, p_delta, f.QD))
    _output_backward_kernel[(n * heads,)](f.QD, p_delta, states, delta, dO, d_states, d_delta_out, dP, dQD,
                                          **_per_chunk_geometry(size, dk, dv, precision, CONFIG, UT_CONFIG))
    grad_after, d_delta = torch.empty_like(d_states), torch.empty_like(d_delta_out)
    d_starting = d_states.new_empty(docs, heads, dk, dv)
    geometry = _geometry(size, dk, dv, precision, CONFIG)
    _scan_backward_kernel[(docs * heads, triton.cdiv(dv, geometry["BV"]))](
        f.W, f.hands, f.decay, d_states, d_delta_out,
        torch.zeros_like(d_starting) if d_final is None else d_final.contiguous(), grad_after, d_delta,
        d_starting, first_chunk, H=heads, **geometry)
    dW, d_hands, d_last = torch.empty_like(f.W), torch.empty_like(f.hands), torch.empty_like(f.decay)
    _state_grads_kernel[(n * heads,)](f.decay, states, grad_after, delta, d_delta, dW, d_hands, d_last,
                                      **_per_chunk_geometry(size, dk, dv, precision, CONFIG, UT_CONFIG))
    return dO, dP, dQD, d_starting, grad_after, d_delta, dW, d_hands, d_last


def _log_decays(G):
    """D (the gates summed from the chunk's start) and D_C − D as a sum of the later gates, of chunk gates
    ``[n, H, C, Dk]``."""
    return G.cumsum(2), F.pad(G.flip(2).cumsum(2).flip(2)[:, :, 1:], (0, 0, 0, 1))


def _gate_grad(dD, d_after, d_last):
    """g's gradient from those of D, of D_C − D and of D_C (``d_last [n, H, Dk]``)."""
    # D_C − D is a sum of the later gates (the last token's: none, a constant 0); D_C the sum of every gate
    d_after = F.pad(d_after[:, :, :-1], (0, 0, 1, 0)).cumsum(2)
    return dD.flip(2).cumsum(2).flip(2) + d_after + d_last[:, :, None]


def kda_triton(q, k, v, beta, g, **options):
    """``kda_delta_rule(..., impl="triton")``: same arguments (checked there) and results."""
    return run_in_blocks(_Block, "kda_delta_rule", q, k, v, beta, g, **options)
