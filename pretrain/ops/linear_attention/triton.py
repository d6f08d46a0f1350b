"""Triton kernels for chunked linear attention (docs/MIXERS.md#chunked): one fused pass forward, three backward.

Each program owns one (sequence, head, block of channels) and walks the chunks of its sequence in order,
carrying the fp32 state ``S = Σ kᵀv`` (and ``z = Σ k``, ``u = Σ v``, ``n`` = tokens seen) in registers: per
chunk a C×C masked product for the tokens inside it and a product with the state for those before it. Nothing
of size T/C × d × dv is ever stored, so memory stays O(T·d). Packed documents (``cu_seqlens``) are sequences
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

The same kernels run on CPU under ``TRITON_INTERPRET=1``; the tests hold them to the naive reference there.
"""
import os

import torch
import triton
import triton.language as tl

from ..documents import document_sums
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
    """This program's channel block, its (sequence × head) index, its ``origin`` (the row of its sequence's first
    token and its head in the ``[tokens, H]`` layout, ``bos·H + head``: times a width, where its tiles start) and
    its sequence's length."""
    i_b, i_nh = tl.program_id(0), tl.program_id(1)
    bos, eos = _sequence_bounds(cu_seqlens, i_nh // H, T, VARLEN)
    return i_b, i_nh, bos * H + i_nh % H, (eos - bos).to(tl.int32)


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
    T, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, eps,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NORMALIZE: tl.constexpr, INTRA: tl.constexpr, UPDATE: tl.constexpr, STORE_O: tl.constexpr,
    HAS_INITIAL: tl.constexpr, STORE_FINAL: tl.constexpr, VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):
    """o = [tril(q kᵀ) v + q S] normalized; also writes ``aux`` (den or a, per token) and the final state."""
    i_v, i_nh, origin, length = _program(cu_seqlens, T, H, VARLEN)
    q, k = q + origin * DK, k + origin * DK
    v, o = v + origin * DV, o + origin * DV
    aux += origin
    rows = tl.arange(0, BT)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    mk, mv = ck < DK, cv < DV
    dtype = q.dtype.element_ty

    state_offs = i_nh.to(tl.int64) * DK * DV + ck[:, None] * DV + cv[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    z = tl.zeros([BK], dtype=tl.float32)
    u = tl.zeros([BV], dtype=tl.float32)
    n = 0.0
    if HAS_INITIAL:
        S += tl.load(s_in + state_offs, mask=mk[:, None] & mv[None, :], other=0.0)
        if NORMALIZE > 0:
            z += tl.load(z_in + i_nh * DK + ck, mask=mk, other=0.0)
        if NORMALIZE == 2:
            u += tl.load(u_in + i_nh * DV + cv, mask=mv, other=0.0)
            n += tl.load(n_in + i_nh)

    for start in range(0, length, BT):
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
            tl.store(z_out + i_nh * DK + ck, z, mask=mk)
            tl.store(n_out + i_nh, n)
        tl.store(u_out + i_nh * DV + cv, u, mask=mv)


@triton.jit
def _backward_dq_kernel(
    k, v, g, o, scale, center, dq, s_in, z_in, u_in, cu_seqlens,
    T, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    INTRA: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_CENTER: tl.constexpr, NORMALIZE: tl.constexpr,
    HAS_INITIAL: tl.constexpr, VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):
    """Forward sweep for a block of key channels (all value channels), S, z (and u) running over earlier chunks:
    dq = s ⊙ [tril(g vᵀ + c) k + g Sᵀ + c zᵀ]. c is computed here, and written for the dk sweep: −g·o when
    NORMALIZE is divisive (1), −s·g·u_t when subtractive (2)."""
    i_k, i_nh, origin, length = _program(cu_seqlens, T, H, VARLEN)
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
        S += tl.load(s_in + i_nh.to(tl.int64) * DK * DV + ck[:, None] * DV + cv[None, :],
                     mask=mk[:, None] & mv[None, :], other=0.0)
        if HAS_CENTER:
            z += tl.load(z_in + i_nh * DK + ck, mask=mk, other=0.0)
        if NORMALIZE == 2:
            u += tl.load(u_in + i_nh * DV + cv, mask=mv, other=0.0)

    for start in range(0, length, BT):
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
    T, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FOR_DK: tl.constexpr,
    INTRA: tl.constexpr, UPDATE: tl.constexpr, STORE: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_CENTER: tl.constexpr, HAS_FINAL_GRAD: tl.constexpr, STORE_DS: tl.constexpr,
    HAS_DU: tl.constexpr, STORE_DU: tl.constexpr, VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):
    """Reverse sweep over dS = Σ_later (s q)ᵀ g and dz = Σ_later s c q, from the final state's gradient.

    FOR_DK: a block of key channels, all value channels: dk = tril(s ⊙ (g vᵀ + c))ᵀ q + v dSᵀ + dz.
    Otherwise a block of value channels, all key channels: dv = tril(s ⊙ q kᵀ)ᵀ g + k dS (+ du).
    STORE_DS writes dS (and dz) as they stand before the first token: the initial state's gradient.
    HAS_DU (subtractive) also runs du = Σ_later w g from ``du_in``, the gradient of u_t = Σ_{j ≤ t} v_j, which dv
    adds; STORE_DU writes it as it stands before the first token."""
    i_b, i_nh, origin, length = _program(cu_seqlens, T, H, VARLEN)
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

    state_offs = i_nh.to(tl.int64) * DK * DV + ck[:, None] * DV + cv[None, :]
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    dz = tl.zeros([BK], dtype=tl.float32)
    du = tl.zeros([BV], dtype=tl.float32)
    if HAS_FINAL_GRAD:
        dS += tl.load(ds_in + state_offs, mask=mk[:, None] & mv[None, :], other=0.0)
        if HAS_CENTER:
            dz += tl.load(dz_in + i_nh * DK + ck, mask=mk, other=0.0)
    if HAS_DU:
        du += tl.load(du_in + i_nh * DV + cv, mask=mv, other=0.0)

    num_chunks = tl.cdiv(length, BT)
    for i in range(num_chunks):
        start = (num_chunks - 1 - i) * BT
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
        tl.store(du_out + i_nh * DV + cv, du, mask=mv)
    if STORE_DS:
        tl.store(ds_out + state_offs, dS, mask=mk[:, None] & mv[None, :])
        if HAS_CENTER:
            tl.store(dz_out + i_nh * DK + ck, dz, mask=mk)


