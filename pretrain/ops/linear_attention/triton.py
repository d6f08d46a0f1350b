"""Triton kernels for chunked linear attention (docs/MIXERS.md#chunked): one fused pass forward, three backward.

Each program owns one (sequence, head, block of channels) and walks the chunks of its sequence in order,
carrying the fp32 state ``S = Σ kᵀv`` (and ``z = Σ k``, ``u = Σ v``, ``n`` = tokens seen) in registers: per
chunk a C×C masked product for the tokens inside it and a product with the state for those before it. Nothing
of size T/C × d × dv is ever stored (segments, below, store a state per segment and head: at most two per
resident program at D = 128), so memory stays O(T·d). Packed documents (``cu_seqlens``) are sequences of their
own: every program starts its chunks at its document's first token.

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

Segments. When one document's chain of chunks is much longer than the GPU's even share of the work (few sequences ×
heads, or a packed row whose longest document dominates), the long documents are cut into segments of whole chunks
from their first token (``segment_chunks``, ``segment_table``): a flat table of (document, segment) pairs, built on
the host from the lengths the launch reads anyway, gives each program its segment, and only the cut documents have
segments. The same kernels first sum each cut segment's own state (S has no decay, so states add), a running sum
over each document's segments (``_combine``) gives each segment the state it starts from (forward: the segments
before it; dk/dv: the ones after it), and the main pass runs one program per (table pair, head, channel block):
uncut documents start from the initial state and store the final one as unsegmented. A segment never holds two
documents, so no state crosses into the next.

The same kernels run on CPU under ``TRITON_INTERPRET=1``; the tests hold them to the naive reference there.
"""
import contextlib
import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..documents import OffsetsMemo, document_sums
from ..precision import dot_precision
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
def _program(cu_seqlens, T, H: tl.constexpr, VARLEN: tl.constexpr):
    """This program's channel block, its row (sequence × head: the index of its state in an ``[N, H, ...]``
    buffer), its ``origin`` (the row of its sequence's first token and its head in the ``[tokens, H]`` layout,
    ``bos·H + head``: times a width, where its tiles start) and its sequence's length. Rows run on grid axis 0,
    which CUDA lets reach 2³¹ − 1; axis 1 (the channel blocks) stops at 65535."""
    i_row, i_b = tl.program_id(0), tl.program_id(1)
    bos, eos = _sequence_bounds(cu_seqlens, i_row // H, T, VARLEN)
    return i_b, i_row, bos * H + i_row % H, (eos - bos).to(tl.int32)


@triton.jit
def _segment_program(cu_seqlens, table, T, H: tl.constexpr, VARLEN: tl.constexpr, SEGMENTED: tl.constexpr):
    """``_program``'s, for a segment: channel block; ``doc_row`` (document × head, its row in ``[N, H, ...]``
    buffers: the initial and final states); ``slot_row`` (slot × head, its row in ``[slots, H, ...]`` buffers: the
    segments' sums and starting states; negative when its segment has no slot); origin; its document's length; and
    its segment's tokens [first, stop) within the document. SEGMENTED: grid row i is head i % H of the table's
    pair i // H, a row (document, first token, stop token, slot) of ``segment_table``'s; otherwise the whole
    sequence, no slot."""
    if SEGMENTED:
        i_row, i_b = tl.program_id(0), tl.program_id(1)
        entry = table + (i_row // H) * 4
        doc, first, stop, slot = tl.load(entry), tl.load(entry + 1), tl.load(entry + 2), tl.load(entry + 3)
        bos, eos = _sequence_bounds(cu_seqlens, doc, T, VARLEN)
        head = i_row % H
        slot_row = tl.where(slot < 0, -1, slot.to(tl.int64) * H + head)
        return i_b, doc.to(tl.int64) * H + head, slot_row, bos * H + head, (eos - bos).to(tl.int32), first, stop
    else:
        i_b, i_row, origin, length = _program(cu_seqlens, T, H, VARLEN)
        return i_b, i_row.to(tl.int64), -1, origin, length, 0, length


@triton.jit
def _state_ptrs(by_doc, by_slot, doc_row, slot_row, WIDTH: tl.constexpr, offs, mask,
                BY_DOC: tl.constexpr, BY_SLOT: tl.constexpr):
    """Pointers to one field of a program's state, and their mask: its document's row of ``by_doc`` when its
    segment has no slot (used if BY_DOC), else its slot's row of ``by_slot`` (used if BY_SLOT). ``offs``: the
    field's element offsets (a tensor, or 0 for the count n)."""
    slotted = slot_row >= 0
    base = tl.where(slotted, by_slot + slot_row * WIDTH, by_doc + doc_row * WIDTH)
    used = tl.where(slotted, BY_SLOT, BY_DOC).to(tl.int32)
    return base + offs, mask & (offs * 0 + used != 0)  # the mask as a full tensor: the interpreter needs one


@triton.jit
def _load_state(by_doc, by_slot, doc_row, slot_row, WIDTH: tl.constexpr, offs, mask,
                BY_DOC: tl.constexpr, BY_SLOT: tl.constexpr):
    """One field of the state a program starts from (``_state_ptrs``), zero where none is given."""
    ptrs, keep = _state_ptrs(by_doc, by_slot, doc_row, slot_row, WIDTH, offs, mask, BY_DOC, BY_SLOT)
    return tl.load(ptrs, mask=keep, other=0.0)


@triton.jit
def _store_state(out, value, doc_row, slot_row, WIDTH: tl.constexpr, offs, mask, OUT: tl.constexpr):
    """Stores one field of a program's state: OUT 1, the programs without a slot at their document's row (final
    states, the initial state's gradient); 2, those with one at their slot (the segments' own sums)."""
    ptrs, keep = _state_ptrs(out, out, doc_row, slot_row, WIDTH, offs, mask, OUT == 1, OUT == 2)
    tl.store(ptrs, value, mask=keep)


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
    q, k, v, o, aux, s_0, z_0, u_0, n_0, s_in, z_in, u_in, n_in, s_out, z_out, u_out, n_out, cu_seqlens, table,
    T, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, eps,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NORMALIZE: tl.constexpr, INTRA: tl.constexpr, UPDATE: tl.constexpr, STORE_O: tl.constexpr,
    HAS_INITIAL: tl.constexpr, HAS_STARTS: tl.constexpr, OUT: tl.constexpr, SEGMENTED: tl.constexpr,
    VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):
    """o = [tril(q kᵀ) v + q S] normalized over one segment, from the state it is given (``_state_ptrs``: the
    initial state's ``*_0`` where the segment has no slot, HAS_INITIAL; else its slot's ``*_in``, HAS_STARTS);
    also writes ``aux`` (den or a, per token) and (OUT, ``_store_state``) the state after the segment."""
    i_v, doc_row, slot_row, origin, length, first, stop = _segment_program(cu_seqlens, table, T, H, VARLEN,
                                                                           SEGMENTED)
    q, k = q + origin * DK, k + origin * DK
    v, o = v + origin * DV, o + origin * DV
    aux += origin
    rows = tl.arange(0, BT)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    mk, mv = ck < DK, cv < DV
    dtype = q.dtype.element_ty

    state_rows = doc_row, slot_row  # where this program's states live (``_state_ptrs``)
    state_offs, state_mask = ck[:, None] * DV + cv[None, :], mk[:, None] & mv[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    z = tl.zeros([BK], dtype=tl.float32)
    u = tl.zeros([BV], dtype=tl.float32)
    n = 0.0
    if HAS_INITIAL or HAS_STARTS:
        S += _load_state(s_0, s_in, *state_rows, DK * DV, state_offs, state_mask, HAS_INITIAL, HAS_STARTS)
        if NORMALIZE > 0:
            z += _load_state(z_0, z_in, *state_rows, DK, ck, mk, HAS_INITIAL, HAS_STARTS)
        if NORMALIZE == 2:
            u += _load_state(u_0, u_in, *state_rows, DV, cv, mv, HAS_INITIAL, HAS_STARTS)
            n += _load_state(n_0, n_in, *state_rows, 1, 0, True, HAS_INITIAL, HAS_STARTS)

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

    if OUT > 0:
        _store_state(s_out, S, *state_rows, DK * DV, state_offs, state_mask, OUT)
        _store_state(z_out, z, *state_rows, DK, ck, mk & (ck * 0 + i_v == 0), OUT)  # z, n: by value block 0
        _store_state(n_out, n, *state_rows, 1, 0, i_v == 0, OUT)
        _store_state(u_out, u, *state_rows, DV, cv, mv, OUT)


@triton.jit
def _backward_dq_kernel(
    k, v, g, o, scale, center, dq, s_0, z_0, u_0, s_in, z_in, u_in, cu_seqlens, table,
    T, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    INTRA: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_CENTER: tl.constexpr, NORMALIZE: tl.constexpr,
    HAS_INITIAL: tl.constexpr, HAS_STARTS: tl.constexpr, SEGMENTED: tl.constexpr, VARLEN: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Forward sweep for a block of key channels (all value channels), S, z (and u) running over earlier chunks:
    dq = s ⊙ [tril(g vᵀ + c) k + g Sᵀ + c zᵀ]. c is computed here, and written for the dk sweep: −g·o when
    NORMALIZE is divisive (1), −s·g·u_t when subtractive (2). The state it starts from as the forward's."""
    i_k, doc_row, slot_row, origin, length, first, stop = _segment_program(cu_seqlens, table, T, H, VARLEN,
                                                                           SEGMENTED)
    state_rows = doc_row, slot_row
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
    if HAS_INITIAL or HAS_STARTS:
        S += _load_state(s_0, s_in, *state_rows, DK * DV, ck[:, None] * DV + cv[None, :], mk[:, None] & mv[None, :],
                         HAS_INITIAL, HAS_STARTS)
        if HAS_CENTER:
            z += _load_state(z_0, z_in, *state_rows, DK, ck, mk, HAS_INITIAL, HAS_STARTS)
        if NORMALIZE == 2:
            u += _load_state(u_0, u_in, *state_rows, DV, cv, mv, HAS_INITIAL, HAS_STARTS)

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
    q, k, v, g, scale, center, weight, dk, dv, ds_0, dz_0, du_0, ds_in, dz_in, du_in, ds_out, dz_out, du_out,
    cu_seqlens, table, T, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FOR_DK: tl.constexpr,
    INTRA: tl.constexpr, UPDATE: tl.constexpr, STORE: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_CENTER: tl.constexpr, HAS_FINAL_GRAD: tl.constexpr, HAS_STARTS: tl.constexpr,
    OUT: tl.constexpr, HAS_DU: tl.constexpr, SEGMENTED: tl.constexpr, VARLEN: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Reverse sweep over one segment: dS = Σ_later (s q)ᵀ g and dz = Σ_later s c q, from the gradient it is given
    (``_state_ptrs``: the final state's ``d*_0`` where the segment has no slot, HAS_FINAL_GRAD; else its slot's
    ``d*_in``, HAS_STARTS; else zero).

    FOR_DK: a block of key channels, all value channels: dk = tril(s ⊙ (g vᵀ + c))ᵀ q + v dSᵀ + dz.
    Otherwise a block of value channels, all key channels: dv = tril(s ⊙ q kᵀ)ᵀ g + k dS (+ du).
    OUT (``_store_state``): FOR_DK writes dS (and dz) as they stand before the segment's first token (the initial
    state's gradient, or a segment's own sum). HAS_DU (subtractive) also runs du = Σ_later w g, the gradient of
    u_t = Σ_{j ≤ t} v_j, which dv adds, and writes it with OUT."""
    i_b, doc_row, slot_row, origin, length, first, stop = _segment_program(cu_seqlens, table, T, H, VARLEN,
                                                                           SEGMENTED)
    state_rows = doc_row, slot_row
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

    state_offs, state_mask = ck[:, None] * DV + cv[None, :], mk[:, None] & mv[None, :]
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    dz = tl.zeros([BK], dtype=tl.float32)
    du = tl.zeros([BV], dtype=tl.float32)
    if HAS_FINAL_GRAD or HAS_STARTS:
        dS += _load_state(ds_0, ds_in, *state_rows, DK * DV, state_offs, state_mask, HAS_FINAL_GRAD, HAS_STARTS)
        if HAS_CENTER:
            dz += _load_state(dz_0, dz_in, *state_rows, DK, ck, mk, HAS_FINAL_GRAD, HAS_STARTS)
        if HAS_DU:
            du += _load_state(du_0, du_in, *state_rows, DV, cv, mv, HAS_FINAL_GRAD, HAS_STARTS)

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

    if HAS_DU and OUT > 0:
        _store_state(du_out, du, *state_rows, DV, cv, mv, OUT)
    if FOR_DK and OUT > 0:
        _store_state(ds_out, dS, *state_rows, DK * DV, state_offs, state_mask, OUT)
        if HAS_CENTER:
            _store_state(dz_out, dz, *state_rows, DK, ck, mk, OUT)


@triton.jit
def _combine_kernel(parts, decays, edge, starts, totals, spans, H, WIDTH, HAS_DECAY: tl.constexpr,
                    HAS_EDGE: tl.constexpr, HAS_TOTAL: tl.constexpr, ORDER: tl.constexpr, BLOCK: tl.constexpr):
    """For one (cut document, head) and a block of one state field's elements: the state each of its segments
    starts from and the total, a running fp32 sum over its segments' own sums (``parts``, by slot) from ``edge``
    (the state at the document's edge, by document). ``spans``: per cut document (document, first slot, end slot).
    ORDER 0: a segment starts from the ones before it; 1 (the gradient sweeps): after it; 2 (global): all.
    HAS_DECAY (the decayed kernels'): what a segment starts from decays over it by ``exp(decays)`` ([slots, H],
    its log-decay) before its own sum adds: ``acc ← e^{b} acc + part``."""
    i_sh, i_w = tl.program_id(0), tl.program_id(1)
    span = spans + (i_sh // H) * 3
    doc, first, end = tl.load(span), tl.load(span + 1), tl.load(span + 2)
    head = i_sh % H
    cols = i_w * BLOCK + tl.arange(0, BLOCK)
    mask = cols < WIDTH
    at_doc = (doc.to(tl.int64) * H + head) * WIDTH + cols
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_EDGE:
        acc += tl.load(edge + at_doc, mask=mask, other=0.0)
    count = end - first
    for i in range(count):
        row = (first + (count - 1 - i if ORDER == 1 else i)).to(tl.int64) * H + head
        at = row * WIDTH + cols
        if ORDER != 2:
            tl.store(starts + at, acc, mask=mask)
        if HAS_DECAY:
            acc *= tl.exp(tl.load(decays + row))
        acc += tl.load(parts + at, mask=mask, other=0.0)
    if HAS_TOTAL:
        tl.store(totals + at_doc, acc, mask=mask)
    if ORDER == 2:
        for i in range(count):
            tl.store(starts + ((first + i).to(tl.int64) * H + head) * WIDTH + cols, acc, mask=mask)


# ---------------------------------------------------------------------------------------------------------
# Host side: shapes, launches, and the autograd function that ties the sweeps together.

MAX_HEAD_DIM = 256  # the state block (head dim × value block, fp32) lives in registers
# Launch settings, fixed. Timed on an H200 (benchmarks/gpu_h200_round4.md, B, H, D, T = 8, 32, 128, 8192 in bf16,
# chunk 64): 4 warps over channel blocks of 64 ran fwd+bwd in 2.94 ms, 8 warps (the resource report's pick, which
# spills least) in 6.00 ms; every other setting of the sweep at this chunk was slower.
CONFIG = dict(block=64, num_warps=4, num_stages=2)

# Segments (flash-linear-attention's split of chunk_fwd_h). One program per (sequence, head, channel block) walks
# its sequence's chunks in order; when one document's chain is much longer than the GPU's even share of the work,
# most of the GPU idles while it runs. Then the long documents are cut into segments: a first pass sums each
# segment's own state (Σ kᵀv: no decay, so states add), a running sum over each document's segments gives each the
# state it starts from, and the main pass runs one program per (segment or uncut document, head, channel block).
# The first pass reads the cut documents' k and v once more: worth it only with idle SMs.
SEGMENT_CHUNKS = None  # chunks per segment: None chooses by `segment_chunks`; 0 never segments; n > 0 forces n
WARPS_PER_SM = 8  # resident at once: at 255 registers a thread (the resource report) 8 warps fill 65,536
MIN_SEGMENT_CHUNKS = 8  # a segment's state (d × dv fp32, written, summed, read) against its tokens' bytes
DEFAULT_MULTIPROCESSORS = 132  # an H200's, where no CUDA device says (the interpreter)


@contextlib.contextmanager
def segments_forced(chunks: int | None):
    """Launches inside run as ``SEGMENT_CHUNKS = chunks`` (0: documents whole; n: cut into segments of n chunks),
    their backward too (the forward's table travels with it): for the first-use checks, whose small inputs the
    rule would never cut."""
    global SEGMENT_CHUNKS
    saved, SEGMENT_CHUNKS = SEGMENT_CHUNKS, chunks
    try:
        yield
    finally:
        SEGMENT_CHUNKS = saved


def segment_chunks(longest, steps, multiprocessors):
    """Chunks per segment, or None to keep every document whole. ``longest``: the longest document's chunks, the
    longest chain a program walks; ``steps``: chunk steps over all programs of a kernel (each document's chunks ×
    heads × channel blocks). A resident program's even share of the steps (2 resident per SM at 4 warps) is what
    the run would take if the GPU never idled. Cut only when the longest chain is over twice that share (the GPU
    would idle for over half the run); then into segments of half a share (at least MIN_SEGMENT_CHUNKS), leaving
    documents no longer than that whole. Programs no longer than half a share end within 1.5 shares (Graham's
    bound for greedy scheduling: the share plus the longest program; rows run longest first). Cutting adds at most
    ``steps / size`` programs (two waves) to the whole documents' grid, whatever the number of documents, and the
    cut documents' states (one per segment and head) number at most ``2 · steps / size`` over the channel blocks:
    ``4 · resident`` over them, ≈ 35 MB at D = 128 on an H200."""
    resident = max(1, WARPS_PER_SM // CONFIG["num_warps"]) * multiprocessors
    share = steps / resident
    if longest <= 2 * share:
        return None
    size = max(MIN_SEGMENT_CHUNKS, math.ceil(share / 2))
    return size if size < longest else None


class SegmentTable(NamedTuple):
    """What the segmented kernels read, built on the host. ``pairs``: per program row (document, first token, stop
    token, slot), the segments of cut documents first (they alone have a slot: a row of the segments' state
    buffers; the sums pass runs over them only), then the uncut documents (slot −1: they start from the initial
    state and store the final one themselves), each part longest first (the GPU starts rows in order). ``spans``:
    per cut document (document, first slot, end slot), its segments' slots in order."""
    pairs: list
    spans: list
    slotted: int  # the pairs with a slot (the first ones)


def segment_table(lengths, chunk, size, slot_every_document=False):
    """The segments of documents of ``lengths`` tokens: a document of more than ``size`` chunks is cut into
    ceil(chunks / size) segments of whole chunks from its first token, evened out (the last may be shorter), so no
    segment holds two documents; the others stay whole. ``slot_every_document`` (global attention, where every
    token reads its document's total) gives whole documents a slot too."""
    cut, whole, spans = [], [], []
    for doc, length in enumerate(lengths):
        chunks = -(-length // chunk)
        count = -(-chunks // size)
        if count == 1 and not slot_every_document:
            whole.append((doc, 0, length, -1))
            continue
        span = -(-chunks // count) * chunk
        first_slot = len(cut)
        cut.extend((doc, i * span, min((i + 1) * span, length), first_slot + i) for i in range(count))
        spans.append((doc, first_slot, len(cut)))
    def longest_first(pairs):
        return sorted(pairs, key=lambda pair: pair[1] - pair[2])
    return SegmentTable(longest_first(cut) + longest_first(whole), spans, len(cut))


def _multiprocessors(device):
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_MULTIPROCESSORS


class _Documents:
    """The documents' lengths, read on the host once per offsets (a sync on a GPU: every layer shares them), and
    the segment tables built from them, on the device, by their settings."""

    def __init__(self, lengths):
        self.lengths, self.longest, self.tables = lengths, max(lengths), {}

    def table(self, key, build):
        if key not in self.tables:
            self.tables[key] = build()
        return self.tables[key]


_offsets = OffsetsMemo()  # the last offsets' documents
_rows = OffsetsMemo()  # the last equal-length batch's sequences


def _documents(cu_seqlens, batch, length):
    if cu_seqlens is None:
        return _rows.get(None, lambda: _Documents([length] * batch), batch, length)

    def read():
        offsets = cu_seqlens.tolist()
        return _Documents([b - a for a, b in zip(offsets, offsets[1:])])
    return _offsets.get(cu_seqlens, read)


def _to_device(table: SegmentTable, device):
    """The table's pairs [P, 4] and spans [cut documents, 3] as int32 on ``device``, in one copy that does not wait
    for the device (pinned host memory)."""
    flat = torch.tensor([x for rows in (table.pairs, table.spans) for row in rows for x in row], dtype=torch.int32)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    return flat[:4 * len(table.pairs)], flat[4 * len(table.pairs):]


class _Launch:
    """Geometry of one call: tokens laid out [B*T, H, D]; programs over (document × head, channel block), or with
    ``segment`` over (the table's pairs × head, channel block).

    The forward and dv split the value channels into blocks (each needs every key channel for q kᵀ); dq and
    dk split the key channels (each needs every value channel for dO vᵀ). So every program writes whole
    outputs: no partial sums."""

    def __init__(self, q, v, cu_seqlens, chunk_size):
        batch, self.T, self.H, self.DK = q.shape
        self.DV = v.shape[-1]
        if max(self.DK, self.DV) > MAX_HEAD_DIM:
            raise ValueError(f"triton linear attention supports head dims up to {MAX_HEAD_DIM}; "
                             f"got q/k {self.DK}, v {self.DV}")
        self.BT = max(16, chunk_size)  # the tiling only: results do not depend on it; tl.dot needs ≥ 16
        self.cu_seqlens = cu_seqlens
        self.N = batch if cu_seqlens is None else cu_seqlens.numel() - 1
        self.documents = _documents(cu_seqlens, batch, self.T)
        longest = self.documents.longest
        if longest * self.H * max(self.DK, self.DV) >= 2**31:
            raise ValueError(f"impl='triton' indexes within a sequence in 32 bits: a sequence of {longest} tokens "
                             f"× {self.H} heads × {max(self.DK, self.DV)} channels is too long; split it and "
                             "carry the state (initial_state / output_final_state)")
        self.device = q.device
        self.tokens = batch * self.T
        self.BK_full = max(16, triton.next_power_of_2(self.DK))
        self.BV_full = max(16, triton.next_power_of_2(self.DV))
        self.BK_split = min(CONFIG["block"], self.BK_full)
        self.BV_split = min(CONFIG["block"], self.BV_full)
        self.NK = triton.cdiv(self.DK, self.BK_split)
        self.NV = triton.cdiv(self.DV, self.BV_split)
        self.rows = self.N * self.H
        self.pairs = self.spans = None  # whole documents
        self.precision = dot_precision(q.dtype)
        self.num_warps, self.num_stages = CONFIG["num_warps"], CONFIG["num_stages"]

    def segment(self, causal):
        """Cut long documents into segments where ``segment_chunks`` (or SEGMENT_CHUNKS) says: the table on the
        device (built once per offsets and settings), the rows of the main pass (``rows``) and of the sums pass
        (``slotted_rows``), and the slots (``slots``). Global attention with whole documents needs no table."""
        size = SEGMENT_CHUNKS
        lengths = self.documents.lengths
        if size is None:
            blocks = self.H * max(self.NK, self.NV)
            chunks = sum(-(-n // self.BT) for n in lengths)
            size = segment_chunks(triton.cdiv(self.documents.longest, self.BT), chunks * blocks,
                                  _multiprocessors(self.device))
        if not size or self.documents.longest <= size * self.BT:
            return
        table = segment_table(lengths, self.BT, size, slot_every_document=not causal)
        self.pairs, self.spans = self.documents.table(
            (self.BT, size, causal, self.device), lambda: _to_device(table, self.device))
        self.rows, self.slotted_rows = len(table.pairs) * self.H, table.slotted * self.H
        self.slots, self.cut = table.slotted, len(table.spans)

    def common(self):
        return dict(T=self.T, H=self.H, DK=self.DK, DV=self.DV, BT=self.BT, VARLEN=self.cu_seqlens is not None,
                    PRECISION=self.precision, num_warps=self.num_warps, num_stages=self.num_stages)

    def segmented(self):
        """``common()`` and the table, for the kernels here (the decayed ones keep one program per sequence)."""
        return dict(table=self.pairs, SEGMENTED=self.pairs is not None, **self.common())

    def states(self, fields="Szun", slots=False):
        """Empty fp32 states by document [N, H, ...] or (``slots``) by slot [slots, H, ...], the fields named (S, z,
        u, n), None for the others."""
        shapes = dict(S=(self.DK, self.DV), z=(self.DK,), u=(self.DV,), n=())
        rows = self.slots if slots else self.N
        return tuple(torch.empty(rows, self.H, *shapes[f], device=self.device) if f in fields else None
                     for f in "Szun")


COMBINE_ORDERS = {"forward": 0, "reverse": 1, "whole": 2}


def _combine(g: _Launch, parts, edge, totals, order, decays=None):
    """Each segment's starting state (by slot), from every segment's own sum (``parts``, fields [slots, H, ...],
    None where unused) and the state at its document's edge (``edge``, [N, H, ...]; None: zero); the cut documents'
    totals go into their rows of ``totals`` (None: not wanted). ``order``: "forward", a segment starts from the
    ones before it; "reverse" (the gradient sweeps), from the ones after it; "whole" (global attention), from all
    of them. ``decays`` ([slots, H]): each segment's log-decay (the decayed kernels'). One small launch per field."""
    starts = []
    for i, part in enumerate(parts):
        if part is None:
            starts.append(None)
            continue
        width = math.prod(part.shape[2:])
        start = torch.empty_like(part)
        base, total = (None if t is None else t[i] for t in (edge, totals))
        block = min(1024, max(16, triton.next_power_of_2(width)))
        _combine_kernel[(g.cut * g.H, triton.cdiv(width, block))](
            part, part if decays is None else decays, part if base is None else base, start,
            part if total is None else total, g.spans, g.H, width, HAS_DECAY=decays is not None,
            HAS_EDGE=base is not None, HAS_TOTAL=total is not None, ORDER=COMBINE_ORDERS[order], BLOCK=block)
        starts.append(start)
    return tuple(starts)


def _forward(q, k, v, g: _Launch, normalize, eps, causal, initial):
    """Returns o, the per-token aux (den or a), the final state (S, z, u, n) and the states (S, z, u) the main pass
    started from, as the dq sweep reads them: by document (None: zero) and by slot (None: no slots)."""
    o = torch.empty_like(v)
    aux = torch.empty(g.tokens, g.H, dtype=torch.float32, device=g.device)
    final = g.states()

    def launch(rows, *, intra, update, store_o, by_doc=None, by_slot=None, out=None, to_slots=False):
        _forward_kernel[(rows, g.NV)](
            q, k, v, o, aux, *(by_doc or (aux,) * 4), *(by_slot or (aux,) * 4), *(out or (aux,) * 4), g.cu_seqlens,
            eps=eps, NORMALIZE=NORMALIZE_CODES[normalize], INTRA=intra, UPDATE=update, STORE_O=store_o,
            HAS_INITIAL=by_doc is not None, HAS_STARTS=by_slot is not None,
            OUT=0 if out is None else 2 if to_slots else 1, BK=g.BK_full, BV=g.BV_split, **g.segmented())

    if g.pairs is None:  # whole documents
        if causal:  # one pass, the state carried through each document
            launch(g.rows, intra=True, update=True, store_o=True, by_doc=initial, out=final)
            return o, aux, final, None if initial is None else initial[:3], None
        # global: sum each document's state (from the initial one), then apply it to every token
        launch(g.rows, intra=False, update=True, store_o=False, by_doc=initial, out=final)
        launch(g.rows, intra=False, update=False, store_o=True, by_doc=final)
        return o, aux, final, final[:3], None
    # each cut document's segments' own sums first; global attention applies each document's total to every token
    parts = g.states(slots=True)
    launch(g.slotted_rows, intra=False, update=True, store_o=False, out=parts, to_slots=True)
    starts = _combine(g, parts, initial, final, "forward" if causal else "whole")
    by_doc = initial if causal else None  # (global: every document has slots)
    launch(g.rows, intra=causal, update=causal, store_o=True, by_doc=by_doc, by_slot=starts,
           out=final if causal else None)
    return o, aux, final, None if by_doc is None else by_doc[:3], starts[:3]


def _backward(do, q, k, v, o, aux, n_0, starts, d_final, g: _Launch, normalize, causal, want_d_initial):
    """Gradients of q, k, v and of the initial state (S, z, u), given dO, the states the forward's main pass
    started from (``starts``: by document, by slot) and the final state's gradient (None where no loss reached
    them)."""
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

    def given(states):
        return (dummy,) * 3 if states is None else tuple(dummy if t is None else t for t in states)

    # dq: forward sweep over the state S, from each segment's start (the whole document's, when not causal)
    by_doc, by_slot = starts
    dq = torch.empty_like(q)
    _backward_dq_kernel[(g.rows, g.NK)](
        k, v, do, o, scale, center, dq, *given(by_doc), *given(by_slot), g.cu_seqlens, INTRA=causal,
        NORMALIZE=NORMALIZE_CODES[normalize], HAS_INITIAL=by_doc is not None, HAS_STARTS=by_slot is not None,
        **split_k, **flags)

    # dk, dv: reverse sweeps over dS = Σ_later (s q)ᵀ dO (for non-causal, first summed over the whole document)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    fields = "S" + "z" * (normalize != "none") + "u" * has_du
    d_edge = None  # the gradients at the documents' ends
    if any(t is not None for t in d_final):
        d_edge = tuple(None if e is None else e.zero_() if t is None else t.float().contiguous()
                       for e, t in zip(g.states(fields=fields), d_final))
    d_initial = g.states(fields=fields)[:3] if want_d_initial or (g.pairs is None and not causal) else None

    def sweep(rows, *, for_dk, intra, update, store, d_doc=None, d_slot=None, d_out=None, to_slots=False):
        carries_du = has_du and (not for_dk or not store)  # dv adds du; the sums pass writes it
        _backward_dk_dv_kernel[(rows, g.NK if for_dk else g.NV)](
            q, k, v, do, scale, center, weight, dk, dv, *given(d_doc), *given(d_slot), *given(d_out), g.cu_seqlens,
            FOR_DK=for_dk, INTRA=intra, UPDATE=update, STORE=store, HAS_FINAL_GRAD=d_doc is not None,
            HAS_STARTS=d_slot is not None, OUT=0 if d_out is None else 2 if to_slots else 1, HAS_DU=carries_du,
            **(split_k if for_dk else split_v), **flags)

    if g.pairs is None and not causal:  # the whole documents' sums (the initial state's gradient), then the sweeps
        sweep(g.rows, for_dk=True, intra=False, update=True, store=False, d_doc=d_edge, d_out=d_initial)
        d_edge = d_initial
    elif g.pairs is not None:  # each cut document's segments' own sums first (the dk programs see every value
        parts = g.states(fields=fields, slots=True)[:3]  # channel, so du too), a running sum, then the sweeps
        sweep(g.slotted_rows, for_dk=True, intra=False, update=True, store=False, d_out=parts, to_slots=True)
        d_starts = _combine(g, parts, d_edge, d_initial, "reverse" if causal else "whole")
        if not causal:
            d_edge = None  # (global: every document has slots)
    sweep(g.rows, for_dk=True, intra=causal, update=causal, store=True, d_doc=d_edge,
          d_slot=None if g.pairs is None else d_starts, d_out=d_initial if causal else None)
    sweep(g.rows, for_dk=False, intra=causal, update=causal, store=True, d_doc=d_edge,
          d_slot=None if g.pairs is None else d_starts, d_out=d_initial if causal else None)
    return (dq, dk, dv), d_initial if want_d_initial else (None, None, None)


class _LinearAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, S_0, z_0, u_0, n_0, cu_seqlens, normalize, eps, causal, chunk_size):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        g = _Launch(q, v, cu_seqlens, chunk_size)
        g.segment(causal)
        initial = None
        if S_0 is not None:
            initial = tuple(t.float().contiguous() for t in (S_0, z_0, u_0, n_0))
        o, aux, final, by_doc, by_slot = _forward(q, k, v, g, normalize, eps, causal, initial)
        ctx.save_for_backward(q, k, v, o, aux, *(initial[3:] if initial else ()), *(by_doc or ()), *(by_slot or ()))
        ctx.launch, ctx.normalize, ctx.causal = g, normalize, causal
        ctx.has = initial is not None, by_doc is not None, by_slot is not None
        ctx.mark_non_differentiable(final[3])
        ctx.set_materialize_grads(False)  # outputs no loss reached come as None: backward skips their zeros
        return o, *final

    @staticmethod
    def backward(ctx, do, dS_T, dz_T, du_T, _dn_T):
        q, k, v, o, aux, *rest = ctx.saved_tensors
        has_initial, has_by_doc, has_by_slot = ctx.has
        n_0 = rest.pop(0) if has_initial else None
        by_doc = tuple(rest[:3]) if has_by_doc else None
        by_slot = tuple(rest[-3:]) if has_by_slot else None
        want_d_initial = has_initial and any(ctx.needs_input_grad[3:6])
        (dq, dk, dv), (dS_0, dz_0, du_0) = _backward(
            do, q, k, v, o, aux, n_0, (by_doc, by_slot), (dS_T, dz_T, du_T), ctx.launch, ctx.normalize, ctx.causal,
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
