"""Triton kernels for chunked linear attention (docs/MIXERS.md#chunked): one fused pass forward, three backward.

Each program owns one (sequence, head, block of channels) and walks the chunks of its sequence in order,
carrying the fp32 state ``S = Σ kᵀv`` (and ``z = Σ k``, ``u = Σ v``, ``n`` = tokens seen) in registers: per
chunk a C×C masked product for the tokens inside it and a product with the state for those before it. Nothing
of size T/C × d × dv is ever stored (segments, below, store a state each: about two per resident program), so
memory stays O(T·d). Packed documents (``cu_seqlens``) are sequences
of their own: every program starts its chunks at its document's first token.

Backward. Divisive ``o = s·num`` with ``s = 1/den``; subtractive ``o = s·num + (1 − s·a) s·u`` with ``s = 1/n``,
``a = q·z``. The unnormalized output's gradient is ``s·dO`` and that of ``a`` is ``s·c`` (``c = −dO·o``, or
``−dO·u·s``): ``a`` is a linear attention whose value is always 1, so ``c`` joins the score gradient dO·vᵀ.
- dq: a forward sweep, ``dq = s ⊙ [tril(dO vᵀ + c) k + dO Sᵀ + c zᵀ]``;
- dk, dv: reverse sweeps over ``dS = Σ_later (s q)ᵀ dO`` and ``dz = Σ_later s c q``:
  ``dk = tril(s ⊙ (dO vᵀ + c))ᵀ q + v dSᵀ + dz``, ``dv = tril(s ⊙ q kᵀ)ᵀ dO + k dS``.
The forward and dv split the value channels into blocks (each needs every key channel for q kᵀ); dq and dk
split the key channels (each needs every value channel for dO vᵀ): every program writes whole outputs.
Subtractive's ``u`` terms ride in the sweeps too: the dq sweep takes ``c = −s·dO·u_t`` with ``u_t``'s in-chunk
part from the row sums of ``tril(dO vᵀ)``, and the dv sweep adds v's own share ``Σ_later w·dO``
(``w = (1 − s·a)·s``) as a running sum. Around the kernels only per-token scalars (``s``, ``w``) are computed.

Non-causal attention runs the same kernels twice: once to sum the whole sequence into a state, once to apply
that state to every token (``INTRA=False``: no in-chunk term, no running sums).

Segments. With few sequences × heads those chains leave SMs idle, so a long sequence is cut into segments of whole
chunks from its first token (``_Launch`` chooses by ``segment_chunks``): the same kernels first sum each segment's
own state (S has no decay, so states add), a running sum over the segments (``_combine``) gives each segment the state
it starts from (forward: the segments before it; dk/dv: the ones after it), and the main pass runs one program per
(sequence, head, segment, channel block). A segment never holds two documents, so no state crosses into the next.

The same kernels run on CPU under ``TRITON_INTERPRET=1``; the tests hold them to the naive reference there.
"""
import math
import os

import torch
import triton
import triton.language as tl

from ..documents import OffsetsMemo, document_sums
from .state import FIELDS, LinearAttentionState, zero_state

NORMALIZE_CODES = {"none": 0, "divisive": 1, "subtractive": 2}


@triton.jit
def _sequence_bounds(cu_seqlens, i_n, T, VARLEN: tl.constexpr):
    if VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    return bos, eos