# ---------------------------------------------------------------------------------------------------------
# Host side: shapes, launches, and the autograd function that ties the sweeps together.

MAX_HEAD_DIM = 256  # the state block (head dim × value block, fp32) lives in registers
# Launch settings, fixed. Timed on an H200 (benchmarks/gpu_h200_round4.md, B, H, D, T = 8, 32, 128, 8192 in bf16,
# chunk 64): 4 warps over channel blocks of 64 ran fwd+bwd in 2.94 ms, 8 warps (the resource report's pick, which
# spills least) in 6.00 ms; every other setting of the sweep at this chunk was slower.
CONFIG = dict(block=64, num_warps=4, num_stages=2)


class _Launch:
    """Geometry of one call: tokens laid out [B*T, H, D]; programs over (channel block, sequence × head).

    The forward and dv split the value channels into blocks (each needs every key channel for q kᵀ); dq and
    dk split the key channels (each needs every value channel for dO vᵀ). So every program writes whole
    outputs: no partial sums."""

    def __init__(self, q, v, cu_seqlens, chunk_size):
        batch, self.T, self.H, self.DK = q.shape
        self.DV = v.shape[-1]
        if max(self.DK, self.DV) > MAX_HEAD_DIM:
            raise ValueError(f"triton linear attention supports head dims up to {MAX_HEAD_DIM}; "
                             f"got q/k {self.DK}, v {self.DV}")
        self.cu_seqlens = cu_seqlens
        self.N = batch if cu_seqlens is None else cu_seqlens.numel() - 1
        longest = self.T  # a packed row's documents are no longer: their lengths are read (a host sync) only if T is
        if cu_seqlens is not None and longest * self.H * max(self.DK, self.DV) >= 2**31:
            longest = int(cu_seqlens.diff().max())
        if longest * self.H * max(self.DK, self.DV) >= 2**31:
            raise ValueError(f"impl='triton' indexes within a sequence in 32 bits: a sequence of {longest} tokens "
                             f"× {self.H} heads × {max(self.DK, self.DV)} channels is too long; split it and "
                             "carry the state (initial_state / output_final_state)")
        self.tokens = batch * self.T
        self.BT = max(16, chunk_size)  # the tiling only: results do not depend on it; tl.dot needs ≥ 16
        self.BK_full = max(16, triton.next_power_of_2(self.DK))
        self.BV_full = max(16, triton.next_power_of_2(self.DV))
        self.BK_split = min(CONFIG["block"], self.BK_full)
        self.BV_split = min(CONFIG["block"], self.BV_full)
        self.NK = triton.cdiv(self.DK, self.BK_split)
        self.NV = triton.cdiv(self.DV, self.BV_split)
        if os.environ.get("TRITON_INTERPRET") == "1":
            self.precision = "interpret"
        else:
            self.precision = "ieee" if q.dtype == torch.float32 else "tf32"
        self.num_warps, self.num_stages = CONFIG["num_warps"], CONFIG["num_stages"]

    def common(self):
        return dict(T=self.T, H=self.H, DK=self.DK, DV=self.DV, BT=self.BT, VARLEN=self.cu_seqlens is not None,
                    PRECISION=self.precision, num_warps=self.num_warps, num_stages=self.num_stages)

    def state(self, *trailing, dtype=torch.float32, device=None):
        return torch.empty(self.N, self.H, *trailing, dtype=dtype, device=device)


