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

Segments. The forward cuts long documents as the undecayed kernels do (their rule and table): a sums pass writes each
segment's own state from zero and its log-decay ``Σ g``, a running sum over each document's segments gives each the
state it starts from, ``S ← e^{Σ g} S + part`` (fla's ``chunk_fwd_kernel_h_reduction`` idea), and the main pass runs
one program per segment or uncut document. The backward's sweeps keep one program per document (its ``Σ_{t≥s}`` of
dg would need each segment's later sum added afterwards).

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
    _program,
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
    q, k, v, g, do, dq, qdq, s_in, ds_in, last_in, cu_seqlens, block_stride,
    T, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_INITIAL: tl.constexpr, HAS_FINAL_GRAD: tl.constexpr, VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):
    """Forward sweep for a block of key channels (all value channels) with S over earlier chunks: dq, and
    ``q·dq`` without its diagonal term per token, into ``qdq`` ``[key blocks, tokens, H]``. HAS_FINAL_GRAD: also
    ``exp(b_L) ⟨S, dS_T⟩`` with S entering the last chunk (these key channels' part), into ``last_in``."""
    i_k, i_nh, origin, length = _program(cu_seqlens, T, H, VARLEN)
    q, k, dq = q + origin * DK, k + origin * DK, dq + origin * DK
    v, do = v + origin * DV, do + origin * DV
    g += origin
    qdq += i_k.to(tl.int64) * block_stride + origin
    ck, cv = i_k * BK + tl.arange(0, BK), tl.arange(0, BV)

    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_INITIAL:
        S += tl.load(s_in + i_nh.to(tl.int64) * DK * DV + ck[:, None] * DV + cv[None, :],
                     mask=(ck < DK)[:, None] & (cv < DV)[None, :], other=0.0)

    last = (tl.cdiv(length, BT) - 1) * BT  # the last chunk's start
    for start in range(0, last if HAS_FINAL_GRAD else length, BT):
        S = _dq_step(q, k, v, g, do, dq, qdq, S, start, length, i_k * BK, H, DK, DV, BT, BK, BV, PRECISION)
    if HAS_FINAL_GRAD and length > 0:  # the last chunk apart: S enters it
        start = last
        _, b_last = _chunk_decay(g, start, length, H, BT)
        dS_T = tl.load(ds_in + i_nh.to(tl.int64) * DK * DV + ck[:, None] * DV + cv[None, :],
                       mask=(ck < DK)[:, None] & (cv < DV)[None, :], other=0.0)
        tl.store(last_in + i_k * tl.num_programs(0) + i_nh, tl.sum(tl.sum(S * dS_T, 1), 0) * tl.exp(b_last))
        _dq_step(q, k, v, g, do, dq, qdq, S, start, length, i_k * BK, H, DK, DV, BT, BK, BV, PRECISION)


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
    q, k, v, g, do, dk, dv, dg, ds_in, last_in, ds_out, cu_seqlens, block_stride,
    T, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FOR_DK: tl.constexpr,
    HAS_FINAL_GRAD: tl.constexpr, STORE_DS: tl.constexpr, VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):
    """Reverse sweep over dS, the gradient of the state leaving each chunk, from the final state's gradient.

    FOR_DK: a block of key channels, all value channels: dk, and dg's part from these key channels, the reverse sum
    over the document of ``q·dq − k·dk`` (``dg`` holds the dq sweep's ``q·dq`` and is overwritten). In the last
    chunk dS is dS_T alone, and the final state's terms are summed the other way round: ``⟨S_T, dS_T⟩`` less the
    chunk's ``x_j = k_j·(exp(b_L − b_j) dS_T v_j)`` from j = s on is ``exp(b_L)⟨S_in, dS_T⟩`` (``last_in``, from the
    dq sweep) plus x_j before s, terms that all shrink with the decay rather than cancel.
    Otherwise a block of value channels, all key channels: dv.
    STORE_DS writes dS as it stands before the first token: the initial state's gradient."""
    i_b, i_nh, origin, length = _program(cu_seqlens, T, H, VARLEN)
    q, k, dk = q + origin * DK, k + origin * DK, dk + origin * DK
    v, do, dv = v + origin * DV, do + origin * DV, dv + origin * DV
    g += origin
    dg += i_b.to(tl.int64) * block_stride + origin
    k0 = i_b * BK if FOR_DK else 0
    v0 = 0 if FOR_DK else i_b * BV
    ck, cv = k0 + tl.arange(0, BK), v0 + tl.arange(0, BV)

    state_offs = i_nh.to(tl.int64) * DK * DV + ck[:, None] * DV + cv[None, :]
    state_mask = (ck < DK)[:, None] & (cv < DV)[None, :]
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    later = tl.zeros([], dtype=tl.float32)  # Σ ∂L/∂G over the tokens after the chunk (these key channels' part)
    if HAS_FINAL_GRAD:
        dS += tl.load(ds_in + state_offs, mask=state_mask, other=0.0)
        if FOR_DK:
            later += tl.load(last_in + i_b * tl.num_programs(0) + i_nh)

    num_chunks = tl.cdiv(length, BT)
    # the last chunk apart, where dS is dS_T alone (without dS_T, x = 0 and it is like the others)
    if FOR_DK and HAS_FINAL_GRAD and num_chunks > 0:
        dS, later = _reverse_step(q, k, v, do, dk, dv, dg, g, dS, later, (num_chunks - 1) * BT, length, k0, v0, H,
                                  DK, DV, BT, BK, BV, FOR_DK, True, PRECISION)
    for i in range(1 if FOR_DK and HAS_FINAL_GRAD else 0, num_chunks):
        dS, later = _reverse_step(q, k, v, do, dk, dv, dg, g, dS, later, (num_chunks - 1 - i) * BT, length, k0, v0,
                                  H, DK, DV, BT, BK, BV, FOR_DK, False, PRECISION)

    if STORE_DS:
        tl.store(ds_out + state_offs, dS, mask=state_mask)


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
    q_start = (q_c.to(tl.float32) * tl.exp(b)[:, None]).to(dtype)
    return _mm(tl.trans(q_start), do_c, dS * tl.exp(b_last), PRECISION), later


