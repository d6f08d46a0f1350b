"""The diagonal-plus-low-rank rule's chunked form in Triton for arbitrary a, b (docs/MIXERS.md#dplr, "Triton form";
RWKV-7's case), on KDA's kernels (``triton.py``).

``S_t = (Diag(e^{g_t}) + a_t b_tᵀ) S_{t−1} + k_t v_tᵀ``. With ``n = −a``, the chunk of ``dplr/chunk.py``

    U = A' (P^{bk} V) + W S,   A' = (I + P^{bn})⁻¹,   W = A' (B ⊙ e^{D⁻})
    O = (Q ⊙ e^D) S − P^{qn} U + P^{qk} V,   S ← e^{D_C} ⊙ S − (N ⊙ e^{D_C − D})ᵀ U + (K ⊙ e^{D_C − D})ᵀ V

is KDA's with β = 1, ``P^{kk} → P^{bn}``, ``K ⊙ e^D → B ⊙ e^{D⁻}``, ``β V → −P^{bk} V`` (so that ``Δ = U' − W S``
is −U), ``P^{qk} → P^{qn}``, KDA's hands → ``N ⊙ e^{D_C − D}``, and two terms that do not depend on the state:
``P^{qk} V`` added to O and ``(K ⊙ e^{D_C − D})ᵀ V`` to the state's update (the scan's ``ADDS``). So KDA's UT
transform, scan, output-stage adjoint, reverse scan and state gradients run as they are; the terms in V and their
gradients (``dP^{qk} = dO Vᵀ``, ``dP^{bk} = −dY Vᵀ`` with Y = −P^{bk} V, and V's share of each) are batched
matrix products.

What differs is the products: four per chunk, q's and b's rows against n's and k's. b_t reads the state before its
own token's decay, so its rows decay by ``D⁻_t = D_{t−1}``: they are computed as the rows of ``b_{t+1}`` at t, with
q's decays, and stored a row down (``P^{b·}``'s row 0, of a token that reads only the entering state, is zero). In
that frame a pair of b with the token before it is a diagonal pair, undecayed, as q's with itself: the backward
keeps both out of the log-decay's gradient (their ± terms of size 1 would cancel into g's gradient, which is ~e^g
where gates are strong). The sub-chunks and clamped exponents are KDA's (overflow-free at any gate ≤ 0). Kernels,
one program per (chunk, head, sub-chunk of 16 rows): the products, one launch per row operand (q's, then b's);
their gradient as rows, one launch per row operand (dq, db, and each one's share of D's gradient), then as columns
(dn, dk, ``D_C − D``'s gradient and D's whole). Under ``TRITON_INTERPRET=1`` the kernels run on CPU; the tests hold
them to ``dplr_chunk``.
"""
import torch
import triton
import triton.language as tl

from ..delta_rule.triton import (
    _chunk_rows,
    _keep_inputs,
    _kept_inputs,
    _mm,
    _token_rows,
    _ut_backward_geometry,
    _ut_geometry,
    run_in_blocks,
)
from .triton import (
    SUB,
    UT_CONFIG,
    _gate_grad,
    _log_decays,
    _pair_weights,
    _pairs,
    _products_geometry,
    _scan,
    _sub_chunk,
    _through_end,
    _through_scan,
    _token,
    _ut_backward_kernel,
    _ut_forward_kernel,
)

# Launch settings from the resource report (`tools/triton_resource_report.py --op dplr`; C = 64, Dk = Dv = 128, TF32;
# no GPU timed yet): the products' forward and the columns' gradient at KDA's PRODUCTS_CONFIG (4 warps: 255 and 254
# registers, no spills, 2 blocks per SM); the rows' gradient at 8 warps (128 and 190 registers; at 4, q's spills
# 16 B a thread).
ROWS_BACKWARD_CONFIG = dict(num_warps=8, num_stages=1)

__all__ = ["dplr_triton"]