def _forward(q, k, v, g: _Launch, normalize, eps, causal, initial, want_final):
    """Returns o, the per-token aux (den or a) and the final state (S, z, u, n)."""
    dev = q.device
    o = torch.empty_like(v)
    aux = torch.empty(g.tokens, g.H, dtype=torch.float32, device=dev)
    final = (g.state(g.DK, g.DV, device=dev), g.state(g.DK, device=dev), g.state(g.DV, device=dev),
             g.state(device=dev))
    dummy = aux
    s_in, z_in, u_in, n_in = initial if initial is not None else (dummy,) * 4

    def launch(*, intra, update, store_o, has_initial, store_final, states):
        _forward_kernel[(g.NV, g.N * g.H)](
            q, k, v, o, aux, *states, *final, g.cu_seqlens, eps=eps, NORMALIZE=NORMALIZE_CODES[normalize],
            INTRA=intra, UPDATE=update, STORE_O=store_o, HAS_INITIAL=has_initial, STORE_FINAL=store_final,
            BK=g.BK_full, BV=g.BV_split, **g.common())

    given = (s_in, z_in, u_in, n_in)
    if causal:
        launch(intra=True, update=True, store_o=True, has_initial=initial is not None, store_final=want_final,
               states=given)
    else:  # sum the whole sequence into the state, then apply it to every token
        launch(intra=False, update=True, store_o=False, has_initial=initial is not None, store_final=True,
               states=given)
        totals = tuple(t.clone() for t in final)
        launch(intra=False, update=False, store_o=True, has_initial=True, store_final=False, states=totals)
    return o, aux, final