@triton.jit
def _program(cu_seqlens, T, H: tl.constexpr, VARLEN: tl.constexpr, SEGMENTS=1):
    """This program's channel block, its row (sequence × head × segment: the index of its state in a
    ``[N, H, SEGMENTS, ...]`` buffer), its ``origin`` (the row of its sequence's first token and its head in the
    ``[tokens, H]`` layout, ``bos·H + head``: times a width, where its tiles start) and its sequence's length.
    Rows run on grid axis 0, which CUDA lets reach 2³¹ − 1; axis 1 (the channel blocks) stops at 65535."""
    i_row, i_b = tl.program_id(0), tl.program_id(1)
    i_nh = i_row // SEGMENTS
    bos, eos = _sequence_bounds(cu_seqlens, i_nh // H, T, VARLEN)
    return i_b, i_row, bos * H + i_nh % H, (eos - bos).to(tl.int32)


@triton.jit
def _segment(i_row, length, SEGMENTS, SEGMENT_LEN):
    """The tokens [first, stop) of this program's segment: the ``i_row % SEGMENTS``-th run of SEGMENT_LEN tokens
    (a whole number of chunks) from its document's first token, so no segment holds two documents."""
    first = (i_row % SEGMENTS) * SEGMENT_LEN
    return first, tl.minimum(first + SEGMENT_LEN, length)


@triton.jit
def _mm(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b in fp32 (acc may be None). The CPU interpreter multiplies bf16/fp16 wrongly, so there it
    upcasts the (already rounded) operands: the same products, exact in fp32."""
    if PRECISION == "interpret":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _tile(base, length, WIDTH: tl.constexpr, row, col, H: tl.constexpr, BT: tl.constexpr, BW: tl.constexpr):
    """Pointers and mask of rows [row, row + BT) × columns [col, col + BW) of one head of one sequence: a
    [length, WIDTH] slice, rows H·WIDTH apart, of a [tokens, H, WIDTH] tensor whose first row starts at ``base``."""
    r = row + tl.arange(0, BT)  # 32-bit offsets within a sequence (64-bit ones spill): _Launch checks they fit
    c = col + tl.arange(0, BW)
    return base + r[:, None] * (H * WIDTH) + c[None, :], (r < length)[:, None] & (c < WIDTH)[None, :]


@triton.jit
def _load(base, length, WIDTH: tl.constexpr, row, col, H: tl.constexpr, BT: tl.constexpr, BW: tl.constexpr):
    ptrs, mask = _tile(base, length, WIDTH, row, col, H, BT, BW)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _store(base, value, length, WIDTH: tl.constexpr, row, col, H: tl.constexpr, BT: tl.constexpr, BW: tl.constexpr):
    ptrs, mask = _tile(base, length, WIDTH, row, col, H, BT, BW)
    tl.store(ptrs, value.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _forward_kernel(
    q, k, v, o, aux, s_in, z_in, u_in, n_in, s_out, z_out, u_out, n_out, cu_seqlens,
    T, SEGMENTS, SEGMENT_LEN, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, eps,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NORMALIZE: tl.constexpr, INTRA: tl.constexpr, UPDATE: tl.constexpr, STORE_O: tl.constexpr,
    HAS_INITIAL: tl.constexpr, STORE_FINAL: tl.constexpr, VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):
    """o = [tril(q kᵀ) v + q S] normalized over one segment, from the state its row is given; also writes ``aux``
    (den or a, per token) and the state after the segment."""
    i_v, i_row, origin, length = _program(cu_seqlens, T, H, VARLEN, SEGMENTS)
    first, stop = _segment(i_row, length, SEGMENTS, SEGMENT_LEN)
    row = i_row.to(tl.int64)
    q, k = q + origin * DK, k + origin * DK
    v, o = v + origin * DV, o + origin * DV
    aux += origin
    rows = tl.arange(0, BT)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    mk, mv = ck < DK, cv < DV
    dtype = q.dtype.element_ty

    state_offs = row * DK * DV + ck[:, None] * DV + cv[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    z = tl.zeros([BK], dtype=tl.float32)
    u = tl.zeros([BV], dtype=tl.float32)
    n = 0.0
    if HAS_INITIAL:
        S += tl.load(s_in + state_offs, mask=mk[:, None] & mv[None, :], other=0.0)
        if NORMALIZE > 0:
            z += tl.load(z_in + row * DK + ck, mask=mk, other=0.0)
        if NORMALIZE == 2:
            u += tl.load(u_in + row * DV + cv, mask=mv, other=0.0)
            n += tl.load(n_in + row)

    for start in range(first, stop, BT):
        mt = start + rows < length
        q_c = _load(q, length, DK, start, 0, H, BT, BK)
        if INTRA or UPDATE:
            k_c = _load(k, length, DK, start, 0, H, BT, BK)
            v_c = _load(v, length, DV, start, i_v * BV, H, BT, BV)
        if STORE_O:
            num = _mm(q_c, S.to(dtype), None, PRECISION)
            if NORMALIZE > 0:
                a = tl.sum(q_c.to(tl.float32) * z[None, :], 1)
            if NORMALIZE == 2:
                count = n + tl.zeros([BT], dtype=tl.float32)
                u_c = u[None, :] + tl.zeros([BT, BV], dtype=tl.float32)
            if INTRA:
                A = tl.where(rows[:, None] >= rows[None, :], _mm(q_c, tl.trans(k_c), None, PRECISION), 0.0)
                num = _mm(A.to(dtype), v_c, num, PRECISION)
                if NORMALIZE > 0:
                    a += tl.sum(A, 1)
                if NORMALIZE == 2:
                    count += (rows + 1).to(tl.float32)
                    u_c += tl.cumsum(v_c.to(tl.float32), 0)
            if NORMALIZE == 0:
                out = num
            elif NORMALIZE == 1:
                den = a + eps
                out = num / den[:, None]
                tl.store(aux + (start + rows) * H, den, mask=mt & (tl.zeros([BT], tl.int32) + i_v == 0))
            else:
                out = (num + (1.0 - a / count)[:, None] * u_c) / count[:, None]
                tl.store(aux + (start + rows) * H, a, mask=mt & (tl.zeros([BT], tl.int32) + i_v == 0))
            _store(o, out, length, DV, start, i_v * BV, H, BT, BV)
        if UPDATE:
            S = _mm(tl.trans(k_c), v_c, S, PRECISION)
            if NORMALIZE > 0:
                z += tl.sum(k_c.to(tl.float32), 0)
            if NORMALIZE == 2:
                u += tl.sum(v_c.to(tl.float32), 0)
                n += tl.sum(mt.to(tl.float32), 0)

    if STORE_FINAL:
        tl.store(s_out + state_offs, S, mask=mk[:, None] & mv[None, :])
        if i_v == 0:
            tl.store(z_out + row * DK + ck, z, mask=mk)
            tl.store(n_out + row, n)
        tl.store(u_out + row * DV + cv, u, mask=mv)


@triton.jit
def _backward_dq_kernel(
    k, v, g, o, scale, center, dq, s_in, z_in, u_in, cu_seqlens,
    T, SEGMENTS, SEGMENT_LEN, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    INTRA: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_CENTER: tl.constexpr, NORMALIZE: tl.constexpr,
    HAS_INITIAL: tl.constexpr, VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):
    """Forward sweep for a block of key channels (all value channels), S, z (and u) running over earlier chunks:
    dq = s ⊙ [tril(g vᵀ + c) k + g Sᵀ + c zᵀ]. c is computed here, and written for the dk sweep: −g·o when
    NORMALIZE is divisive (1), −s·g·u_t when subtractive (2)."""
    i_k, i_row, origin, length = _program(cu_seqlens, T, H, VARLEN, SEGMENTS)
    first, stop = _segment(i_row, length, SEGMENTS, SEGMENT_LEN)
    row = i_row.to(tl.int64)
    k, dq = k + origin * DK, dq + origin * DK
    v, g, o = v + origin * DV, g + origin * DV, o + origin * DV
    scale, center = scale + origin, center + origin
    rows = tl.arange(0, BT)
    ck = i_k * BK + tl.arange(0, BK)
    cv = tl.arange(0, BV)
    mk, mv = ck < DK, cv < DV
    dtype = k.dtype.element_ty

    S = tl.zeros([BK, BV], dtype=tl.float32)
    z = tl.zeros([BK], dtype=tl.float32)
    u = tl.zeros([BV], dtype=tl.float32)
    if HAS_INITIAL:
        S += tl.load(s_in + row * DK * DV + ck[:, None] * DV + cv[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
        if HAS_CENTER:
            z += tl.load(z_in + row * DK + ck, mask=mk, other=0.0)
        if NORMALIZE == 2:
            u += tl.load(u_in + row * DV + cv, mask=mv, other=0.0)

    for start in range(first, stop, BT):
        mt = start + rows < length
        g_c = _load(g, length, DV, start, 0, H, BT, BV)
        dq_c = _mm(g_c, tl.trans(S.to(dtype)), None, PRECISION)
        if NORMALIZE == 1:
            c_c = -tl.sum(g_c.to(tl.float32) * _load(o, length, DV, start, 0, H, BT, BV).to(tl.float32), 1)
        elif NORMALIZE == 2:  # c = −s·g·u_t, u_t = u + Σ_{j ≤ t in the chunk} v_j
            g_u = tl.sum(g_c.to(tl.float32) * u[None, :], 1)
            if INTRA:  # the in-chunk part: the row sums of tril(g vᵀ), the score-gradient tile needed below
                v_c = _load(v, length, DV, start, 0, H, BT, BV)
                dA = _mm(g_c, tl.trans(v_c), None, PRECISION)
                g_u += tl.sum(tl.where(rows[:, None] >= rows[None, :], dA, 0.0), 1)
            c_c = -g_u * tl.load(scale + (start + rows) * H, mask=mt, other=0.0)
        if NORMALIZE > 0:
            tl.store(center + (start + rows) * H, c_c, mask=mt & (tl.zeros([BT], tl.int32) + i_k == 0))
        if HAS_CENTER:
            dq_c += c_c[:, None] * z[None, :]
        if INTRA:
            k_c = _load(k, length, DK, start, i_k * BK, H, BT, BK)
            if NORMALIZE != 2:  # (loaded after c: the compiler schedules the other forms better so)
                v_c = _load(v, length, DV, start, 0, H, BT, BV)
                dA = _mm(g_c, tl.trans(v_c), None, PRECISION)
            if HAS_CENTER:
                dA += c_c[:, None]
            dA = tl.where(rows[:, None] >= rows[None, :], dA, 0.0)
            dq_c = _mm(dA.to(dtype), k_c, dq_c, PRECISION)
        if HAS_SCALE:
            dq_c *= tl.load(scale + (start + rows) * H, mask=mt, other=0.0)[:, None]
        _store(dq, dq_c, length, DK, start, i_k * BK, H, BT, BK)
        if INTRA:
            S = _mm(tl.trans(k_c), v_c, S, PRECISION)
            if HAS_CENTER:
                z += tl.sum(k_c.to(tl.float32), 0)
            if NORMALIZE == 2:
                u += tl.sum(v_c.to(tl.float32), 0)


@triton.jit
def _backward_dk_dv_kernel(
    q, k, v, g, scale, center, weight, dk, dv, ds_in, dz_in, du_in, ds_out, dz_out, du_out, cu_seqlens,
    T, SEGMENTS, SEGMENT_LEN, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FOR_DK: tl.constexpr,
    INTRA: tl.constexpr, UPDATE: tl.constexpr, STORE: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_CENTER: tl.constexpr, HAS_FINAL_GRAD: tl.constexpr, STORE_DS: tl.constexpr,
    HAS_DU: tl.constexpr, STORE_DU: tl.constexpr, VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):
    """Reverse sweep over one segment: dS = Σ_later (s q)ᵀ g and dz = Σ_later s c q, from the gradient its row is
    given (HAS_FINAL_GRAD; else zero).

    FOR_DK: a block of key channels, all value channels: dk = tril(s ⊙ (g vᵀ + c))ᵀ q + v dSᵀ + dz.
    Otherwise a block of value channels, all key channels: dv = tril(s ⊙ q kᵀ)ᵀ g + k dS (+ du).
    STORE_DS writes dS (and dz) as they stand before the segment's first token (the initial state's gradient,
    unsegmented). HAS_DU (subtractive) also runs du = Σ_later w g, the gradient of u_t = Σ_{j ≤ t} v_j, which dv
    adds (from ``du_in`` with HAS_FINAL_GRAD); STORE_DU writes it as it stands before the segment."""
    i_b, i_row, origin, length = _program(cu_seqlens, T, H, VARLEN, SEGMENTS)
    first, stop = _segment(i_row, length, SEGMENTS, SEGMENT_LEN)
    row = i_row.to(tl.int64)
    q, k, dk = q + origin * DK, k + origin * DK, dk + origin * DK
    v, g, dv = v + origin * DV, g + origin * DV, dv + origin * DV
    scale, center, weight = scale + origin, center + origin, weight + origin
    k0 = i_b * BK if FOR_DK else 0
    v0 = 0 if FOR_DK else i_b * BV
    rows = tl.arange(0, BT)
    ck = k0 + tl.arange(0, BK)
    cv = v0 + tl.arange(0, BV)
    mk, mv = ck < DK, cv < DV
    dtype = q.dtype.element_ty

    state_offs = row * DK * DV + ck[:, None] * DV + cv[None, :]
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    dz = tl.zeros([BK], dtype=tl.float32)
    du = tl.zeros([BV], dtype=tl.float32)
    if HAS_FINAL_GRAD:
        dS += tl.load(ds_in + state_offs, mask=mk[:, None] & mv[None, :], other=0.0)
        if HAS_CENTER:
            dz += tl.load(dz_in + row * DK + ck, mask=mk, other=0.0)
        if HAS_DU:
            du += tl.load(du_in + row * DV + cv, mask=mv, other=0.0)

    num_chunks = tl.cdiv(stop - first, BT)
    for i in range(num_chunks):
        start = first + (num_chunks - 1 - i) * BT
        mt = start + rows < length
        q_c = _load(q, length, DK, start, k0, H, BT, BK)
        g_c = _load(g, length, DV, start, v0, H, BT, BV)
        if HAS_SCALE:
            s_c = tl.load(scale + (start + rows) * H, mask=mt, other=0.0)
        if HAS_CENTER:
            c_c = tl.load(center + (start + rows) * H, mask=mt, other=0.0)
        if HAS_DU:
            wg_c = g_c.to(tl.float32) * tl.load(weight + (start + rows) * H, mask=mt, other=0.0)[:, None]
        if STORE:
            if FOR_DK:
                v_c = _load(v, length, DV, start, 0, H, BT, BV)
                dk_c = _mm(v_c, tl.trans(dS.to(dtype)), None, PRECISION)
                if HAS_CENTER:
                    dk_c += dz[None, :]
                if INTRA:
                    dA = _mm(g_c, tl.trans(v_c), None, PRECISION)
                    if HAS_CENTER:
                        dA += c_c[:, None]
                    if HAS_SCALE:
                        dA *= s_c[:, None]
                    dA = tl.where(rows[:, None] >= rows[None, :], dA, 0.0)
                    dk_c = _mm(tl.trans(dA.to(dtype)), q_c, dk_c, PRECISION)
                _store(dk, dk_c, length, DK, start, k0, H, BT, BK)
            else:
                k_c = _load(k, length, DK, start, 0, H, BT, BK)
                dv_c = _mm(k_c, dS.to(dtype), None, PRECISION)
                if INTRA:
                    A = _mm(q_c, tl.trans(k_c), None, PRECISION)
                    if HAS_SCALE:
                        A *= s_c[:, None]
                    A = tl.where(rows[:, None] >= rows[None, :], A, 0.0)
                    dv_c = _mm(tl.trans(A.to(dtype)), g_c, dv_c, PRECISION)
                if HAS_DU:
                    dv_c += du[None, :]
                    if INTRA:  # the tokens at or after j in this chunk
                        dv_c += tl.cumsum(wg_c, 0, reverse=True)
                _store(dv, dv_c, length, DV, start, v0, H, BT, BV)
        if UPDATE:
            if HAS_SCALE:
                sq_c = q_c.to(tl.float32) * s_c[:, None]
                dS = _mm(tl.trans(sq_c.to(dtype)), g_c, dS, PRECISION)
                if HAS_CENTER:
                    dz += tl.sum(sq_c * c_c[:, None], 0)
            else:
                dS = _mm(tl.trans(q_c), g_c, dS, PRECISION)
            if HAS_DU:
                du += tl.sum(wg_c, 0)

    if STORE_DU:
        tl.store(du_out + row * DV + cv, du, mask=mv)
    if STORE_DS:
        tl.store(ds_out + state_offs, dS, mask=mk[:, None] & mv[None, :])
        if HAS_CENTER:
            tl.store(dz_out + row * DK + ck, dz, mask=mk)


@triton.jit
def _combine_kernel(parts, edge, starts, totals, SEGMENTS, WIDTH, HAS_EDGE: tl.constexpr, ORDER: tl.constexpr,
                    BLOCK: tl.constexpr):
    """For one (sequence, head) and a block of one state field's elements: the state each segment starts from and
    the total, a running fp32 sum over the sequence's segments from ``edge`` (the state at the sequence's edge).
    ORDER 0: a segment starts from the ones before it; 1 (the gradient sweeps): after it; 2 (global): all."""
    i_nh, i_w = tl.program_id(0), tl.program_id(1)
    cols = i_w * BLOCK + tl.arange(0, BLOCK)
    mask = cols < WIDTH
    rows = i_nh.to(tl.int64) * SEGMENTS * WIDTH + cols
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_EDGE:
        acc += tl.load(edge + i_nh.to(tl.int64) * WIDTH + cols, mask=mask, other=0.0)
    for i in range(SEGMENTS):
        at = rows + (SEGMENTS - 1 - i if ORDER == 1 else i) * WIDTH
        if ORDER != 2:
            tl.store(starts + at, acc, mask=mask)
        acc += tl.load(parts + at, mask=mask, other=0.0)
    tl.store(totals + i_nh.to(tl.int64) * WIDTH + cols, acc, mask=mask)
    if ORDER == 2:
        for i in range(SEGMENTS):
            tl.store(starts + rows + i * WIDTH, acc, mask=mask)


# ---------------------------------------------------------------------------------------------------------
# Host side: shapes, launches, and the autograd function that ties the sweeps together.

MAX_HEAD_DIM = 256  # the state block (head dim × value block, fp32) lives in registers
# Launch settings, fixed. Timed on an H200 (benchmarks/gpu_h200_round4.md, B, H, D, T = 8, 32, 128, 8192 in bf16,
# chunk 64): 4 warps over channel blocks of 64 ran fwd+bwd in 2.94 ms, 8 warps (the resource report's pick, which
# spills least) in 6.00 ms; every other setting of the sweep at this chunk was slower.
CONFIG = dict(block=64, num_warps=4, num_stages=2)

# Segments (flash-linear-attention's split of chunk_fwd_h). One program per (sequence, head, channel block) walks
# its sequence's chunks in order; with few sequences × heads most of the GPU idles while those chains run. Then each
# sequence is cut into segments: a first pass sums each segment's own state (Σ kᵀv: no decay, so states add), a
# running sum over the segments gives each segment the state it starts from, and the main pass runs one program per
# segment. The first pass reads k and v once more (≈ half the forward's bytes): worth it only with idle SMs.
SEGMENT_CHUNKS = None  # chunks per segment: None chooses by `segment_chunks`; 0 never segments; n > 0 forces n
WARPS_PER_SM = 8  # resident at once: at 255 registers a thread (the resource report) 8 warps fill 65,536
MIN_SEGMENT_CHUNKS = 8  # a segment's state (d × dv fp32, written, summed, read) against its tokens' bytes
DEFAULT_MULTIPROCESSORS = 132  # an H200's, where no CUDA device says (the interpreter)


def segment_chunks(longest, steps, programs, multiprocessors):
    """Chunks per segment, or None to keep one segment per sequence. ``longest``: the chunks of the longest
    sequence, the longest chain a program walks; ``steps``: chunk steps over all ``programs`` (one per sequence,
    head and channel block). Split only when that chain is over twice each resident program's even share of the
    steps (the GPU would idle for over half the run; with equal lengths: fewer programs than SMs), into as many
    segments as keep the grid within two waves, the empty segments of short documents included (which also
    bounds the segments' states: one per program), each at least MIN_SEGMENT_CHUNKS long."""
    resident = max(1, WARPS_PER_SM // CONFIG["num_warps"]) * multiprocessors
    if longest <= 2 * steps / resident:
        return None
    size = max(MIN_SEGMENT_CHUNKS, math.ceil(longest / max(1, 2 * resident // programs)))
    return size if size < longest else None


def _multiprocessors(device):
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_MULTIPROCESSORS


_lengths = OffsetsMemo()  # (longest document, chunks in all) of the last offsets: every layer shares them


def _longest_and_chunks(cu_seqlens: torch.Tensor, size: int) -> tuple[int, int]:
    """The longest document's tokens and the documents' chunks of ``size`` in all, in one read on the host."""
    lengths = cu_seqlens.diff()
    each = (lengths + size - 1).div(size, rounding_mode="floor")
    return tuple(torch.stack([lengths.max(), each.sum()]).tolist())


class _Launch:
    """Geometry of one call: tokens laid out [B*T, H, D]; programs over (sequence × head × segment, channel block).

    The forward and dv split the value channels into blocks (each needs every key channel for q kᵀ); dq and
    dk split the key channels (each needs every value channel for dO vᵀ). So every program writes whole
    outputs: no partial sums. Segments run from each sequence's first token (``_segment``); a short sequence's
    last ones are empty (their programs only write zero states)."""

    def __init__(self, q, v, cu_seqlens, chunk_size):
        batch, self.T, self.H, self.DK = q.shape
        self.DV = v.shape[-1]
        if max(self.DK, self.DV) > MAX_HEAD_DIM:
            raise ValueError(f"triton linear attention supports head dims up to {MAX_HEAD_DIM}; "
                             f"got q/k {self.DK}, v {self.DV}")
        self.BT = max(16, chunk_size)  # the tiling only: results do not depend on it; tl.dot needs ≥ 16
        self.cu_seqlens = cu_seqlens
        self.N = batch if cu_seqlens is None else cu_seqlens.numel() - 1
        if cu_seqlens is None:
            longest, chunks = self.T, batch * triton.cdiv(self.T, self.BT)
        else:  # read on the host once per offsets (a sync on a GPU), not once per layer
            longest, chunks = _lengths.get(cu_seqlens, lambda: _longest_and_chunks(cu_seqlens, self.BT), self.BT)
        if longest * self.H * max(self.DK, self.DV) >= 2**31:
            raise ValueError(f"impl='triton' indexes within a sequence in 32 bits: a sequence of {longest} tokens "
                             f"× {self.H} heads × {max(self.DK, self.DV)} channels is too long; split it and "
                             "carry the state (initial_state / output_final_state)")
        self.tokens = batch * self.T
        self.BK_full = max(16, triton.next_power_of_2(self.DK))
        self.BV_full = max(16, triton.next_power_of_2(self.DV))
        self.BK_split = min(CONFIG["block"], self.BK_full)
        self.BV_split = min(CONFIG["block"], self.BV_full)
        self.NK = triton.cdiv(self.DK, self.BK_split)
        self.NV = triton.cdiv(self.DV, self.BV_split)
        longest_chunks = triton.cdiv(longest, self.BT)
        size = SEGMENT_CHUNKS
        if size is None:
            blocks = self.H * max(self.NK, self.NV)
            size = segment_chunks(longest_chunks, chunks * blocks, self.N * blocks, _multiprocessors(q.device))
        self.segments = triton.cdiv(longest_chunks, size) if size else 1
        self.segment_len = triton.cdiv(longest_chunks, self.segments) * self.BT  # evened out; whole chunks
        self.rows = self.N * self.H * self.segments
        if os.environ.get("TRITON_INTERPRET") == "1":
            self.precision = "interpret"
        else:
            self.precision = "ieee" if q.dtype == torch.float32 else "tf32"
        self.num_warps, self.num_stages = CONFIG["num_warps"], CONFIG["num_stages"]

    def common(self):
        return dict(T=self.T, H=self.H, DK=self.DK, DV=self.DV, BT=self.BT, VARLEN=self.cu_seqlens is not None,
                    PRECISION=self.precision, num_warps=self.num_warps, num_stages=self.num_stages)

    def segmented(self):
        """``common()`` and the segments, for the kernels here (the decayed ones keep one per sequence)."""
        return dict(SEGMENTS=self.segments, SEGMENT_LEN=self.segment_len, **self.common())

    def states(self, *segments, fields="Szun", device=None):
        """Empty fp32 states [N, H, *segments, ...], the fields named (S, z, u, n), None for the others."""
        shapes = dict(S=(self.DK, self.DV), z=(self.DK,), u=(self.DV,), n=())
        return tuple(torch.empty(self.N, self.H, *segments, *shapes[f], device=device) if f in fields else None
                     for f in "Szun")


COMBINE_ORDERS = {"forward": 0, "reverse": 1, "whole": 2}


def _combine(parts, base, order):
    """Each segment's starting state and the sequence's total, from every segment's own sum (``parts``, fields
    [N, H, segments, ...], None where unused) and the state at the sequence's edge (``base``, [N, H, ...]; None:
    zero). ``order``: "forward", a segment starts from the ones before it; "reverse" (the gradient sweeps), from
    the ones after it; "whole" (global attention), from all of them. Segments are per document, so these sums
    never cross from one document into the next. One small launch per field."""
    starts, totals = [], []
    for i, part in enumerate(parts):
        if part is None:
            starts.append(None)
            totals.append(None)
            continue
        num, heads, segments, *shape = part.shape
        width = math.prod(shape)
        edge = None if base is None else base[i]
        start, total = torch.empty_like(part), part.new_empty(num, heads, *shape)
        block = min(1024, max(16, triton.next_power_of_2(width)))
        _combine_kernel[(num * heads, triton.cdiv(width, block))](
            part, part if edge is None else edge, start, total, segments, width, HAS_EDGE=edge is not None,
            ORDER=COMBINE_ORDERS[order], BLOCK=block)
        starts.append(start)
        totals.append(total)
    return tuple(starts), tuple(totals)


def _forward(q, k, v, g: _Launch, normalize, eps, causal, initial):
    """Returns o, the per-token aux (den or a), the final state (S, z, u, n) and the state (S, z, u) each segment
    starts from, as the dq sweep reads it (None: zero)."""
    dev = q.device
    o = torch.empty_like(v)
    aux = torch.empty(g.tokens, g.H, dtype=torch.float32, device=dev)

    def launch(*, intra, update, store_o, states_in, states_out):
        _forward_kernel[(g.rows, g.NV)](
            q, k, v, o, aux, *(states_in or (aux,) * 4), *(states_out or (aux,) * 4), g.cu_seqlens, eps=eps,
            NORMALIZE=NORMALIZE_CODES[normalize], INTRA=intra, UPDATE=update, STORE_O=store_o,
            HAS_INITIAL=states_in is not None, STORE_FINAL=states_out is not None, BK=g.BK_full, BV=g.BV_split,
            **g.segmented())

    if causal and g.segments == 1:  # one pass, the state carried through the whole sequence
        final = g.states(device=dev)
        launch(intra=True, update=True, store_o=True, states_in=initial, states_out=final)
        return o, aux, final, None if initial is None else initial[:3]
    # each segment's own sum first; global attention applies the whole sequence's to every token
    parts = g.states(g.segments, device=dev)
    launch(intra=False, update=True, store_o=False, states_in=None, states_out=parts)
    starts, final = _combine(parts, initial, "forward" if causal else "whole")
    launch(intra=causal, update=causal, store_o=True, states_in=starts, states_out=None)
    return o, aux, final, starts[:3]


def _backward(do, q, k, v, o, aux, n_0, starts, d_final, g: _Launch, normalize, causal, want_d_initial):
    """Gradients of q, k, v and of the initial state (S, z, u), given dO and the final state's gradient (None
    where no loss reached them)."""
    dev = q.device
    do = torch.zeros_like(o) if do is None else do.contiguous()
    # With a per-token scale s (1/den, 1/n), the unnormalized output's gradient is s·dO and that of a = q·z
    # is δ = s·c. The kernels take dO itself and apply s to fp32 tiles (or to q), never to dO in bf16: in
    # dO·v_j + c = dO·(v_j − o) the two terms nearly cancel, and rounding s·dO would not cancel with them.
    dummy = torch.empty(1, dtype=torch.float32, device=dev)
    scale = center = weight = None
    if normalize == "divisive":
        scale = 1.0 / aux
        center = torch.empty_like(aux)  # −dO·o, written by the dq sweep
    elif normalize == "subtractive":
        n_t, _ = document_sums(q.new_ones(q.shape[:3], dtype=torch.float32), g.cu_seqlens, causal=causal,
                               initial=n_0)
        scale = (1.0 / n_t).reshape(aux.shape)
        weight = (1.0 - aux * scale) * scale  # ∂o_t/∂u_t: v's own share of the gradient is Σ_later w·dO
        center = torch.empty_like(aux)  # −s·dO·u_t, written by the dq sweep
    flags = dict(HAS_SCALE=scale is not None, HAS_CENTER=center is not None, **g.segmented())
    has_du = normalize == "subtractive"
    scale, center, weight = (dummy if x is None else x.contiguous() for x in (scale, center, weight))
    split_k = dict(BK=g.BK_split, BV=g.BV_full)  # dq, dk: a block of key channels, every value channel
    split_v = dict(BK=g.BK_full, BV=g.BV_split)  # dv: a block of value channels, every key channel

    # dq: forward sweep over the state S, from each segment's start (the whole sequence's, when not causal)
    dq = torch.empty_like(q)
    _backward_dq_kernel[(g.rows, g.NK)](
        k, v, do, o, scale, center, dq, *(starts if starts is not None else (dummy,) * 3), g.cu_seqlens,
        INTRA=causal, NORMALIZE=NORMALIZE_CODES[normalize], HAS_INITIAL=starts is not None, **split_k, **flags)

    # dk, dv: reverse sweeps over dS = Σ_later (s q)ᵀ dO (for non-causal, first summed over the whole sequence)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    fields = "S" + "z" * (normalize != "none") + "u" * has_du
    d_edge = None  # the gradients at the sequence's end
    if any(t is not None for t in d_final):
        d_edge = tuple(None if e is None else e.zero_() if t is None else t.float().contiguous()
                       for e, t in zip(g.states(fields=fields, device=dev), d_final))

    def sweep(*, for_dk, intra, update, store, d_in, d_out=None):
        carries_du = has_du and (not for_dk or not store)  # dv adds du; the sums pass writes it
        _backward_dk_dv_kernel[(g.rows, g.NK if for_dk else g.NV)](
            q, k, v, do, scale, center, weight, dk, dv, *(dummy if t is None else t for t in d_in or (None,) * 3),
            *(dummy if t is None else t for t in d_out or (None,) * 3), g.cu_seqlens, FOR_DK=for_dk, INTRA=intra,
            UPDATE=update, STORE=store, HAS_FINAL_GRAD=d_in is not None, STORE_DS=for_dk and d_out is not None,
            HAS_DU=carries_du, STORE_DU=carries_du and d_out is not None, **(split_k if for_dk else split_v),
            **flags)

    if causal and g.segments == 1:
        d_initial = g.states(fields=fields, device=dev)[:3] if want_d_initial else None
        sweep(for_dk=True, intra=True, update=True, store=True, d_in=d_edge, d_out=d_initial)
        sweep(for_dk=False, intra=True, update=True, store=True, d_in=d_edge, d_out=d_initial)
    else:  # each segment's own sum first (the dk programs see every value channel, so du too), then the sweeps
        parts = g.states(g.segments, fields=fields, device=dev)[:3]
        sweep(for_dk=True, intra=False, update=True, store=False, d_in=None, d_out=parts)
        d_starts, d_initial = _combine(parts, d_edge, "reverse" if causal else "whole")
        sweep(for_dk=True, intra=causal, update=causal, store=True, d_in=d_starts)
        sweep(for_dk=False, intra=causal, update=causal, store=True, d_in=d_starts)
    return (dq, dk, dv), d_initial if want_d_initial else (None, None, None)


class _LinearAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, S_0, z_0, u_0, n_0, cu_seqlens, normalize, eps, causal, chunk_size):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        g = _Launch(q, v, cu_seqlens, chunk_size)
        initial = None
        if S_0 is not None:
            initial = tuple(t.float().contiguous() for t in (S_0, z_0, u_0, n_0))
        o, aux, final, starts = _forward(q, k, v, g, normalize, eps, causal, initial)
        ctx.save_for_backward(q, k, v, o, aux, *(initial[3:] if initial else ()), *(starts or ()))
        ctx.launch, ctx.normalize, ctx.causal = g, normalize, causal
        ctx.has_initial, ctx.has_starts = initial is not None, starts is not None
        ctx.mark_non_differentiable(final[3])
        ctx.set_materialize_grads(False)  # outputs no loss reached come as None: backward skips their zeros
        return o, *final

    @staticmethod
    def backward(ctx, do, dS_T, dz_T, du_T, _dn_T):
        q, k, v, o, aux, *rest = ctx.saved_tensors
        n_0 = rest.pop(0) if ctx.has_initial else None
        starts = tuple(rest) if ctx.has_starts else None
        want_d_initial = ctx.has_initial and any(ctx.needs_input_grad[3:6])
        (dq, dk, dv), (dS_0, dz_0, du_0) = _backward(
            do, q, k, v, o, aux, n_0, starts, (dS_T, dz_T, du_T), ctx.launch, ctx.normalize, ctx.causal,
            want_d_initial)
        return dq, dk, dv, dS_0, dz_0, du_0, None, None, None, None, None, None


def kernel_offsets(q, cu_seqlens):
    """Refuse inputs the kernels cannot take (a device, a dtype); ``cu_seqlens`` as they read it (int32, q's device)."""
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU); got {q.device}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"impl='triton' takes fp32, bf16 or fp16; got {q.dtype} (use impl='chunk')")
    return None if cu_seqlens is None else cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()


def linear_attention_triton(q, k, v, *, causal=True, normalize="divisive", eps=1e-6, cu_seqlens=None,
                            initial_state=None, output_final_state=False, chunk_size=64):
    """``linear_attention(..., impl="triton")``: same arguments (already checked there) and results."""
    cu_seqlens = kernel_offsets(q, cu_seqlens)
    num = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    zeros = zero_state(num, q.shape[2], q.shape[3], v.shape[3], "subtractive", dtype=torch.float32, device=q.device)
    initial = (None,) * 4 if initial_state is None else tuple(
        zero if s is None else s for s, zero in zip(initial_state, zeros))
    o, *final = _LinearAttention.apply(q, k, v, *initial, cu_seqlens, normalize, eps, causal, chunk_size)
    if not output_final_state:
        return o
    kept = FIELDS[normalize]
    return o, LinearAttentionState(*(s if f in kept else None for f, s in zip(LinearAttentionState._fields, final)))