@triton.jit
def _products_kernel(
    x, n, k, log_decay, after, p_xn, p_xk, xd, hands_n, hands_k,
    C: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr, SUB: tl.constexpr, SHIFT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Per (chunk, head, sub-chunk I), x's rows of I against n's and k's columns j ≤ i, each row decaying by D_i:
    q's (``SHIFT`` 0: ``P^{qn}``, ``P^{qk}``), or b's a row down (``SHIFT`` 1: ``b_{t+1}`` at row t, stored a row
    down: ``P^{bn}``, ``P^{bk}``, j < i), zero above; and ``X ⊙ e^D`` in the same rows (b's: ``B ⊙ e^{D⁻}``). q's
    launch writes ``N ⊙ e^{D_C − D}`` and ``K ⊙ e^{D_C − D}`` too (``after``: D_C − D); b's rows 0 are the
    caller's. One row operand a launch: both in one program spill on sm_90 (as does writing b's rows 0 here)."""
    tile = tl.program_id(0).to(tl.int64)
    i0 = tl.program_id(1) * SUB
    at, mask = _sub_chunk(tile, i0, C, DK, SUB, BK)
    at_x, mask_x = _sub_chunk(tile, i0 + SHIFT, C, DK, SUB, BK)
    X = tl.load(x + at_x, mask=mask_x, other=0.0)
    D = tl.load(log_decay + at, mask=mask, other=0.0)
    tl.store(xd + at_x, X * tl.exp(D), mask=mask_x)
    if SHIFT == 0:
        e_after = tl.exp(tl.load(after + at, mask=mask, other=0.0))
        tl.store(hands_n + at, tl.load(n + at, mask=mask, other=0.0) * e_after, mask=mask)
        tl.store(hands_k + at, tl.load(k + at, mask=mask, other=0.0) * e_after, mask=mask)
    rows, cols = i0 + tl.arange(0, SUB), tl.arange(0, SUB)
    P_n = tl.zeros([SUB, SUB], dtype=tl.float32)
    P_k = tl.zeros([SUB, SUB], dtype=tl.float32)
    for j in range(SUB):  # the sub-chunk with itself: column j, each pair its own exponent (> 0 above: masked)
        n_j, k_j, decays = _pair_weights(n, k, log_decay, D, tile, i0 + j, C, DK, BK, False)
        P_n = tl.where(cols[None, :] == j, tl.sum(X * n_j * decays, 1)[:, None], P_n)
        P_k = tl.where(cols[None, :] == j, tl.sum(X * k_j * decays, 1)[:, None], P_k)
    lower = cols[None, :] <= cols[:, None]
    at_p, mask_p = _pairs(tile, rows + SHIFT, i0 + cols, C)
    tl.store(p_xn + at_p, tl.where(lower, P_n, 0.0), mask=mask_p)
    tl.store(p_xk + at_p, tl.where(lower, P_k, 0.0), mask=mask_p)
    for j0 in range(0, i0, SUB):  # an earlier sub-chunk, through the decay at its last token r: factors ≤ 1
        e_i, N_j = _through_end(n, log_decay, D, tile, j0, C, DK, SUB, BK)
        _, K_j = _through_end(k, log_decay, D, tile, j0, C, DK, SUB, BK)
        at_p, mask_p = _pairs(tile, rows + SHIFT, j0 + cols, C)
        XE = X * e_i
        tl.store(p_xn + at_p, _mm(XE, tl.trans(N_j), None, PRECISION), mask=mask_p)
        tl.store(p_xk + at_p, _mm(XE, tl.trans(K_j), None, PRECISION), mask=mask_p)
    for j0 in range(i0 + SUB, C, SUB):  # later ones: nothing (causal)
        at_p, mask_p = _pairs(tile, rows + SHIFT, j0 + cols, C)
        tl.store(p_xn + at_p, tl.zeros([SUB, SUB], dtype=tl.float32), mask=mask_p)
        tl.store(p_xk + at_p, tl.zeros([SUB, SUB], dtype=tl.float32), mask=mask_p)


@triton.jit
def _rows_backward_kernel(
    x, n, k, log_decay, d_p_xn, d_p_xk, d_xd, dx, dlog_x,
    C: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr, SUB: tl.constexpr, SHIFT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """x's gradient (q's, or with ``SHIFT`` b's, rows as in the forward) on one sub-chunk I, per (chunk, head, I):
    ``Σ_j dP_ij y_j e^{D_i − D_j}`` over n's and k's columns j ≤ i (the pair with itself undecayed) and that of
    ``X ⊙ e^D``; writes dx and x's share of D's gradient, ``X ⊙ (dX + d(X ⊙ e^D))`` over the decayed pairs."""
    tile = tl.program_id(0).to(tl.int64)
    i0 = tl.program_id(1) * SUB
    at, mask = _sub_chunk(tile, i0, C, DK, SUB, BK)
    D = tl.load(log_decay + at, mask=mask, other=0.0)
    rows, cols = i0 + tl.arange(0, SUB), tl.arange(0, SUB)
    dX = tl.zeros([SUB, BK], dtype=tl.float32)
    for j in range(SUB):  # inside the sub-chunk, pairs j < i one by one
        n_j, k_j, decays = _pair_weights(n, k, log_decay, D, tile, i0 + j, C, DK, BK, False)
        at_p = tile * (C * C) + (rows + SHIFT) * C + i0 + j  # column j, rows i > j
        below = (cols > j) & (rows + SHIFT < C)
        dX += (tl.load(d_p_xn + at_p, mask=below, other=0.0)[:, None] * n_j
               + tl.load(d_p_xk + at_p, mask=below, other=0.0)[:, None] * k_j) * decays
    for j0 in range(0, i0, SUB):  # earlier sub-chunks, through the decay at their last token
        e_i, N_j = _through_end(n, log_decay, D, tile, j0, C, DK, SUB, BK)
        _, K_j = _through_end(k, log_decay, D, tile, j0, C, DK, SUB, BK)
        at_p, mask_p = _pairs(tile, rows + SHIFT, j0 + cols, C)
        dX += _mm(tl.load(d_p_xk + at_p, mask=mask_p, other=0.0), K_j,
                  _mm(tl.load(d_p_xn + at_p, mask=mask_p, other=0.0), N_j, None, PRECISION), PRECISION) * e_i
    at_x, mask_x = _sub_chunk(tile, i0 + SHIFT, C, DK, SUB, BK)
    d_XD = tl.load(d_xd + at_x, mask=mask_x, other=0.0) * tl.exp(D)
    tl.store(dlog_x + at, tl.load(x + at_x, mask=mask_x, other=0.0) * (dX + d_XD), mask=mask)
    diagonal = tile * (C * C) + (rows + SHIFT) * C + rows  # the pairs without decay
    d_n = tl.load(d_p_xn + diagonal, mask=rows + SHIFT < C, other=0.0)[:, None]
    d_k = tl.load(d_p_xk + diagonal, mask=rows + SHIFT < C, other=0.0)[:, None]
    dX += d_n * tl.load(n + at, mask=mask, other=0.0) + d_k * tl.load(k + at, mask=mask, other=0.0) + d_XD
    tl.store(dx + at_x, dX, mask=mask_x)
    if SHIFT == 1:
        if i0 == 0:  # the chunk's first b: its B ⊙ e^{D⁻} is itself
            channels = tl.arange(0, BK)
            tl.store(dx + tile * (C * DK) + channels, _token(d_xd, tile, 0, C, DK, BK), mask=channels < DK)


@triton.jit
def _columns_backward_kernel(
    q, b, n, k, log_decay, after, d_p_qn, d_p_qk, d_p_bn, d_p_bk, d_hn, d_hk, dlog_q, dlog_b, dn, dk, dlog, d_after,
    C: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr, SUB: tl.constexpr, PRECISION: tl.constexpr,
):
    """n's and k's gradients on one sub-chunk I as columns j, per (chunk, head, I): ``Σ_i dP_ij x_i e^{D_i − D_j}``
    over q's rows and b's (a row down) i ≥ j, the pairs without decay and the gradients of ``N ⊙ e^{D_C − D}`` and
    ``K ⊙ e^{D_C − D}``; writes dn, dk, that of ``D_C − D``, and D's whole gradient: the rows' shares (``dlog_q``,
    ``dlog_b``) less ``N ⊙ dN + K ⊙ dK`` over the decayed pairs."""
    tile = tl.program_id(0).to(tl.int64)
    i0 = tl.program_id(1) * SUB
    at, mask = _sub_chunk(tile, i0, C, DK, SUB, BK)
    D = tl.load(log_decay + at, mask=mask, other=0.0)
    rows, cols = i0 + tl.arange(0, SUB), tl.arange(0, SUB)
    d_r = _token(log_decay, tile, i0 + SUB - 1, C, DK, BK)[None, :]  # (read only when later sub-chunks exist)
    later_n = tl.zeros([SUB, BK], dtype=tl.float32)
    later_k = tl.zeros([SUB, BK], dtype=tl.float32)
    for l0 in range(i0 + SUB, C, SUB):  # later sub-chunks, through the decay at this one's last token
        at_l, mask_l = _sub_chunk(tile, l0, C, DK, SUB, BK)
        e_l = tl.exp(tl.minimum(tl.load(log_decay + at_l, mask=mask_l, other=0.0) - d_r, 0.0))
        Q_l = tl.load(q + at_l, mask=mask_l, other=0.0) * e_l
        at_p, mask_p = _pairs(tile, l0 + cols, rows, C)
        later_n = _mm(tl.trans(tl.load(d_p_qn + at_p, mask=mask_p, other=0.0)), Q_l, later_n, PRECISION)
        later_k = _mm(tl.trans(tl.load(d_p_qk + at_p, mask=mask_p, other=0.0)), Q_l, later_k, PRECISION)
        at_b, mask_b = _sub_chunk(tile, l0 + 1, C, DK, SUB, BK)
        B_l = tl.load(b + at_b, mask=mask_b, other=0.0) * e_l
        at_p, mask_p = _pairs(tile, l0 + 1 + cols, rows, C)
        later_n = _mm(tl.trans(tl.load(d_p_bn + at_p, mask=mask_p, other=0.0)), B_l, later_n, PRECISION)
        later_k = _mm(tl.trans(tl.load(d_p_bk + at_p, mask=mask_p, other=0.0)), B_l, later_k, PRECISION)
    e_r = tl.exp(tl.minimum(d_r - D, 0.0))
    dN, dK = later_n * e_r, later_k * e_r
    for i in range(SUB):  # inside the sub-chunk, pairs i > j one by one
        q_i, _, decays = _pair_weights(q, q, log_decay, D, tile, i0 + i, C, DK, BK, True)
        b_i = _token(b, tile, i0 + i + 1, C, DK, BK)[None, :]
        at_p = tile * (C * C) + (i0 + i) * C + rows  # row i, columns j < i (b's: a row down)
        above, above_b = (cols < i) & (rows * 0 + i0 + i < C), (cols < i) & (rows * 0 + i0 + i + 1 < C)
        dN += (tl.load(d_p_qn + at_p, mask=above, other=0.0)[:, None] * q_i
               + tl.load(d_p_bn + at_p + C, mask=above_b, other=0.0)[:, None] * b_i) * decays
        dK += (tl.load(d_p_qk + at_p, mask=above, other=0.0)[:, None] * q_i
               + tl.load(d_p_bk + at_p + C, mask=above_b, other=0.0)[:, None] * b_i) * decays
    N = tl.load(n + at, mask=mask, other=0.0)
    K = tl.load(k + at, mask=mask, other=0.0)
    rows_shares = tl.load(dlog_q + at, mask=mask, other=0.0) + tl.load(dlog_b + at, mask=mask, other=0.0)
    tl.store(dlog + at, rows_shares - N * dN - K * dK, mask=mask)
    e_after = tl.exp(tl.load(after + at, mask=mask, other=0.0))
    d_HN = tl.load(d_hn + at, mask=mask, other=0.0) * e_after
    d_HK = tl.load(d_hk + at, mask=mask, other=0.0) * e_after
    tl.store(d_after + at, d_HN * N + d_HK * K, mask=mask)
    diagonal = tile * (C * C) + rows * (C + 1)  # the pairs without decay: q's with itself, b's with the one before
    Q = tl.load(q + at, mask=mask, other=0.0)
    at_b, mask_b = _sub_chunk(tile, i0 + 1, C, DK, SUB, BK)
    B = tl.load(b + at_b, mask=mask_b, other=0.0)
    d_qn = tl.load(d_p_qn + diagonal, mask=rows < C, other=0.0)[:, None]
    d_qk = tl.load(d_p_qk + diagonal, mask=rows < C, other=0.0)[:, None]
    d_bn = tl.load(d_p_bn + diagonal + C, mask=rows + 1 < C, other=0.0)[:, None]
    d_bk = tl.load(d_p_bk + diagonal + C, mask=rows + 1 < C, other=0.0)[:, None]
    tl.store(dn + at, dN + d_qn * Q + d_bn * B + d_HN, mask=mask)
    tl.store(dk + at, dK + d_qk * Q + d_bk * B + d_HK, mask=mask)


class _Factors:
    """A block's chunk tensors ``[n, H, C, *]`` (fp32; N = −a) and what the scan reads, made once in forward and
    again in backward, named as KDA's ``_Factors`` where the scan reads them: D, ``D_C − D``, the four products,
    ``QD = Q ⊙ e^D``, ``BD = B ⊙ e^{D⁻}``, ``hands = N ⊙ e^{D_C − D}``, ``hands_k = K ⊙ e^{D_C − D}``,
    ``Y = −P^{bk} V``, A', W, U (= A' Y), ``e^{D_C}`` and the terms in V, ``base = P^{qk} V`` and
    ``kv = hands_kᵀ V``."""

    def __init__(self, q, k, v, a, b, g, chunks, precision):
        self.Q, self.K, self.V, A, self.B, G = (_chunk_rows(x, chunks) for x in (q, k, v, a, b, g))
        self.N = -A  # a new tensor: _chunk_rows may hand back a view of the input
        self.D, self.after = _log_decays(G)
        n, heads, size, dk = self.K.shape
        dv = self.V.shape[-1]
        self.P_qn, self.P_qk, self.P_bn, self.P_bk = (self.K.new_empty(n, heads, size, size) for _ in range(4))
        self.QD, self.BD, self.hands, self.hands_k = (torch.empty_like(self.K) for _ in range(4))
        for shift, x, p_xn, p_xk, xd in ((0, self.Q, self.P_qn, self.P_qk, self.QD),
                                         (1, self.B, self.P_bn, self.P_bk, self.BD)):
            _products_kernel[(n * heads, triton.cdiv(size, SUB))](
                x, self.N, self.K, self.D, self.after, p_xn, p_xk, xd, self.hands, self.hands_k, SHIFT=shift,
                **_products_geometry(size, dk, precision))
        # the chunk's first b reads the entering state alone, undecayed: no products, B ⊙ e^{D⁻} is itself
        self.P_bn[:, :, 0], self.P_bk[:, :, 0], self.BD[:, :, 0] = 0.0, 0.0, self.B[:, :, 0]
        self.Y = -(self.P_bk @ self.V)
        self.ones = self.K.new_ones(n, heads, size)  # KDA's β
        self.A, self.W, self.U = self.K.new_empty(n, heads, size, size), torch.empty_like(self.K), torch.empty_like(
            self.V)
        _ut_forward_kernel[(n * heads,)](self.P_bn, self.ones, self.BD, self.Y, self.A, self.W, self.U,
                                         **_ut_geometry(size, dk, dv, precision, UT_CONFIG))
        self.decay = self.D[:, :, -1].exp().contiguous()  # [n, H, Dk]
        self.adds = (self.P_qk @ self.V, self.hands_k.mT @ self.V)


class _Block(torch.autograd.Function):
    """One block of chunks, as KDA's ``_Block`` with a, b ``[n·C, H, Dk]`` in place of β. Backward: KDA's way
    through the scan and the UT transform's gradient, the terms in V's by batched products, then the products'."""

    @staticmethod
    def forward(ctx, q, k, v, a, b, g, starting, first_chunk, chunks, precision):
        f = _Factors(q, k, v, a, b, g, chunks, precision)
        out, final = _scan(f, f.P_qn, starting, first_chunk, precision, output=True, adds=f.adds)
        _keep_inputs(ctx, (q, k, v, a, b, g, starting, first_chunk), chunks, precision)
        return _token_rows(out, q.dtype), final

    @staticmethod
    def backward(ctx, d_rows, d_final):
        q, k, v, a, b, g, starting, first_chunk, chunks, precision = _kept_inputs(ctx)
        f = _Factors(q, k, v, a, b, g, chunks, precision)
        dO, dP_qn, dQD, d_starting, grad_after, dY_u, dW, d_hands, d_last = _through_scan(
            f, f.P_qn, starting, first_chunk, d_rows, d_final, chunks, precision, adds=f.adds)
        n, heads, size, dk = f.K.shape
        dP_bn, dBD, dY, d_ones = (torch.empty_like(x) for x in (f.P_bn, f.BD, f.Y, f.ones))
        _ut_backward_kernel[(n * heads,)](f.P_bn, f.ones, f.BD, f.Y, f.A, dW, dY_u, dP_bn, dBD, dY, d_ones,
                                          **_ut_backward_geometry(size, dk, f.V.shape[-1], precision, UT_CONFIG))
        # the terms in V: base = P^{qk} V, kv = hands_kᵀ V (its gradient: G, the state's leaving the chunk), Y
        dP_qk, dP_bk = dO @ f.V.mT, -(dY @ f.V.mT)
        dV = f.P_qk.mT @ dO + f.hands_k @ grad_after - f.P_bk.mT @ dY
        d_hands_k = f.V @ grad_after.mT
        dQ, dB, dN, dK, dD, d_after, dD_q, dD_b = (torch.empty_like(f.K) for _ in range(8))
        grid, geometry = (n * heads, triton.cdiv(size, SUB)), _products_geometry(size, dk, precision)
        for shift, x, dP_xn, dP_xk, dXD, dX, dD_x in ((0, f.Q, dP_qn, dP_qk, dQD, dQ, dD_q),
                                                      (1, f.B, dP_bn, dP_bk, dBD, dB, dD_b)):
            _rows_backward_kernel[grid](x, f.N, f.K, f.D, dP_xn, dP_xk, dXD, dX, dD_x, SHIFT=shift,
                                        **dict(geometry, **ROWS_BACKWARD_CONFIG))
        _columns_backward_kernel[grid](f.Q, f.B, f.N, f.K, f.D, f.after, dP_qn, dP_qk, dP_bn, dP_bk, d_hands,
                                       d_hands_k, dD_q, dD_b, dN, dK, dD, d_after, **geometry)
        dG = _gate_grad(dD, d_after, d_last)
        grads = (_token_rows(x, t.dtype) for x, t in zip((dQ, dK, dV, -dN, dB, dG), (q, k, v, a, b, g)))
        return *grads, d_starting, None, None, None


def dplr_triton(q, k, v, a, b, g, **options):
    """``dplr_delta_rule(..., impl="triton")``: same arguments (checked there, g filled in) and results."""
    return run_in_blocks(_Block, "dplr_delta_rule", q, k, v, a, b, g, **options)