def _backward(do, q, k, v, o, aux, initial, final, d_final, g: _Launch, normalize, causal, want_d_initial):
    """Gradients of q, k, v and of the initial state (S, z, u), given dO and the final state's gradient."""
    dev = q.device
    do = do.contiguous()
    dS_T, dz_T, du_T = d_final
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
                               initial=None if initial is None else initial[3])
        scale = (1.0 / n_t).reshape(aux.shape)
        weight = (1.0 - aux * scale) * scale  # ∂o_t/∂u_t: v's own share of the gradient is Σ_later w·dO
        center = torch.empty_like(aux)  # −s·dO·u_t, written by the dq sweep
    flags = dict(HAS_SCALE=scale is not None, HAS_CENTER=center is not None, **g.common())
    scale, center, weight = (dummy if x is None else x.contiguous() for x in (scale, center, weight))
    split_k = dict(BK=g.BK_split, BV=g.BV_full)  # dq, dk: a block of key channels, every value channel
    split_v = dict(BK=g.BK_full, BV=g.BV_split)  # dv: a block of value channels, every key channel

    # dq: forward sweep over the state S (the whole sequence's, when not causal)
    states = initial if causal else final
    dq = torch.empty_like(q)
    _backward_dq_kernel[(g.NK, g.N * g.H)](
        k, v, do, o, scale, center, dq, *(states[:3] if states is not None else (dummy,) * 3), g.cu_seqlens,
        INTRA=causal, NORMALIZE=NORMALIZE_CODES[normalize],
        HAS_INITIAL=states is not None, **split_k, **flags)

    # dk, dv: reverse sweeps over dS = Σ_later (s q)ᵀ dO (for non-causal, first summed over the whole sequence)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dS_0, dz_0 = g.state(g.DK, g.DV, device=dev), g.state(g.DK, device=dev)
    has_final_grad = dS_T is not None or dz_T is not None
    if has_final_grad:
        dS_T = torch.zeros_like(dS_0) if dS_T is None else dS_T.float().contiguous()
        dz_T = torch.zeros_like(dz_0) if dz_T is None else dz_T.float().contiguous()
    else:
        dS_T = dz_T = dummy
    has_du = normalize == "subtractive"
    du_0 = g.state(g.DV, device=dev) if has_du else dummy
    if has_du:
        du_T = torch.zeros_like(du_0) if du_T is None else du_T.float().contiguous()

    def sweep(*, for_dk, intra, update, store, has_final, d_in, store_ds, du_in=None, store_du=False):
        grid = (g.NK if for_dk else g.NV, g.N * g.H)
        _backward_dk_dv_kernel[grid](
            q, k, v, do, scale, center, weight, dk, dv, *d_in, dummy if du_in is None else du_in, dS_0, dz_0, du_0,
            g.cu_seqlens, FOR_DK=for_dk, INTRA=intra, UPDATE=update, STORE=store, HAS_FINAL_GRAD=has_final,
            STORE_DS=store_ds, HAS_DU=du_in is not None, STORE_DU=store_du, **(split_k if for_dk else split_v),
            **flags)

    own_du = du_T if has_du else None  # the dv sweep runs v's own share
    final_grads = (dS_T, dz_T)
    if causal:
        sweep(for_dk=True, intra=True, update=True, store=True, has_final=has_final_grad, d_in=final_grads,
              store_ds=want_d_initial)
        sweep(for_dk=False, intra=True, update=True, store=True, has_final=has_final_grad, d_in=final_grads,
              store_ds=False, du_in=own_du, store_du=has_du and want_d_initial)
    else:  # the first sweep also sums du over the whole sequence (it sees every value channel)
        sweep(for_dk=True, intra=False, update=True, store=False, has_final=has_final_grad, d_in=final_grads,
              store_ds=True, du_in=own_du, store_du=has_du)
        totals = (dS_0.clone(), dz_0.clone())
        sweep(for_dk=True, intra=False, update=False, store=True, has_final=True, d_in=totals, store_ds=False)
        sweep(for_dk=False, intra=False, update=False, store=True, has_final=True, d_in=totals, store_ds=False,
              du_in=du_0.clone() if has_du else None)

    if not want_d_initial:
        return (dq, dk, dv), (None, None, None)
    return (dq, dk, dv), (dS_0, dz_0 if normalize != "none" else None, du_0 if has_du else None)


class _LinearAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, S_0, z_0, u_0, n_0, cu_seqlens, normalize, eps, causal, chunk_size):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        g = _Launch(q, v, cu_seqlens, chunk_size)
        initial = None
        if S_0 is not None:
            initial = tuple(t.float().contiguous() for t in (S_0, z_0, u_0, n_0))
        o, aux, final = _forward(q, k, v, g, normalize, eps, causal, initial, want_final=True)
        ctx.save_for_backward(q, k, v, o, aux, *(initial or ()), *(final if not causal else ()))
        ctx.launch, ctx.normalize, ctx.causal = g, normalize, causal
        ctx.has_initial = initial is not None
        ctx.mark_non_differentiable(final[3])
        return o, *final

    @staticmethod
    def backward(ctx, do, dS_T, dz_T, du_T, _dn_T):
        q, k, v, o, aux, *rest = ctx.saved_tensors
        initial = tuple(rest[:4]) if ctx.has_initial else None
        final = tuple(rest[-4:]) if not ctx.causal else None
        want_d_initial = ctx.has_initial and any(ctx.needs_input_grad[3:6])
        (dq, dk, dv), (dS_0, dz_0, du_0) = _backward(
            do, q, k, v, o, aux, initial, final, (dS_T, dz_T, du_T), ctx.launch, ctx.normalize, ctx.causal,
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
