"""The gated delta rule's chunked form with its per-chunk and sequential parts in Triton (docs/MIXERS.md#deltanet,
"Triton form").

The WY/UT chunked form of ``chunk.py``, split much as flash-linear-attention splits it, every block of chunks one
autograd Function (``_Block``) whose forward and backward are kernels and a few batched ops:
- the UT transform, one program per (chunk, head): ``A = (I + strictly_lower(β Γ ⊙ K Kᵀ))⁻¹`` by forward
  substitution, ``W = A (β e^D K)``, ``U = A (β V)``; backward, with ``X = β e^D K``, ``Y = β V``:
  ``dX = Aᵀ dW``, ``dY = Aᵀ dU``, ``dA = dW Xᵀ + dU Yᵀ`` and through the inverse ``dM = −Aᵀ dA Aᵀ`` (strictly
  lower), whence dK, dβ and the log-gate's gradient;
- the scan over chunks, one program per (document, head, block of value channels):

    forward, chunk after chunk:   Δ = U − W S,   O = (Q ⊙ e^D) S + (Q Kᵀ ⊙ Γ) Δ,   S ← e^{D_C} S + (K ⊙ e^{D_C − D})ᵀ Δ
    backward, in reverse, G the gradient of the state leaving the chunk:
        dΔ = dΔ_out + (K ⊙ e^{D_C − D}) G,   G ← dS_out + e^{D_C} G − Wᵀ dΔ

  (forward keeps each chunk's state and Δ in registers; backward's scan forward, without O, writes them);
- the output stage's adjoint, one program per (chunk, head), from dO and the chunk's state S and Δ:
  ``dS_out = (Q ⊙ e^D)ᵀ dO``, ``dΔ_out = (Q Kᵀ ⊙ Γ)ᵀ dO``, dQ, the Q Kᵀ part of dK and of D's gradient;
- what each chunk gets through the state, one program per (chunk, head), after the reverse scan:
  ``dW = −dΔ Sᵀ`` (and ``dU = dΔ``), ``d(K ⊙ e^{D_C − D}) = Δ Gᵀ``, ``d e^{D_C} = Σ S ⊙ G``;
then the UT transform's gradient, and the gradients of D, of ``D_C − D`` and of ``D_C`` gathered into g's
(cumulative sums over the chunk, batched).

Chunks start at each document's first token (packed documents are sequences of their own, as in the linear
attention kernels): a document's last chunk is padded with tokens of β = 0, g = 0, k = q = v = 0, which write
nothing, so no chunk holds two documents and the scan needs no masks. One program owns a (document, head, block
of value channels) and carries its fp32 state ``[Dk, block]`` in registers; the scan's columns are independent.

Memory and time: the chunks are walked in blocks (``BLOCK_ELEMENTS``); a block's Function keeps only its inputs
(the caller's token rows, and the state each document starts from), and its backward recomputes A, W, U, the
per-chunk states (``Dk × Dv`` per chunk and head, fp32) and Δ, which then exist for one block at a time (fla also
recomputes W, U and the states; it keeps A). Keeping them from the forward instead would skip two kernels (the UT
transform and a scan) in backward, but hold A, W, the states and Δ in every layer until its backward: 2.3 KB per
token and head at C = 64, Dk = Dv = 128, 3× the bf16 inputs, ≈ 10 GB a layer at B = 8, 16k, 32 heads. So
backward's peak stays that of ``chunk.py``. O is never recomputed (backward does not need it), and no autograd graph is
recorded inside a block. A block hands the state of the document running past its end to the next. Under
``TRITON_INTERPRET=1`` the kernels run on CPU; the tests hold them to ``chunk``.
"""
import bisect
import os
from functools import partial
from itertools import chain

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..documents import OffsetsMemo
from ..linear_attention.triton import _mm
from ..precision import dot_precision
from ..recompute import bounded_blocks, in_blocks

MAX_HEAD_DIM = 256  # the state block (Dk × value block, fp32) lives in registers
# Launch settings of the scans, from the compiler's resource report for sm_90 (`tools/triton_resource_report.py --op
# delta_rule`; C = 64, Dk = Dv = 128, TF32 products; no GPU timed yet): blocks of 32 value channels with 4 warps
# spill in none (the fused forward scan 221 registers; at 8 warps it spills 0.5 KB a thread, at blocks of 64 0.2;
# blocks of 16 spill in none either, 198).
# One stage: the fused scan reads four C × Dk fp32 tiles a chunk (W, Q, K twice), 295 KB of shared memory when
# double-buffered, over the 227 KB a block may have.
CONFIG = dict(value_block=32, num_warps=4, num_stages=1)
# The kernels with one program per chunk and head (the UT transform and its gradient, the output adjoint, the state
# gradients; the UT backward in blocks of ``channel_block`` key or value channels): with 8 warps none spills (the UT
# backward 198 registers, the output adjoint 234; the UT backward in blocks of 64 spills 64 B a thread), nor with 2
# stages. With 4 warps the output adjoint and the state gradients spill (0.4 KB and 72 B).
UT_CONFIG = dict(channel_block=32, num_warps=8, num_stages=1)
# Chunks are walked in blocks whose C×C and C×width temporaries hold about this many numbers each (128 MiB in fp32;
# 128 chunks of 64 at 32 heads of 128): each block is recomputed on its own in backward, which bounds backward's
# peak (a few GB), while the blocks stay few enough that launches do not dominate. Not yet tuned on a GPU.
BLOCK_ELEMENTS = 1 << 25


@triton.jit
def _tile_offsets(tile, ROWS: tl.constexpr, WIDTH: tl.constexpr, col, BR: tl.constexpr, BW: tl.constexpr):
    """Offsets and mask of rows [0, ROWS) × columns [col, col + BW) of tile ``tile`` of a [tiles, ROWS, WIDTH]
    tensor (a chunk's rows of one head, or a state)."""
    r = tl.arange(0, BR)
    c = col + tl.arange(0, BW)
    offsets = tile * (ROWS * WIDTH) + r[:, None] * WIDTH + c[None, :]
    return offsets, (r < ROWS)[:, None] & (c < WIDTH)[None, :]


