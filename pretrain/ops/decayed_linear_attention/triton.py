"""Triton kernels for decayed linear attention (docs/MIXERS.md#decay): the undecayed kernels' sweeps with a decay.

The layout, launch geometry and tile helpers are ``ops/linear_attention/triton.py``'s: one program per (sequence or
document, head, block of channels) walks its chunks in order with the fp32 state in registers, so nothing of size
T/C × D × Dv is stored. Within a chunk, ``b_i`` is the log-decay from the chunk's start through token i (a cumsum of
g in fp32); token i reads token j with ``exp(b_i − b_j)``, its exponent masked to −∞ above the diagonal *before*
``exp`` (never ``exp(b_i)·exp(−b_j)``, which overflows), reads the entering state with ``exp(b_i)``, and the state
handed on is ``exp(b_L) S + Σ_j exp(b_L − b_j) k_j v_jᵀ``. Per chunk, with D the masked decay matrix:

- forward: ``o = (exp(b) ⊙ q) S + (q kᵀ ⊙ D) v``;
- dq (forward sweep): ``dq = exp(b) ⊙ dO Sᵀ + (dO vᵀ ⊙ D) k``;
- dk, dv (reverse sweeps over dS, the gradient of the state leaving the chunk):
  ``dk = exp(b_L − b) ⊙ v dSᵀ + (dO vᵀ ⊙ D)ᵀ q``, ``dv = exp(b_L − b) ⊙ k dS + (q kᵀ ⊙ D)ᵀ dO``, and
  ``dS ← exp(b_L) dS + (exp(b) ⊙ q)ᵀ dO``.

The log-decay's gradient. With ``G_t`` the cumulative log-decay from the document's start, ``o_t`` depends on
``G_t`` through its query side and on ``G_j`` (j ≤ t) through its key side, so ``∂L/∂G_t = q_t·dq_t − k_t·dk_t``
(plus ``⟨S_T, dS_T⟩`` at the document's last token, the final state's query side), and ``dg_s = Σ_{t≥s} ∂L/∂G_t``
over the document. Under strong decay (g ≈ −20) dg is of order e⁻²⁰ while some of these terms are of order one,
so two of them are summed the other way round rather than left to cancel in fp32: the diagonal term
``(dO_t·v_t)(q_t·k_t)``, in both products, is left out of both (added to dq and dk apart); and in a document's last
chunk, where the state's gradient is dS_T alone, ``⟨S_T, dS_T⟩`` less the key side's state terms from s on is
``exp(b_L)⟨S_in, dS_T⟩`` plus those before s. The dq sweep writes ``q·dq`` per token and key block (and that inner
product, with S_in at hand); the dk sweep subtracts ``k·dk`` and runs the reverse sum across its chunks; the key
blocks' parts add up outside. (The chunked form's autograd leaves both to cancel: in fp32 at g ≈ −20 its dg is
wrong in every digit; ours is within 1e-5 of fp64.)

Segments. Long documents are cut as the undecayed kernels cut them (their rule and table). Forward: a sums pass
writes each segment's own state from zero and its log-decay ``Σ g``, a running sum over each document's segments
gives each the state it starts from, ``S ← e^{Σ g} S + part`` (fla's ``chunk_fwd_kernel_h_reduction`` idea), and
the main pass runs one program per segment or uncut document. Backward: dq starts each segment from the forward's
states; dk and dv from the gradient at its end, a running sum backwards of each segment's own dS (from zero) with the
same decays, from dS_T. The final state's terms of dg (``last_in``, the last chunk apart) belong to the segment that
ends its document; every segment sums ∂L/∂G over its own tokens only, writes that sum, and afterwards each gets its
document's later segments' sums added over its tokens (``_add_later_kernel``).

``normalize="divisive"`` is the same kernels on v with a column of ones (the denominator, ``z`` decaying as S does),
then a quotient; the same kernels run on CPU under ``TRITON_INTERPRET=1``, where the tests hold them to ``chunk``.
"""
import torch
import triton
import triton.language as tl

from ..linear_attention.normalize import _Quotient
from ..linear_attention.state import LinearAttentionState
from ..linear_attention.triton import (
    _combine,
    _Launch,
    _load,
    _load_state,
    _mm,
    _segment_program,
    _store,
    _store_state,
    kernel_offsets,
)