# ---------------------------------------------------------------------------------------------------------
# Host side: the autograd function over the sweeps, and the op's entry.

class _DecayedLinearAttention(torch.autograd.Function):
    """``(o, S_T)`` of the unnormalized op from q, k, v (input dtype), g ``[B, T, H]`` and S_0 (fp32); o in
    ``out_dtype`` (the input dtype, or fp32 where a quotient follows)."""

    @staticmethod
    def forward(ctx, q, k, v, g, S_0, cu_seqlens, chunk_size, out_dtype):
        q, k, v, g = q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous()
        geo = _Launch(q, v, cu_seqlens, chunk_size)
        geo.segment(causal=True)  # the forward only: the backward's sweeps keep one program per document
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
        ctx.save_for_backward(q, k, v, g, S_0)
        ctx.geo = geo
        ctx.set_materialize_grads(False)  # an unused final state's gradient stays None: no dS_T terms to run
        return o, S_T

    @staticmethod
    def backward(ctx, do, dS_T):
        q, k, v, g, S_0 = ctx.saved_tensors
        geo, dev = ctx.geo, q.device
        do = torch.zeros_like(v, dtype=q.dtype) if do is None else do.to(q.dtype).contiguous()
        split_k = dict(BK=geo.BK_split, BV=geo.BV_full)  # dq, dk: a block of key channels, every value channel
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dg = torch.empty(geo.NK, geo.tokens, geo.H, dtype=torch.float32, device=dev)  # per key block, then summed
        has_final_grad = dS_T is not None
        dS_T = dS_T.float().contiguous() if has_final_grad else dg
        last = torch.empty(geo.NK, geo.N * geo.H, dtype=torch.float32, device=dev)  # exp(b_L)⟨S_in, dS_T⟩
        _backward_dq_kernel[(geo.N * geo.H, geo.NK)](
            q, k, v, g, do, dq, dg, q if S_0 is None else S_0, dS_T, last, geo.cu_seqlens, dg.stride(0),
            HAS_INITIAL=S_0 is not None, HAS_FINAL_GRAD=has_final_grad, **split_k, **geo.common())
        want_d_initial = S_0 is not None and ctx.needs_input_grad[4]
        dS_0 = geo.states(fields="S")[0] if want_d_initial else dg
        for for_dk in (True, False):
            _backward_dk_dv_kernel[(geo.N * geo.H, geo.NK if for_dk else geo.NV)](
                q, k, v, g, do, dk, dv, dg, dS_T, last, dS_0, geo.cu_seqlens, dg.stride(0), FOR_DK=for_dk,
                HAS_FINAL_GRAD=has_final_grad, STORE_DS=want_d_initial and for_dk,
                **(split_k if for_dk else dict(BK=geo.BK_full, BV=geo.BV_split)), **geo.common())
        dg = dg.sum(0).view(g.shape)
        return dq, dk, dv, dg, dS_0 if want_d_initial else None, None, None, None


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