@triton.jit
def _scan_program(first_chunk, initial, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr):
    """A forward scan program's head, its document's chunks [c0, c1), its first value channel, its state block's
    offsets and mask, and that block of the state it starts from."""
    i_nh, i_v = tl.program_id(0), tl.program_id(1)  # (document, head) first: CUDA caps the grid's y at 65535
    i_n, i_h = i_nh // H, i_nh % H
    c0, c1 = tl.load(first_chunk + i_n), tl.load(first_chunk + i_n + 1)
    v0 = i_v * BV
    state_at, state_mask = _tile_offsets(i_nh.to(tl.int64), DK, DV, v0, BK, BV)
    return i_h, c0, c1, v0, state_at, state_mask, tl.load(initial + state_at, mask=state_mask, other=0.0)


@triton.jit
def _handing_factors(k, after, tile, C: tl.constexpr, DK: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    """One chunk's K ``[BC, BK]`` and ``e^{D_C − D}`` per row, from ``after``: D_C − D as a sum of the later gates
    (0 for the last token). The state takes ``(K ⊙ e^{D_C − D})ᵀ Δ`` from the chunk."""
    rows = tl.arange(0, BC)
    at_k, mask_k = _tile_offsets(tile, C, DK, 0, BC, BK)
    K = tl.load(k + at_k, mask=mask_k, other=0.0)
    return K, tl.exp(tl.load(after + tile * C + rows, mask=rows < C, other=0.0))


@triton.jit
def _scan_forward_kernel(
    w, u, k, after, decay, initial, states, delta, first_chunk,
    H: tl.constexpr, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    """Over the chunks of one document and head, from its state in ``initial``: write the state entering each
    chunk and Δ = U − W S per token (the final state is the forward's). ``decay`` is e^{D_C} per chunk and head. The
    gate scales Δ's rows, not K's (a C × block tile, not C × Dk: fewer registers)."""
    i_h, c0, c1, v0, _, _, S = _scan_program(first_chunk, initial, H, DK, DV, BK, BV)
    for c in range(c0, c1):
        tile = c * H + i_h  # int64: the offsets are loaded as such
        at, mask = _tile_offsets(tile, DK, DV, v0, BK, BV)
        tl.store(states + at, S, mask=mask)
        at_k, mask_k = _tile_offsets(tile, C, DK, 0, BC, BK)
        at_v, mask_v = _tile_offsets(tile, C, DV, v0, BC, BV)
        d = tl.load(u + at_v, mask=mask_v, other=0.0) - _mm(tl.load(w + at_k, mask=mask_k, other=0.0), S, None,
                                                             PRECISION)
        tl.store(delta + at_v, d, mask=mask_v)
        K, e_after = _handing_factors(k, after, tile, C, DK, BC, BK)
        S = _mm(tl.trans(K), d * e_after[:, None], S * tl.load(decay + tile), PRECISION)


@triton.jit
def _scan_backward_kernel(
    w, k, after, decay, d_states, d_delta, d_final, grad_after, delta_grad, d_initial, first_chunk,
    H: tl.constexpr, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_FINAL_GRAD: tl.constexpr, PRECISION: tl.constexpr,
):
    """The forward scan's adjoint, chunks in reverse: writes G (the gradient of the state leaving each chunk), the
    total gradient of Δ per token, and G before the first chunk (the initial state's gradient). The gate scales the
    rows of ``K G``, not K (as in the forward scan)."""
    i_nh, i_v = tl.program_id(0), tl.program_id(1)  # (document, head) first: CUDA caps the grid's y at 65535
    i_n, i_h = i_nh // H, i_nh % H
    c0, c1 = tl.load(first_chunk + i_n), tl.load(first_chunk + i_n + 1)
    v0 = i_v * BV
    state_at, state_mask = _tile_offsets(i_nh.to(tl.int64), DK, DV, v0, BK, BV)
    G = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_FINAL_GRAD:
        G += tl.load(d_final + state_at, mask=state_mask, other=0.0)
    for i in range(c1 - c0):
        tile = (c1 - 1 - i) * H + i_h
        at, mask = _tile_offsets(tile, DK, DV, v0, BK, BV)
        tl.store(grad_after + at, G, mask=mask)
        at_k, mask_k = _tile_offsets(tile, C, DK, 0, BC, BK)
        at_v, mask_v = _tile_offsets(tile, C, DV, v0, BC, BV)
        K, e_after = _handing_factors(k, after, tile, C, DK, BC, BK)
        dd = _mm(K, G, None, PRECISION) * e_after[:, None] + tl.load(d_delta + at_v, mask=mask_v, other=0.0)
        tl.store(delta_grad + at_v, dd, mask=mask_v)
        W = tl.load(w + at_k, mask=mask_k, other=0.0)
        G = tl.load(d_states + at, mask=mask, other=0.0) + G * tl.load(decay + tile) \
            - _mm(tl.trans(W), dd, None, PRECISION)
    tl.store(d_initial + state_at, G, mask=state_mask)


@triton.jit
def _through_state(states, grad_after, delta, delta_grad, tile, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                   BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr):
    """Of one chunk and head, summed over value blocks: ``dΔ Sᵀ``, ``Δ Gᵀ`` (``[BC, BK]``) and ``Σ S ⊙ G`` per key
    channel (S the state entering the chunk, G the gradient of the state leaving it)."""
    d_w = tl.zeros([BC, BK], dtype=tl.float32)
    d_hands = tl.zeros([BC, BK], dtype=tl.float32)
    through_decay = tl.zeros([BK], dtype=tl.float32)
    for v0 in range(0, DV, BV):
        at, mask = _tile_offsets(tile, DK, DV, v0, BK, BV)
        at_v, mask_v = _tile_offsets(tile, C, DV, v0, BC, BV)
        S = tl.load(states + at, mask=mask, other=0.0)
        G = tl.load(grad_after + at, mask=mask, other=0.0)
        d_w = _mm(tl.load(delta_grad + at_v, mask=mask_v, other=0.0), tl.trans(S), d_w, PRECISION)
        d_hands = _mm(tl.load(delta + at_v, mask=mask_v, other=0.0), tl.trans(G), d_hands, PRECISION)
        through_decay += tl.sum(S * G, 1)
    return d_w, d_hands, through_decay


@triton.jit
def _state_grads_kernel(
    k, after, decay, states, grad_after, delta, delta_grad, dw, dk, d_after, d_last,
    C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    """What a chunk's inputs get through the state, per (chunk, head), from its entering state S, G (the gradient of
    the state leaving it), Δ and dΔ: ``dW = −dΔ Sᵀ``; ``d(K ⊙ e^{D_C − D}) = Δ Gᵀ``, whose K part it adds to ``dk``
    and whose e^{D_C − D} part it writes per row; and ``e^{D_C}``'s, ``Σ S ⊙ G``, times e^{D_C} (the gradient of the
    chunk's summed gate). dW and Δ Gᵀ sum over value blocks."""
    tile = tl.program_id(0).to(tl.int64)
    d_w, d_hands, through_decay = _through_state(states, grad_after, delta, delta_grad, tile, C, DK, DV, BC, BK, BV,
                                                 PRECISION)
    through_decay = tl.sum(through_decay)
    K, e_after = _handing_factors(k, after, tile, C, DK, BC, BK)
    at_k, mask_k = _tile_offsets(tile, C, DK, 0, BC, BK)
    tl.store(dw + at_k, -d_w, mask=mask_k)
    tl.store(dk + at_k, tl.load(dk + at_k, mask=mask_k, other=0.0) + d_hands * e_after[:, None], mask=mask_k)
    rows = tl.arange(0, BC)
    tl.store(d_after + tile * C + rows, tl.sum(d_hands * K, 1) * e_after, mask=rows < C)
    tl.store(d_last + tile, through_decay * tl.load(decay + tile))


@triton.jit
def _output_factors(q, k, log_decay, tile, C: tl.constexpr, DK: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                    PRECISION: tl.constexpr):
    """The output stage's factors of one chunk: Q, K ``[BC, BK]``, D (the log-gate summed from the chunk's start),
    Q Kᵀ and Γ, masked to the causal triangle of the chunk's rows before ``exp`` (no overflow; rows past C, whose D
    reads 0, get none either)."""
    rows = tl.arange(0, BC)
    at_k, mask_k = _tile_offsets(tile, C, DK, 0, BC, BK)
    Q = tl.load(q + at_k, mask=mask_k, other=0.0)
    K = tl.load(k + at_k, mask=mask_k, other=0.0)
    d = tl.load(log_decay + tile * C + rows, mask=rows < C, other=0.0)
    causal = (rows[:, None] >= rows[None, :]) & (rows < C)[:, None]
    gamma = tl.exp(tl.where(causal, d[:, None] - d[None, :], float("-inf")))
    return Q, K, d, _mm(Q, tl.trans(K), None, PRECISION), gamma


@triton.jit
def _scan_output_kernel(
    q, k, w, u, log_decay, initial, out, final, first_chunk,
    H: tl.constexpr, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    """The forward scan with the output stage inside: per chunk, from the state in registers, Δ = U − W S and
    O = (Q ⊙ e^D) S + (Q Kᵀ ⊙ Γ) Δ, then S ← e^{D_C} S + (K ⊙ e^{D_C − D})ᵀ Δ. Neither the per-chunk states nor Δ
    reach memory. ``log_decay`` is D, the log-gate summed from the chunk's start.

    Besides the state it holds C × block tiles (Δ, O) and C × C ones (Q Kᵀ, Γ), but no C × Dk tile of its own: the
    gates scale rows of the products, ``e^D ⊙ (Q S)`` and ``Kᵀ (e^{D_C − D} ⊙ Δ)``, not Q and K, so Q, K and W go
    from memory straight into products; K is read twice, as the first read's registers would otherwise live from
    Q Kᵀ to the state's update (with Q ⊙ e^D and K ⊙ e^{D_C − D} formed and K kept, it spilled 1 KB a thread)."""
    i_h, c0, c1, v0, state_at, state_mask, S = _scan_program(first_chunk, initial, H, DK, DV, BK, BV)
    for c in range(c0, c1):
        tile = c * H + i_h  # int64: the offsets are loaded as such
        at_k, mask_k = _tile_offsets(tile, C, DK, 0, BC, BK)
        at_v, mask_v = _tile_offsets(tile, C, DV, v0, BC, BV)
        delta = tl.load(u + at_v, mask=mask_v, other=0.0) - _mm(tl.load(w + at_k, mask=mask_k, other=0.0), S, None,
                                                                PRECISION)
        Q, K, d, QK, gamma = _output_factors(q, k, log_decay, tile, C, DK, BC, BK, PRECISION)
        d_last = tl.load(log_decay + tile * C + C - 1)
        o = _mm(QK * gamma, delta, _mm(Q, S, None, PRECISION) * tl.exp(d)[:, None], PRECISION)
        tl.store(out + at_v, o, mask=mask_v)
        K = tl.load(k + at_k, mask=mask_k, other=0.0)  # again: the first K's registers end with Q Kᵀ
        S = _mm(tl.trans(K), delta * tl.exp(d_last - d)[:, None], S * tl.exp(d_last), PRECISION)
    tl.store(final + state_at, S, mask=state_mask)


@triton.jit
def _output_backward_kernel(
    q, k, log_decay, states, delta, d_out, d_states, d_delta, dq, dk, dlog,
    C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    """The output stage's adjoint per (chunk, head), from dO and the chunk's entering state S and Δ, with
    P = Q Kᵀ ⊙ Γ: the gradients of S, ``Qᵀ (e^D ⊙ dO)``, and of Δ, ``Pᵀ dO`` (value block by value block, while
    dP = dO Δᵀ and dO Sᵀ sum over them), then dQ, the Q Kᵀ part of dK, and D's gradient through e^D and through Γ
    below the diagonal (its diagonal is the constant 1). The gate scales rows of dO and of dO Sᵀ (C × block and the
    one C × Dk sum), not a copy of Q: 254 registers a thread with ``Q ⊙ e^D`` held, 234 without."""
    tile = tl.program_id(0).to(tl.int64)
    Q, K, d, QK, gamma = _output_factors(q, k, log_decay, tile, C, DK, BC, BK, PRECISION)
    e_d = tl.exp(d)
    scores = QK * gamma
    d_scores = tl.zeros([BC, BC], dtype=tl.float32)
    d_QD = tl.zeros([BC, BK], dtype=tl.float32)  # dO Sᵀ: the gradient of Q ⊙ e^D
    for v0 in range(0, DV, BV):
        at, mask = _tile_offsets(tile, DK, DV, v0, BK, BV)
        at_v, mask_v = _tile_offsets(tile, C, DV, v0, BC, BV)
        dO = tl.load(d_out + at_v, mask=mask_v, other=0.0)
        tl.store(d_states + at, _mm(tl.trans(Q), dO * e_d[:, None], None, PRECISION), mask=mask)
        tl.store(d_delta + at_v, _mm(tl.trans(scores), dO, None, PRECISION), mask=mask_v)
        d_scores = _mm(dO, tl.trans(tl.load(delta + at_v, mask=mask_v, other=0.0)), d_scores, PRECISION)
        d_QD = _mm(dO, tl.trans(tl.load(states + at, mask=mask, other=0.0)), d_QD, PRECISION)
    dQK = d_scores * gamma
    at_k, mask_k = _tile_offsets(tile, C, DK, 0, BC, BK)
    tl.store(dq + at_k, _mm(dQK, K, d_QD * e_d[:, None], PRECISION), mask=mask_k)
    tl.store(dk + at_k, _mm(tl.trans(dQK), Q, None, PRECISION), mask=mask_k)
    rows = tl.arange(0, BC)
    weighted = tl.where(rows[:, None] > rows[None, :], dQK * QK, 0.0)  # dΓ ⊙ Γ below the diagonal
    dd = tl.sum(d_QD * Q, 1) * e_d + tl.sum(weighted, 1) - tl.sum(weighted, 0)
    tl.store(dlog + tile * C + rows, dd, mask=rows < C)


@triton.jit
def _chunk_factors(k, beta, log_decay, tile, C: tl.constexpr, DK: tl.constexpr, BC: tl.constexpr,
                   BK: tl.constexpr, PRECISION: tl.constexpr):
    """One chunk's K ``[BC, BK]``, β, D (the log-gate summed from the chunk's start), K Kᵀ, and Γ on the strictly
    lower triangle (0 elsewhere: the solve's matrix has no diagonal)."""
    rows = tl.arange(0, BC)
    at_k, mask_k = _tile_offsets(tile, C, DK, 0, BC, BK)
    K = tl.load(k + at_k, mask=mask_k, other=0.0)
    b = tl.load(beta + tile * C + rows, mask=rows < C, other=0.0)
    d = tl.load(log_decay + tile * C + rows, mask=rows < C, other=0.0)
    strict = (rows[:, None] > rows[None, :]) & (rows < C)[:, None]  # rows past C (D reads 0) too: no overflow
    decay = tl.exp(tl.where(strict, d[:, None] - d[None, :], float("-inf")))
    return K, b, d, _mm(K, tl.trans(K), None, PRECISION), decay, strict


@triton.jit
def _unit_lower_inverse(M, C: tl.constexpr, BC: tl.constexpr):
    """``(I + M)⁻¹`` of a strictly lower ``M [BC, BC]`` (zero past row C) by forward substitution, row by row."""
    rows = tl.arange(0, BC)
    A = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for i in range(1, C):  # row i of A: e_i − Σ_{j<i} M_ij (row j of A); rows ≥ i of A are still e_j, M_ij = 0
        m_i = tl.sum(tl.where(rows[:, None] == i, M, 0.0), 0)
        row = tl.where(rows == i, 1.0, 0.0) - tl.sum(m_i[:, None] * A, 0)
        A = tl.where(rows[:, None] == i, row[None, :], A)
    return A


@triton.jit
def _ut_forward_kernel(
    k, v, beta, log_decay, a, w, u,
    C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Per (chunk, head): A = (I + strictly_lower(β Γ ⊙ K Kᵀ))⁻¹ by forward substitution, row by row; then
    W = A (β e^D K), U = A (β V) as ``(A ⊙ β e^D) K`` and ``(A ⊙ β) V`` (columns of A scaled: C × C tiles, not
    C × Dk copies of K and V; 243 registers a thread at 8 warps with the copies, 118 without). Writes A too, for
    backward."""
    tile = tl.program_id(0).to(tl.int64)
    K, b, d, KK, decay, strict = _chunk_factors(k, beta, log_decay, tile, C, DK, BC, BK, PRECISION)
    A = _unit_lower_inverse(tl.where(strict, b[:, None] * decay * KK, 0.0), C, BC)
    at_a, mask_a = _tile_offsets(tile, C, C, 0, BC, BC)
    tl.store(a + at_a, A, mask=mask_a)
    at_k, mask_k = _tile_offsets(tile, C, DK, 0, BC, BK)
    tl.store(w + at_k, _mm(A * (b * tl.exp(d))[None, :], K, None, PRECISION), mask=mask_k)
    at_v, mask_v = _tile_offsets(tile, C, DV, 0, BC, BVF)
    tl.store(u + at_v, _mm(A * b[None, :], tl.load(v + at_v, mask=mask_v, other=0.0), None, PRECISION), mask=mask_v)


@triton.jit
def _scaled_rows_backward(x, du, dx, A, b, dA, db, tile, C: tl.constexpr, WIDTH: tl.constexpr, BC: tl.constexpr,
                          BW: tl.constexpr, PRECISION: tl.constexpr):
    """The gradient of ``U = A (β X)`` (``x``, ``du``: [C, WIDTH] chunk tensors, in blocks of ``BW`` columns): writes
    X's, ``β Aᵀ dU``, to ``dx``; returns ``dA + dU (β X)ᵀ`` and ``dβ + Σ (Aᵀ dU) ⊙ X`` per row."""
    for c0 in range(0, WIDTH, BW):
        at, mask = _tile_offsets(tile, C, WIDTH, c0, BC, BW)
        X = tl.load(x + at, mask=mask, other=0.0)
        dU = tl.load(du + at, mask=mask, other=0.0)
        dX = _mm(tl.trans(A), dU, None, PRECISION)
        tl.store(dx + at, dX * b[:, None], mask=mask)
        db += tl.sum(dX * X, 1)
        dA = _mm(dU, tl.trans(X * b[:, None]), dA, PRECISION)
    return dA, db


@triton.jit
def _ut_backward_kernel(
    k, v, beta, log_decay, a, dw, du, dk, dv, dbeta, dlog,
    C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BC: tl.constexpr, BW: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The UT transform's gradient per (chunk, head), with X = β e^D K, Y = β V (W = A X, U = A Y):
    dX = Aᵀ dW, dY = Aᵀ dU, dA = dW Xᵀ + dU Yᵀ, and through the inverse dM = −Aᵀ dA Aᵀ on the strictly lower
    triangle, M = β Γ ⊙ K Kᵀ.

    Holds the chunk's C×C tiles (A, K Kᵀ, dA, then dM) and one block of ``BW`` channels of K, dW or V, dU at a time
    (all of them at once spill 1.6 KB a thread on sm_90): K Kᵀ, dA and ``Σ dX ⊙ K`` (β's and D's share through X)
    sum over key blocks, dY (→ dV, β's share through Y) and dA's ``dU Yᵀ`` over value blocks; once dA is whole, dM,
    and a second pass over key blocks recomputes dX (a C×C×BW product, cheaper than a [C, Dk] round trip through
    memory) for ``dK = dKK K + dKKᵀ K + dX ⊙ β e^D``."""
    tile = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BC)
    b = tl.load(beta + tile * C + rows, mask=rows < C, other=0.0)
    d = tl.load(log_decay + tile * C + rows, mask=rows < C, other=0.0)
    scale = b * tl.exp(d)
    at_a, mask_a = _tile_offsets(tile, C, C, 0, BC, BC)
    A = tl.load(a + at_a, mask=mask_a, other=0.0)
    KK = tl.zeros([BC, BC], dtype=tl.float32)
    dA = tl.zeros([BC, BC], dtype=tl.float32)
    through_x = tl.zeros([BC], dtype=tl.float32)  # ∂/∂scale of each row
    for c0 in range(0, DK, BW):
        at, mask = _tile_offsets(tile, C, DK, c0, BC, BW)
        K = tl.load(k + at, mask=mask, other=0.0)
        dW = tl.load(dw + at, mask=mask, other=0.0)
        KK = _mm(K, tl.trans(K), KK, PRECISION)
        dA = _mm(dW, tl.trans(K * scale[:, None]), dA, PRECISION)
        through_x += tl.sum(_mm(tl.trans(A), dW, None, PRECISION) * K, 1)
    dA, db = _scaled_rows_backward(v, du, dv, A, b, dA, tl.exp(d) * through_x, tile, C, DV, BC, BW, PRECISION)
    strict = (rows[:, None] > rows[None, :]) & (rows < C)[:, None]  # rows past C (D reads 0) too: no overflow
    decay = tl.exp(tl.where(strict, d[:, None] - d[None, :], float("-inf")))
    dM = tl.where(strict, -_mm(tl.trans(A), _mm(dA, tl.trans(A), None, PRECISION), None, PRECISION), 0.0)
    dKK = dM * b[:, None] * decay
    weighted = dKK * KK  # dΓ ⊙ Γ: the log-gate's share of M
    db += tl.sum(dM * decay * KK, 1)
    dd = tl.sum(weighted, 1) - tl.sum(weighted, 0) + scale * through_x
    tl.store(dbeta + tile * C + rows, db, mask=rows < C)
    tl.store(dlog + tile * C + rows, dd, mask=rows < C)
    for c0 in range(0, DK, BW):
        at, mask = _tile_offsets(tile, C, DK, c0, BC, BW)
        K = tl.load(k + at, mask=mask, other=0.0)
        dX = _mm(tl.trans(A), tl.load(dw + at, mask=mask, other=0.0), None, PRECISION)
        tl.store(dk + at, _mm(dKK, K, _mm(tl.trans(dKK), K, dX * scale[:, None], PRECISION), PRECISION), mask=mask)


class _Block(torch.autograd.Function):
    """One block of chunks: its padded token rows ``q, k, v [n·C, H, *]``, ``beta, g [n·C, H]`` (input dtypes) and
    the state each of its documents starts from (``starting [docs, H, Dk, Dv]``, fp32) → its output rows (input
    dtype) and the state after each document's chunks. ``first_chunk``: each document's first chunk, and n last.

    Forward is two kernels, the UT transform and the scan with the output stage inside, and keeps only its inputs.
    Backward recomputes A, W, U and the per-chunk states (the UT and scan kernels; not O, which it does not need),
    then differentiates by hand: the output stage's adjoint, the reverse scan, what each chunk gets through the
    state, the UT transform's gradient, and the gates' share of each gathered into g's gradient."""

    @staticmethod
    def forward(ctx, q, k, v, beta, g, starting, first_chunk, chunks, precision):
        Q, K, V, B, G = (_chunk_rows(x, chunks) for x in (q, k, v, beta, g))
        D = G.cumsum(-1)
        _, W, U = _ut_forward(K, V, B, D, precision)
        out, final = _output_in_scan(Q, K, D, W, U, starting, first_chunk, precision)
        _keep_inputs(ctx, (q, k, v, beta, g, starting, first_chunk), chunks, precision)
        return _token_rows(out, q.dtype), final

    @staticmethod
    def backward(ctx, d_rows, d_final):
        q, k, v, beta, g, starting, first_chunk, chunks, precision = _kept_inputs(ctx)
        Q, K, V, B, G = (_chunk_rows(x, chunks) for x in (q, k, v, beta, g))
        D = G.cumsum(-1)  # [n, H, C]
        # D_C − D as a sum of the later gates, not a difference, and the last token's e^{D_C − D} the constant 1 (as
        # is Γ's diagonal in the output kernels): as D_i − D_i their gradients would be ± terms of size 1 that cancel
        # in g's gradient, which is ~α where gates are strong (g ≈ −20: α ≈ 2e-9)
        after = F.pad(G.flip(-1).cumsum(-1).flip(-1)[..., 1:], (0, 1))
        decay = D[..., -1].exp()
        A, W, U = _ut_forward(K, V, B, D, precision)
        states, delta = _scan_forward(W, U, K, after, decay, starting, first_chunk, precision)
        dO = torch.zeros_like(U) if d_rows is None else _chunk_rows(d_rows, chunks)
        d_states, d_delta_out, dQ, dK, dD_out = _output_backward(Q, K, D, states, delta, dO, precision)
        grad_after, d_delta, d_starting = _scan_backward(W, K, after, decay, d_states, d_delta_out, d_final,
                                                         first_chunk, precision)
        dW, d_after, d_last = _state_grads(K, after, decay, states, grad_after, delta, d_delta, dK, precision)
        dK_ut, dV, dB, dD_ut = _ut_backward(K, V, B, D, A, dW, d_delta, precision)
        dK += dK_ut
        # the last token's e^{D_C − D} is a constant (no gate follows it); D_C is the sum of every gate of the chunk
        d_after = F.pad(d_after[..., :-1], (1, 0)).cumsum(-1)
        dG = (dD_ut + dD_out).flip(-1).cumsum(-1).flip(-1) + d_after + d_last[..., None]
        grads = (_token_rows(x, t.dtype) for x, t in zip((dQ, dK, dV, dB, dG), (q, k, v, beta, g)))
        return *grads, d_starting, None, None, None


def _keep_inputs(ctx, inputs, chunks, precision):
    """What a block's Function keeps for its backward: its inputs (tensors), its number of chunks and the products'
    precision; no gradient is made up for an output backward got none for."""
    ctx.save_for_backward(*inputs)
    ctx.chunks, ctx.precision = chunks, precision
    ctx.set_materialize_grads(False)


def _kept_inputs(ctx) -> tuple:
    """What ``_keep_inputs`` kept: the inputs, then the number of chunks and the precision."""
    return *ctx.saved_tensors, ctx.chunks, ctx.precision


def _ut_forward(K, V, B, D, precision):
    """The UT transform of chunk tensors ``[n, H, C, *]`` (fp32, contiguous), every (chunk, head) a program →
    (A, W, U)."""
    n, heads, size, dk = K.shape
    a = K.new_empty(n, heads, size, size)
    w, u = torch.empty_like(K), torch.empty_like(V)
    _ut_forward_kernel[(n * heads,)](K, V, B, D, a, w, u, **_ut_geometry(size, dk, V.shape[-1], precision))
    return a, w, u


def _ut_backward(K, V, B, D, A, dW, dU, precision):
    """The UT transform's gradient → the gradients of K, V, β and D."""
    dk, dv, dbeta, dlog = (torch.empty_like(x) for x in (K, V, B, D))
    _ut_backward_kernel[(K.shape[0] * K.shape[1],)](
        K, V, B, D, A, dW, dU, dk, dv, dbeta, dlog, **_ut_backward_geometry(K.shape[2], K.shape[3], V.shape[-1],
                                                                            precision))
    return dk, dv, dbeta, dlog


def _ut_geometry(size, dk, dv, precision, config=UT_CONFIG) -> dict:
    """The UT forward kernel's shapes (every channel in one program) and launch settings (``config``)."""
    return dict(C=size, DK=dk, DV=dv, BC=max(16, triton.next_power_of_2(size)),
                BK=max(16, triton.next_power_of_2(dk)), BVF=max(16, triton.next_power_of_2(dv)),
                PRECISION=precision, **_launch(config))


def _ut_backward_geometry(size, dk, dv, precision, config=UT_CONFIG) -> dict:
    """The UT backward kernel's shapes (blocks of ``config``'s channel block, key or value channels) and launch
    settings."""
    return dict(C=size, DK=dk, DV=dv, BC=max(16, triton.next_power_of_2(size)),
                BW=min(config["channel_block"], max(16, triton.next_power_of_2(max(dk, dv)))),
                PRECISION=precision, **_launch(config))


def _scan_forward(W, U, K, after, decay, starting, first_chunk, precision):
    """``(W, U, K, D_C − D, e^{D_C})`` (chunk tensors ``[n, H, C, *]``, ``decay [n, H]``; fp32, contiguous) from
    ``starting`` → the state entering each chunk ``[n, H, Dk, Dv]`` and Δ."""
    n, heads, size, dk = W.shape
    dv, docs = U.shape[-1], first_chunk.numel() - 1
    states, delta = W.new_empty(n, heads, dk, dv), torch.empty_like(U)
    geometry = _geometry(size, dk, dv, precision)
    _scan_forward_kernel[(docs * heads, triton.cdiv(dv, geometry["BV"]))](
        W, U, K, after, decay, starting, states, delta, first_chunk, H=heads, **geometry)
    return states, delta


def _scan_backward(W, K, after, decay, d_states, d_delta, d_final, first_chunk, precision):
    """The scan's adjoint, from what the output stage hands back for each chunk's entering state and Δ, and the
    final states' gradient (None: none) → G (the gradient of the state leaving each chunk), Δ's whole gradient, and
    the starting states'."""
    heads, dv, docs = W.shape[1], d_delta.shape[-1], first_chunk.numel() - 1
    grad_after, delta_grad = torch.empty_like(d_states), torch.empty_like(d_delta)
    d_starting = d_states.new_empty(docs, *d_states.shape[1:])
    geometry = _geometry(W.shape[2], W.shape[3], dv, precision)
    _scan_backward_kernel[(docs * heads, triton.cdiv(dv, geometry["BV"]))](
        W, K, after, decay, d_states, d_delta, d_starting if d_final is None else d_final.contiguous(), grad_after,
        delta_grad, d_starting, first_chunk, H=heads, HAS_FINAL_GRAD=d_final is not None, **geometry)
    return grad_after, delta_grad, d_starting


def _state_grads(K, after, decay, states, grad_after, delta, d_delta, dk, precision):
    """After the reverse scan, every (chunk, head) a program: dW, and the gradients of e^{D_C − D} per token and of
    the chunk's summed gate; adds K's share to ``dk``."""
    n, heads, size, dk_width = K.shape
    dw, d_after, d_last = torch.empty_like(K), torch.empty_like(after), torch.empty_like(decay)
    _state_grads_kernel[(n * heads,)](K, after, decay, states, grad_after, delta, d_delta, dw, dk, d_after, d_last,
                                      **_per_chunk_geometry(size, dk_width, delta.shape[-1], precision))
    return dw, d_after, d_last


def _output_backward(Q, K, D, states, delta, dO, precision):
    """The output stage's adjoint, every (chunk, head) a program → the gradients of the entering states and Δ it
    hands the reverse scan, dQ, its part of dK, and its part of D's."""
    n, heads, size, dk = Q.shape
    d_states, d_delta, dq, dk_out, dlog = (torch.empty_like(x) for x in (states, delta, Q, K, D))
    _output_backward_kernel[(n * heads,)](Q, K, D, states, delta, dO, d_states, d_delta, dq, dk_out, dlog,
                                          **_per_chunk_geometry(size, dk, dO.shape[-1], precision))
    return d_states, d_delta, dq, dk_out, dlog


def _geometry(size, dk, dv, precision, config=CONFIG) -> dict:
    """The scans' shapes and launch settings (``config``: value block, warps, stages): blocks of at least 16
    (``tl.dot``), powers of two, masked to the real widths."""
    return dict(C=size, DK=dk, DV=dv, BC=max(16, triton.next_power_of_2(size)),
                BK=max(16, triton.next_power_of_2(dk)),
                BV=min(config["value_block"], max(16, triton.next_power_of_2(dv))), PRECISION=precision,
                **_launch(config))


def _per_chunk_geometry(size, dk, dv, precision, config=CONFIG, per_chunk=UT_CONFIG) -> dict:
    """The shapes of ``_geometry`` (value blocks of ``config``'s width) for a kernel with one program per chunk and
    head, launched as the UT kernels (``per_chunk``)."""
    return dict(_geometry(size, dk, dv, precision, config), **_launch(per_chunk))


def _launch(config: dict) -> dict:
    """A settings dict's warps and pipeline stages, as a launch takes them."""
    return dict(num_warps=config["num_warps"], num_stages=config["num_stages"])


class _DocumentChunks:
    """Chunks of ``size`` tokens from each document's first token: the padded token rows the blocks walk, the
    documents each block of chunks holds, and the way back to token rows. Without padding (every document a whole
    number of chunks) the padded rows are the token rows. Built from the offsets on the host, and reused while they
    stay the same (``_layout``): each read of them on the host waits for the GPU."""

    def __init__(self, offsets: list[int], size: int, device):
        self.size, self.total, self.device = size, offsets[-1], device
        first = [0]
        for start, end in zip(offsets, offsets[1:]):
            first.append(first[-1] + -(-(end - start) // size))
        self.first, self.count = first, first[-1]  # each document's first chunk, and the number of chunks last
        self.padded = self.count * size != self.total
        self.plans: dict[tuple, list] = {}
        if self.padded:
            cu, first = _on_device([offsets, first], device)
            docs = torch.arange(len(offsets) - 1, device=device)
            slot = torch.arange(self.count * size, device=device)
            doc = docs.repeat_interleave(first.diff(), output_size=self.count)[slot // size]
            token = cu[doc] + slot - first[doc] * size
            self.source = torch.where(token < cu[doc + 1], token, self.total)  # total: a zero row, the padding
            doc = docs.repeat_interleave(cu.diff(), output_size=self.total)
            self.place = first[doc] * size + torch.arange(self.total, device=device) - cu[doc]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Token rows ``[total, H, *]`` → padded rows ``[n·C, H, *]``."""
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[self.source] if self.padded else x

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """Padded rows ``[n·C, H, *]`` → token rows ``[total, H, *]``."""
        return x[self.place] if self.padded else x

    def plan(self, blocks: list[tuple[int, int]]) -> list[tuple[int, int, torch.Tensor, bool, bool]]:
        """Per block ``lo … hi-1``: its documents (the first, one past the last), their first chunks counted from lo
        (cut to the block; ``hi − lo`` last) on the device, whether the first began before lo, whether the last runs
        past hi. All blocks' chunk tables go to the device in one copy."""
        key = tuple(blocks)
        if key not in self.plans:
            spans, tables = [], []
            for lo, hi in blocks:
                d_lo = bisect.bisect_right(self.first, lo) - 1
                d_hi = bisect.bisect_left(self.first, hi)
                spans.append((d_lo, d_hi, self.first[d_lo] < lo, self.first[d_hi] > hi))
                tables.append([max(f, lo) - lo for f in self.first[d_lo:d_hi]] + [hi - lo])
            flat = _on_device([list(chain(*tables))], self.device)[0].split([len(t) for t in tables])
            self.plans[key] = [(d_lo, d_hi, table, runs_in, runs_on)
                               for (d_lo, d_hi, runs_in, runs_on), table in zip(spans, flat)]
        return self.plans[key]


def _on_device(rows: list[list[int]], device) -> torch.Tensor:
    """Host integers ``[len(rows), n]`` on ``device`` without waiting for it (a pinned, non-blocking copy)."""
    host = torch.tensor(rows, dtype=torch.long)
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


_layouts = OffsetsMemo()  # every layer shares one


def _layout(batch: int, length: int, cu_seqlens: torch.Tensor | None, size: int, device) -> _DocumentChunks:
    """The chunk layout of the request, the last one again for the same offsets (``OffsetsMemo``)."""
    def build():
        offsets = list(range(0, batch * length + 1, length)) if cu_seqlens is None else cu_seqlens.tolist()
        return _DocumentChunks(offsets, size, device)
    return _layouts.get(cu_seqlens, build, batch, length, size, str(device))


def _block(lo, hi, *rows_and_states, plan: dict, precision: str, function):
    """Chunks ``lo … hi-1`` (their padded rows of the op's token inputs, ``q, k, v [·, H, *]``, then e.g.
    ``beta [·, H]``, ``g [·, H, *]``) from ``entering`` (the state of the document running into chunk lo, if one
    does; then the initial states, last) through ``function`` (an autograd Function as ``_Block``) → their ``o``
    rows (input dtype), the state of the document running past chunk hi-1 (if one does) and the final states of the
    documents ending in them."""
    *tokens, entering, initial = rows_and_states
    d_lo, d_hi, first_chunk, runs_in, runs_on = plan[lo, hi]
    given = entering.new_zeros(d_hi - d_lo, *entering.shape) if initial is None else initial[d_lo:d_hi].float()
    starting = (torch.cat([entering[None], given[1:]]) if runs_in else given).contiguous()
    rows, leaving = function.apply(*tokens, starting, first_chunk, hi - lo, precision)
    return (rows, leaving[-1], leaving[:-1]) if runs_on else (rows, torch.zeros_like(entering), leaving)


def _chunk_rows(x: torch.Tensor, chunks: int) -> torch.Tensor:
    """Padded rows ``[n·C, H, *]`` → contiguous chunk tensors ``[n, H, C, *]`` in the accumulation dtype, in one copy
    (upcasting, then laying out, would write and read an fp32 copy twice)."""
    chunked = x.reshape(chunks, x.shape[0] // chunks, *x.shape[1:]).transpose(1, 2)
    accumulation = torch.promote_types(x.dtype, torch.float32)
    return chunked.to(accumulation, memory_format=torch.contiguous_format).contiguous()  # (same dtype: .to keeps it)


def _token_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Chunk tensors ``[n, H, C, *]`` → padded rows ``[n·C, H, *]`` in ``dtype``, in one copy (as ``_chunk_rows``)."""
    rows = x.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
    return rows.reshape(-1, x.shape[1], *x.shape[3:])  # (same dtype: .to keeps the layout, reshape copies)


def _output_in_scan(Q, K, D, W, U, starting, first_chunk, precision):
    """``O = (Q ⊙ e^D) S_in + (Q Kᵀ ⊙ Γ) Δ`` and the state after each document's chunks, from one kernel that keeps
    each chunk's state and Δ in registers."""
    n, heads, size, dk = Q.shape
    dv, docs = U.shape[-1], first_chunk.numel() - 1
    out, final = torch.empty_like(U), Q.new_empty(docs, heads, dk, dv)
    geometry = _geometry(size, dk, dv, precision)
    _scan_output_kernel[(docs * heads, triton.cdiv(dv, geometry["BV"]))](
        Q, K, W, U, D, starting, out, final, first_chunk, H=heads, **geometry)
    return out, final


def delta_rule_triton(q, k, v, beta, g, **options):
    """``delta_rule(..., impl="triton")``: same arguments (checked there, ``g`` filled in) and results."""
    return run_in_blocks(_Block, "delta_rule", q, k, v, beta, g, **options)


def run_in_blocks(function, op: str, q, k, v, *rest, cu_seqlens, initial_state, output_final_state, chunk_size):
    """A delta-rule Triton form's entry (``op``'s, checked there): the token inputs (q, k, v, then ``rest``: e.g.
    β and g) as padded token rows, walked in blocks of chunks, each block one call of the autograd Function
    ``function`` (``_Block``'s arguments and results, with ``rest`` in place of β and g)."""
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU); got {q.device}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"impl='triton' takes fp32, bf16 or fp16; got {q.dtype} (use impl='chunk')")
    batch, length, heads, dk = q.shape
    dv = v.shape[-1]
    if max(dk, dv) > MAX_HEAD_DIM:
        raise ValueError(f"{op}(impl='triton') supports head dims up to {MAX_HEAD_DIM}; got k {dk}, v {dv}")
    precision = dot_precision(q.dtype)
    layout = _layout(batch, length, cu_seqlens, chunk_size, q.device)  # rows of a batch: documents of one stream
    tokens = [layout.pad(x.reshape(batch * length, *x.shape[2:])) for x in (q, k, v, *rest)]
    blocks = bounded_blocks(layout.count, heads, chunk_size, max(dk, dv), BLOCK_ELEMENTS)
    plan = dict(zip(blocks, layout.plan(blocks)))
    entering = q.new_zeros(heads, dk, dv, dtype=torch.float32)  # no document runs into the first chunk
    block = partial(_block, plan=plan, precision=precision, function=function)
    rows, _, finals = in_blocks(block, blocks, chunk_size, tokens, entering, initial_state, recompute=False)
    o = layout.unpad(rows).view(batch, length, heads, dv)
    return (o, torch.cat(finals)) if output_final_state else o