@triton.jit
def _chunk_decay(g, start, length, H: tl.constexpr, BT: tl.constexpr):
    """``b`` (the chunk's cumulative log-decay, fp32; g is 0 past the sequence's end) and its last value ``b_L``,
    taken from b itself (its least value: g ≤ 0), so that ``b_L − b_L`` is exactly 0 (a separate sum's is not)."""
    rows = tl.arange(0, BT)
    b = tl.cumsum(tl.load(g + (start + rows) * H, mask=start + rows < length, other=0.0).to(tl.float32), 0)
    return b, tl.min(b, 0)


@triton.jit
def _decay_matrix(b, BT: tl.constexpr, STRICT: tl.constexpr):
    """``exp(b_i − b_j)`` where token i reads token j (j ≤ i, or j < i when STRICT), else 0: masked before exp."""
    rows = tl.arange(0, BT)
    if STRICT:
        reads = rows[:, None] > rows[None, :]
    else:
        reads = rows[:, None] >= rows[None, :]
    return tl.exp(tl.where(reads, b[:, None] - b[None, :], float("-inf")))


@triton.jit
def _forward_kernel(
    q, k, v, g, o, s_0, s_in, s_out, decay_out, cu_seqlens, table,
    T, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_INITIAL: tl.constexpr, HAS_STARTS: tl.constexpr, STORE_O: tl.constexpr, OUT: tl.constexpr,
    SEGMENTED: tl.constexpr, VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):
    """A block of value channels, every key channel, over one segment (the undecayed kernels' ``_segment_program``;
    without a table, the whole document): o per chunk (STORE_O), the state carried from the one it is given
    (``s_0``, the initial state, where the segment has no slot; else ``s_in``, its slot's) and stored with OUT
    (``_store_state``). The sums pass (OUT 2) also stores the segment's log-decay Σ g into ``decay_out``."""
    i_v, doc_row, slot_row, origin, length, first, stop = _segment_program(cu_seqlens, table, T, H, VARLEN,
                                                                           SEGMENTED)
    q, k = q + origin * DK, k + origin * DK
    v, o = v + origin * DV, o + origin * DV
    g += origin
    ck, cv = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    dtype = q.dtype.element_ty

    state_offs = ck[:, None] * DV + cv[None, :]
    state_mask = (ck < DK)[:, None] & (cv < DV)[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_INITIAL or HAS_STARTS:
        S += _load_state(s_0, s_in, doc_row, slot_row, DK * DV, state_offs, state_mask, HAS_INITIAL, HAS_STARTS)

    decay = 0.0
    for start in range(first, stop, BT):
        b, b_last = _chunk_decay(g, start, length, H, BT)
        if STORE_O:
            q_c = _load(q, length, DK, start, 0, H, BT, BK)
        k_c = _load(k, length, DK, start, 0, H, BT, BK)
        v_c = _load(v, length, DV, start, i_v * BV, H, BT, BV)
        if STORE_O:
            num = _mm((q_c.to(tl.float32) * tl.exp(b)[:, None]).to(dtype), S.to(dtype), None, PRECISION)
            A = _mm(q_c, tl.trans(k_c), None, PRECISION) * _decay_matrix(b, BT, False)
            num = _mm(A.to(dtype), v_c, num, PRECISION)
            _store(o, num, length, DV, start, i_v * BV, H, BT, BV)
        k_end = (k_c.to(tl.float32) * tl.exp(b_last - b)[:, None]).to(dtype)
        S = _mm(tl.trans(k_end), v_c, S * tl.exp(b_last), PRECISION)
        decay += b_last

    if OUT > 0:
        _store_state(s_out, S, doc_row, slot_row, DK * DV, state_offs, state_mask, OUT)
    if OUT == 2:
        _store_state(decay_out, decay, doc_row, slot_row, 1, 0, i_v == 0, OUT)


@triton.jit
def _backward_dq_kernel(
    q, k, v, g, do, dq, qdq, s_0, s_in, ds_in, last_in, cu_seqlens, table, block_stride, documents_heads,
    T, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_INITIAL: tl.constexpr, HAS_STARTS: tl.constexpr,
    HAS_FINAL_GRAD: tl.constexpr, SEGMENTED: tl.constexpr, VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):
    """Forward sweep over one segment for a block of key channels (all value channels) with S over earlier chunks,
    from the state the forward's main pass started it from: dq, and ``q·dq`` without its diagonal term per token,
    into ``qdq`` ``[key blocks, tokens, H]``. HAS_FINAL_GRAD, in the segment that ends its document: also
    ``exp(b_L) ⟨S, dS_T⟩`` with S entering the last chunk (these key channels' part), into ``last_in``
    ``[key blocks, documents × H]``."""
    i_k, i_nh, slot_row, origin, length, first, stop = _segment_program(cu_seqlens, table, T, H, VARLEN, SEGMENTED)
    q, k, dq = q + origin * DK, k + origin * DK, dq + origin * DK
    v, do = v + origin * DV, do + origin * DV
    g += origin
    qdq += i_k.to(tl.int64) * block_stride + origin
    ck, cv = i_k * BK + tl.arange(0, BK), tl.arange(0, BV)

    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_INITIAL or HAS_STARTS:
        S += _load_state(s_0, s_in, i_nh, slot_row, DK * DV, ck[:, None] * DV + cv[None, :],
                         (ck < DK)[:, None] & (cv < DV)[None, :], HAS_INITIAL, HAS_STARTS)

    last = (tl.cdiv(length, BT) - 1) * BT  # the last chunk's start
    if SEGMENTED:
        ends = stop == length  # the segment holds its document's last chunk
        end = tl.where(ends, last, stop) if HAS_FINAL_GRAD else stop
    else:  # (as plainly as before: the compiler spills more otherwise)
        ends = length > 0
        end = last if HAS_FINAL_GRAD else length
    for start in range(first, end, BT):
        S = _dq_step(q, k, v, g, do, dq, qdq, S, start, length, i_k * BK, H, DK, DV, BT, BK, BV, PRECISION)
    if HAS_FINAL_GRAD:
        if ends:  # the last chunk apart: S enters it
            _, b_last = _chunk_decay(g, last, length, H, BT)
            dS_T = tl.load(ds_in + i_nh * DK * DV + ck[:, None] * DV + cv[None, :],
                           mask=(ck < DK)[:, None] & (cv < DV)[None, :], other=0.0)
            tl.store(last_in + i_k * documents_heads + i_nh, tl.sum(tl.sum(S * dS_T, 1), 0) * tl.exp(b_last))
            _dq_step(q, k, v, g, do, dq, qdq, S, last, length, i_k * BK, H, DK, DV, BT, BK, BV, PRECISION)


@triton.jit
def _dq_step(q, k, v, g, do, dq, qdq, S, start, length, k0, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
             BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr):
    """One chunk of ``_backward_dq_kernel``'s sweep: writes its dq and ``q·dq``, returns the state leaving it."""
    rows = tl.arange(0, BT)
    dtype = q.dtype.element_ty
    b, b_last = _chunk_decay(g, start, length, H, BT)
    do_c = _load(do, length, DV, start, 0, H, BT, BV)
    v_c = _load(v, length, DV, start, 0, H, BT, BV)
    scores = _mm(do_c, tl.trans(v_c), None, PRECISION)
    diagonal = tl.sum(tl.where(rows[:, None] == rows[None, :], scores, 0.0), 1)
    dq_c = _mm(do_c, tl.trans(S.to(dtype)), None, PRECISION) * tl.exp(b)[:, None]
    k_c = _load(k, length, DK, start, k0, H, BT, BK)
    dq_c = _mm((scores * _decay_matrix(b, BT, True)).to(dtype), k_c, dq_c, PRECISION)
    q_c = _load(q, length, DK, start, k0, H, BT, BK)  # (tiles loaded where first used: fewer spills)
    tl.store(qdq + (start + rows) * H, tl.sum(q_c.to(tl.float32) * dq_c, 1), mask=start + rows < length)
    _store(dq, dq_c + diagonal[:, None] * k_c.to(tl.float32), length, DK, start, k0, H, BT, BK)
    k_end = (k_c.to(tl.float32) * tl.exp(b_last - b)[:, None]).to(dtype)
    return _mm(tl.trans(k_end), v_c, S * tl.exp(b_last), PRECISION)


@triton.jit
def _backward_dk_dv_kernel(
    q, k, v, g, do, dk, dv, dg, ds_0, ds_in, last_in, ds_out, later_out, cu_seqlens, table, block_stride,
    later_stride, documents_heads, T, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FOR_DK: tl.constexpr, SUMS: tl.constexpr,
    HAS_FINAL_GRAD: tl.constexpr, HAS_STARTS: tl.constexpr, OUT: tl.constexpr, SEGMENTED: tl.constexpr,
    VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):
    """Reverse sweep over dS, the gradient of the state leaving each chunk, from the final state's gradient.

    FOR_DK: a block of key channels, all value channels: dk, and dg's part from these key channels, the reverse sum
    over the document of ``q·dq − k·dk`` (``dg`` holds the dq sweep's ``q·dq`` and is overwritten). In the last
    chunk dS is dS_T alone, and the final state's terms are summed the other way round: ``⟨S_T, dS_T⟩`` less the
    chunk's ``x_j = k_j·(exp(b_L − b_j) dS_T v_j)`` from j = s on is ``exp(b_L)⟨S_in, dS_T⟩`` (``last_in``, from the
    dq sweep) plus x_j before s, terms that all shrink with the decay rather than cancel.
    Otherwise a block of value channels, all key channels: dv.

    Over one segment, from the gradient at its end: the final state's ``ds_0`` in the segment that ends its document
    and has no slot (HAS_FINAL_GRAD), else its slot's ``ds_in`` (HAS_STARTS; the running sum's). OUT
    (``_store_state``) writes dS as it stands before the segment: the initial state's gradient (OUT 1), or with SUMS
    (only dS, from zero: the sums pass) a segment's own (OUT 2). A segment's dg holds only its own and later
    tokens' ``∂L/∂G``: FOR_DK with a slot writes their sum to ``later_out`` ``[key blocks, slots, H]`` (block
    ``later_stride`` apart), and the
    earlier segments get it added afterwards (``_add_later_kernel``)."""
    i_b, i_nh, slot_row, origin, length, first, stop = _segment_program(cu_seqlens, table, T, H, VARLEN, SEGMENTED)
    q, k, dk = q + origin * DK, k + origin * DK, dk + origin * DK
    v, do, dv = v + origin * DV, do + origin * DV, dv + origin * DV
    g += origin
    dg += i_b.to(tl.int64) * block_stride + origin
    k0 = i_b * BK if FOR_DK else 0
    v0 = 0 if FOR_DK else i_b * BV
    ck, cv = k0 + tl.arange(0, BK), v0 + tl.arange(0, BV)

    state_offs, state_mask = ck[:, None] * DV + cv[None, :], (ck < DK)[:, None] & (cv < DV)[None, :]
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    later = tl.zeros([], dtype=tl.float32)  # Σ ∂L/∂G over the tokens after the chunk (these key channels' part)
    if HAS_FINAL_GRAD or HAS_STARTS:
        dS += _load_state(ds_0, ds_in, i_nh, slot_row, DK * DV, state_offs, state_mask, HAS_FINAL_GRAD, HAS_STARTS)
    num_chunks = tl.cdiv(stop - first, BT)
    ends = stop == length if SEGMENTED else num_chunks > 0  # the segment holds its document's last chunk
    if FOR_DK and HAS_FINAL_GRAD:
        if SEGMENTED:
            later += tl.where(ends, tl.load(last_in + i_b * documents_heads + i_nh), 0.0)
        else:
            later += tl.load(last_in + i_b * documents_heads + i_nh)

    if SUMS:
        for i in range(num_chunks):
            start = first + (num_chunks - 1 - i) * BT
            b, b_last = _chunk_decay(g, start, length, H, BT)
            dS = _carry(dS, _load(q, length, DK, start, k0, H, BT, BK), _load(do, length, DV, start, v0, H, BT, BV),
                        b, b_last, PRECISION)
    else:
        skip = 0
        # the last chunk apart, where dS is dS_T alone (without dS_T, x = 0 and it is like the others)
        if FOR_DK and HAS_FINAL_GRAD:
            if ends:
                dS, later = _reverse_step(q, k, v, do, dk, dv, dg, g, dS, later, first + (num_chunks - 1) * BT,
                                          length, k0, v0, H, DK, DV, BT, BK, BV, FOR_DK, True, PRECISION)
            skip = ends.to(tl.int32)
        for i in range(skip, num_chunks):
            dS, later = _reverse_step(q, k, v, do, dk, dv, dg, g, dS, later, first + (num_chunks - 1 - i) * BT,
                                      length, k0, v0, H, DK, DV, BT, BK, BV, FOR_DK, False, PRECISION)

    if OUT > 0:
        _store_state(ds_out, dS, i_nh, slot_row, DK * DV, state_offs, state_mask, OUT)
    if FOR_DK and SEGMENTED and not SUMS:
        _store_state(later_out + i_b * later_stride, later, i_nh, slot_row, 1, 0, True, 2)


@triton.jit
def _carry(dS, q_c, do_c, b, b_last, PRECISION: tl.constexpr):
    """The gradient of the state entering a chunk from that of the state leaving it:
    ``exp(b_L) dS + (exp(b) ⊙ q)ᵀ dO``."""
    q_start = (q_c.to(tl.float32) * tl.exp(b)[:, None]).to(q_c.dtype)
    return _mm(tl.trans(q_start), do_c, dS * tl.exp(b_last), PRECISION)


@triton.jit
def _add_later_kernel(dg, offsets, cu_seqlens, table, T, H: tl.constexpr, BT: tl.constexpr, VARLEN: tl.constexpr):
    """For one cut segment and head: adds the sum of ∂L/∂G over its document's later segments (``offsets``
    [slots, H]) to dg ``[tokens, H]`` over its tokens, which the sweep summed within the segment only."""
    _, _, slot_row, origin, length, first, stop = _segment_program(cu_seqlens, table, T, H, VARLEN, True)
    offset = tl.load(offsets + slot_row)
    rows = tl.arange(0, BT)
    for start in range(first, stop, BT):
        at, inside = dg + origin + (start + rows) * H, start + rows < stop
        tl.store(at, tl.load(at, mask=inside, other=0.0) + offset, mask=inside)


@triton.jit
def _reverse_step(q, k, v, do, dk, dv, dg, g, dS, later, start, length, k0, v0, H: tl.constexpr, DK: tl.constexpr,
                  DV: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FOR_DK: tl.constexpr,
                  LAST: tl.constexpr, PRECISION: tl.constexpr):
    """One chunk of ``_backward_dk_dv_kernel``'s sweep (LAST: its document's last chunk): returns dS and ``later``
    as they stand before the chunk."""
    rows = tl.arange(0, BT)
    mt = start + rows < length
    dtype = q.dtype.element_ty
    b, b_last = _chunk_decay(g, start, length, H, BT)
    q_c = _load(q, length, DK, start, k0, H, BT, BK)
    do_c = _load(do, length, DV, start, v0, H, BT, BV)
    if FOR_DK:
        v_c = _load(v, length, DV, start, 0, H, BT, BV)
        scores = _mm(do_c, tl.trans(v_c), None, PRECISION)
        diagonal = tl.sum(tl.where(rows[:, None] == rows[None, :], scores, 0.0), 1)
        dA = (scores * _decay_matrix(b, BT, True)).to(dtype)
        dk_c = _mm(v_c, tl.trans(dS.to(dtype)), None, PRECISION) * tl.exp(b_last - b)[:, None]
        qdq = tl.load(dg + (start + rows) * H, mask=mt, other=0.0)
        k_c = _load(k, length, DK, start, k0, H, BT, BK)  # (loaded where first used: fewer spills)
        if LAST:  # x_j, the state's terms, apart from the rest
            x = tl.sum(k_c.to(tl.float32) * dk_c, 1)
            own = _mm(tl.trans(dA), q_c, None, PRECISION)
            dG = qdq - tl.sum(k_c.to(tl.float32) * own, 1)
            before = tl.sum(tl.where(rows[None, :] < rows[:, None], x[None, :], 0.0), 1)
            tl.store(dg + (start + rows) * H, later + before + tl.cumsum(dG, 0, reverse=True), mask=mt)
            dk_c += own
        else:
            dk_c = _mm(tl.trans(dA), q_c, dk_c, PRECISION)
            dG = qdq - tl.sum(k_c.to(tl.float32) * dk_c, 1)
            tl.store(dg + (start + rows) * H, later + tl.cumsum(dG, 0, reverse=True), mask=mt)
        later += tl.sum(dG, 0)
        _store(dk, dk_c + diagonal[:, None] * q_c.to(tl.float32), length, DK, start, k0, H, BT, BK)
    else:
        k_c = _load(k, length, DK, start, 0, H, BT, BK)
        dv_c = _mm(k_c, dS.to(dtype), None, PRECISION) * tl.exp(b_last - b)[:, None]
        A = _mm(q_c, tl.trans(k_c), None, PRECISION) * _decay_matrix(b, BT, False)
        dv_c = _mm(tl.trans(A.to(dtype)), do_c, dv_c, PRECISION)
        _store(dv, dv_c, length, DV, start, v0, H, BT, BV)
    return _carry(dS, q_c, do_c, b, b_last, PRECISION), later


# ---------------------------------------------------------------------------------------------------------
# Host side: the autograd function over the sweeps, and the op's entry.

class _DecayedLinearAttention(torch.autograd.Function):
    """``(o, S_T)`` of the unnormalized op from q, k, v (input dtype), g ``[B, T, H]`` and S_0 (fp32); o in
    ``out_dtype`` (the input dtype, or fp32 where a quotient follows)."""

    @staticmethod
    def forward(ctx, q, k, v, g, S_0, cu_seqlens, chunk_size, out_dtype):
        q, k, v, g = q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous()
        geo = _Launch(q, v, cu_seqlens, chunk_size)
        geo.segment(causal=True)
        o = torch.empty_like(v, dtype=out_dtype)
        S_T = geo.states(fields="S")[0]

        def forward(rows, *, store_o, by_slot=None, out, decays=None):  # (S_T stands in for absent fp32 buffers)
            _forward_kernel[(rows, geo.NV)](
                q, k, v, g, o, S_T if S_0 is None else S_0, S_T if by_slot is None else by_slot, out,
                S_T if decays is None else decays, cu_seqlens, HAS_INITIAL=S_0 is not None,
                HAS_STARTS=by_slot is not None, STORE_O=store_o, OUT=1 if decays is None else 2, BK=geo.BK_full,
                BV=geo.BV_split, **geo.segmented())

        if geo.pairs is None:
            forward(geo.rows, store_o=True, out=S_T)
        else:  # the cut documents' segments' own states and log-decays, a running sum with decay, then o
            parts = geo.states(fields="S", slots=True)[0]
            decays = torch.empty(geo.slots, geo.H, dtype=torch.float32, device=q.device)
            forward(geo.slotted_rows, store_o=False, out=parts, decays=decays)
            (starts,) = _combine(geo, (parts,), None if S_0 is None else (S_0,), (S_T,), "forward", decays)
            forward(geo.rows, store_o=True, by_slot=starts, out=S_T)
        ctx.save_for_backward(q, k, v, g, S_0, *((starts, decays) if geo.pairs is not None else ()))
        ctx.geo = geo
        ctx.set_materialize_grads(False)  # an unused final state's gradient stays None: no dS_T terms to run
        return o, S_T

    @staticmethod
    def backward(ctx, do, dS_T):
        q, k, v, g, S_0, *segments = ctx.saved_tensors
        starts, decays = segments or (None, None)
        geo, dev = ctx.geo, q.device
        do = torch.zeros_like(v, dtype=q.dtype) if do is None else do.to(q.dtype).contiguous()
        split_k = dict(BK=geo.BK_split, BV=geo.BV_full)  # dq, dk: a block of key channels, every value channel
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dg = torch.empty(geo.NK, geo.tokens, geo.H, dtype=torch.float32, device=dev)  # per key block, then summed
        has_final_grad = dS_T is not None
        dS_T = dS_T.float().contiguous() if has_final_grad else dg
        last = torch.empty(geo.NK, geo.N * geo.H, dtype=torch.float32, device=dev)  # exp(b_L)⟨S_in, dS_T⟩
        _backward_dq_kernel[(geo.rows, geo.NK)](
            q, k, v, g, do, dq, dg, dg if S_0 is None else S_0, dg if starts is None else starts, dS_T, last,
            geo.cu_seqlens, block_stride=dg.stride(0), documents_heads=geo.N * geo.H, HAS_INITIAL=S_0 is not None,
            HAS_STARTS=starts is not None, HAS_FINAL_GRAD=has_final_grad, **split_k, **geo.segmented())
        want_d_initial = S_0 is not None and ctx.needs_input_grad[4]
        dS_0 = geo.states(fields="S")[0] if want_d_initial else None
        later = None if starts is None else torch.empty(geo.NK, geo.slots, geo.H, dtype=torch.float32, device=dev)

        def sweep(rows, *, for_dk, sums=False, d_slot=None, out=None):  # (dg stands in for absent fp32 buffers)
            _backward_dk_dv_kernel[(rows, geo.NK if for_dk else geo.NV)](
                q, k, v, g, do, dk, dv, dg, dS_T, dg if d_slot is None else d_slot, last, dg if out is None else out,
                dg if later is None else later, geo.cu_seqlens, block_stride=dg.stride(0),
                later_stride=0 if later is None else later.stride(0), documents_heads=geo.N * geo.H, FOR_DK=for_dk,
                SUMS=sums, HAS_FINAL_GRAD=has_final_grad and not sums, HAS_STARTS=d_slot is not None,
                OUT=0 if out is None else 2 if sums else 1,
                **(split_k if for_dk else dict(BK=geo.BK_full, BV=geo.BV_split)), **geo.segmented())

        d_starts = None
        if starts is not None:  # each cut segment's own dS from zero, a running sum backwards with decay, the sweeps
            parts = geo.states(fields="S", slots=True)[0]
            sweep(geo.slotted_rows, for_dk=True, sums=True, out=parts)
            (d_starts,) = _combine(geo, (parts,), (dS_T,) if has_final_grad else None,
                                   (dS_0,) if want_d_initial else None, "reverse", decays)
        sweep(geo.rows, for_dk=True, d_slot=d_starts, out=dS_0)
        sweep(geo.rows, for_dk=False, d_slot=d_starts)
        dg = dg.sum(0)
        if starts is not None:  # each cut segment's dg, so far within the segment, gets the later segments' sum
            (offsets,) = _combine(geo, (later.sum(0),), None, None, "reverse")
            _add_later_kernel[(geo.slotted_rows,)](dg, offsets, geo.cu_seqlens, geo.pairs, geo.T, geo.H, geo.BT,
                                                   VARLEN=geo.cu_seqlens is not None)
        return dq, dk, dv, dg.view(g.shape), dS_0, None, None, None


def decayed_linear_attention_triton(q, k, v, g, *, normalize, eps, cu_seqlens, initial_state, output_final_state,
                                    chunk_size):
    """``decayed_linear_attention(..., impl="triton")``: same arguments (already checked there; g ``[B, T, H]``) and
    results. Divisive runs the kernels on v with a column of ones, whose output is the denominator."""
    cu_seqlens = kernel_offsets(q, cu_seqlens)
    S_0 = None if initial_state is None else initial_state.S.float()
    divisive = normalize == "divisive"
    if divisive:
        v = torch.cat([v, v.new_ones(*v.shape[:3], 1)], dim=-1)
        S_0 = None if S_0 is None else torch.cat([S_0, initial_state.z.float()[..., None]], dim=-1)
    o, S_T = _DecayedLinearAttention.apply(q, k, v, g.float(), S_0, cu_seqlens, chunk_size,
                                           torch.float32 if divisive else q.dtype)
    final = LinearAttentionState(S_T)
    if divisive:
        o = _Quotient.apply(o[..., :-1], o[..., -1:] + eps).to(q.dtype)
        final = LinearAttentionState(S_T[..., :-1], S_T[..., -1])
    return (o, final) if output_final_state else o
