"""The short convolution in Triton: one kernel forward, one backward and a sum over its blocks.

The naive form launches a slice, a multiply, a mask and an add per tap, then the bias and the activation: ~16
kernels forward and ~40 backward per convolution at K = 4, three convolutions a layer in Gated DeltaNet and KDA,
while an eager step on an H200 mostly waits on launches (benchmarks/gpu_h200_round4.md). Here each program owns a
block of tokens × a block of channels of one row (channels contiguous in ``[B, T, C]``):

- forward: the K taps, each read from x or, where it reaches behind the row, from ``before`` (zeros without), a tap
  that would reach an earlier document dropped (``positions``); bias and SiLU fused; fp32 sums.
- backward: the pre-activation's gradient ``g_t = dy_t ⊙ act'(pre_t)`` is needed at the block's tokens and the
  ``K − 1`` after them, so the program recomputes ``pre`` there (K² loads of tiles the cache holds) rather than
  storing it forward. Then ``dx_s = Σ_i w_i ⊙ g_{s+i}`` over the taps allowed at ``s + i``, the same for the
  ``K − 1`` inputs of ``before`` (in a row's first block), and the block's partial sums of
  ``dw_i = Σ_t g_t ⊙ x_{t−i}`` and ``db = Σ_t g_t``, which one torch sum adds over the blocks.

Every tensor but the bias is read through its strides (a halo sliced from a gathered buffer, an expanded gradient:
no copies).
The same kernels run on CPU under ``TRITON_INTERPRET=1``, where the tests hold them to the naive form.
"""
import functools

import torch
import triton
import triton.language as tl

# Launch settings, read at each launch (tests shrink the blocks so tiny shapes span several). Not yet tuned on a GPU:
# 32 × 64 keeps the backward's few live fp32 tiles at 16 values a thread each.
CONFIG = dict(token_block=32, channel_block=64, num_warps=4)


@triton.jit
def _tap_input(x_b, before_b, rows, cols, in_cols, T, sx_t, sx_c, sb_t, sb_c, K: tl.constexpr,
               HAS_BEFORE: tl.constexpr):
    """The inputs at tokens ``rows`` (negative: behind the row, ``before``'s row ``K − 1 + rows``, zero without
    it) and channels ``cols`` of one row, fp32 ``[R, BC]``."""
    inside = (rows >= 0) & (rows < T)
    value = tl.load(x_b + rows.to(tl.int64)[:, None] * sx_t + cols[None, :] * sx_c,
                    mask=inside[:, None] & in_cols[None, :], other=0.0).to(tl.float32)
    if HAS_BEFORE:
        behind = (rows < 0) & (rows >= 1 - K)
        value += tl.load(before_b + (rows + K - 1).to(tl.int64)[:, None] * sb_t + cols[None, :] * sb_c,
                         mask=behind[:, None] & in_cols[None, :], other=0.0).to(tl.float32)
    return value


@triton.jit
def _positions(pos_b, rows, T, sp_t):
    """Each of ``rows``' position in its document (0 outside the row)."""
    return tl.load(pos_b + rows.to(tl.int64) * sp_t, mask=(rows >= 0) & (rows < T), other=0)


@triton.jit
def _weight(w, cols, in_cols, sw_c, sw_k, tap: tl.constexpr):
    """Column ``tap`` of the weight at ``cols``, fp32 ``[1, BC]``."""
    return tl.load(w + cols * sw_c + tap * sw_k, mask=in_cols, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _pre_activation(x_b, before_b, pos_b, w, bias, rows, cols, in_cols, T, sx_t, sx_c, sb_t, sb_c, sp_t, sw_c, sw_k,
                    K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_BEFORE: tl.constexpr, HAS_POSITIONS: tl.constexpr):
    """``b + Σ_i w_i ⊙ x_{t−i}`` at tokens ``rows``, the taps past a token's document start dropped; fp32."""
    acc = _weight(w, cols, in_cols, sw_c, sw_k, 0) * _tap_input(x_b, before_b, rows, cols, in_cols, T, sx_t, sx_c,
                                                                 sb_t, sb_c, K, HAS_BEFORE)
    if HAS_POSITIONS:
        position = _positions(pos_b, rows, T, sp_t)
    for i in tl.static_range(1, K):
        term = _weight(w, cols, in_cols, sw_c, sw_k, i) * _tap_input(x_b, before_b, rows - i, cols, in_cols, T, sx_t,
                                                                      sx_c, sb_t, sb_c, K, HAS_BEFORE)
        if HAS_POSITIONS:
            term = tl.where((position >= i)[:, None], term, 0.0)
        acc += term
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=in_cols, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _pre_gradient(x_b, before_b, pos_b, w, bias, dy_b, rows, cols, in_cols, T, sx_t, sx_c, sb_t, sb_c, sp_t, sw_c,
                  sw_k, sd_t, sd_c, K: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                  HAS_BEFORE: tl.constexpr, HAS_POSITIONS: tl.constexpr):
    """``g = dy ⊙ act'(pre)`` at tokens ``rows`` (the pre-activation recomputed), zero outside the row; fp32."""
    inside = (rows >= 0) & (rows < T)
    g = tl.load(dy_b + rows.to(tl.int64)[:, None] * sd_t + cols[None, :] * sd_c,
                mask=inside[:, None] & in_cols[None, :], other=0.0).to(tl.float32)
    if ACT:  # SiLU: σ(p) (1 + p (1 − σ(p)))
        pre = _pre_activation(x_b, before_b, pos_b, w, bias, rows, cols, in_cols, T, sx_t, sx_c, sb_t, sb_c, sp_t,
                              sw_c, sw_k, K, HAS_BIAS, HAS_BEFORE, HAS_POSITIONS)
        sigmoid = tl.sigmoid(pre)
        g = g * sigmoid * (1.0 + pre * (1.0 - sigmoid))
    return g


@triton.jit
def _later_taps_gradient(x_b, before_b, pos_b, w, bias, dy_b, rows, cols, in_cols, T, sx_t, sx_c, sb_t, sb_c, sp_t,
                         sw_c, sw_k, sd_t, sd_c, R: tl.constexpr, BC: tl.constexpr, K: tl.constexpr,
                         ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_BEFORE: tl.constexpr,
                         HAS_POSITIONS: tl.constexpr):
    """``Σ_{i≥1} w_i ⊙ g_{s+i}`` at tokens ``s = rows``, each tap i only where token ``s + i`` allows it: what the
    inputs at ``rows`` receive through the later tokens' taps (all of it behind the row, at negative ``rows``)."""
    acc = tl.zeros((R, BC), dtype=tl.float32)
    for i in tl.static_range(1, K):
        term = _weight(w, cols, in_cols, sw_c, sw_k, i) * _pre_gradient(
            x_b, before_b, pos_b, w, bias, dy_b, rows + i, cols, in_cols, T, sx_t, sx_c, sb_t, sb_c, sp_t, sw_c,
            sw_k, sd_t, sd_c, K, ACT, HAS_BIAS, HAS_BEFORE, HAS_POSITIONS)
        if HAS_POSITIONS:
            term = tl.where((_positions(pos_b, rows + i, T, sp_t) >= i)[:, None], term, 0.0)
        acc += term
    return acc


@triton.jit
def _forward_kernel(x, w, bias, pos, before, y, T, C, sx_b, sx_t, sx_c, sb_b, sb_t, sb_c, sp_b, sp_t, sw_c, sw_k,
                    K: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_BEFORE: tl.constexpr,
                    HAS_POSITIONS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rows = i_t * BT + tl.arange(0, BT)
    cols = i_c * BC + tl.arange(0, BC)
    in_cols = cols < C
    pre = _pre_activation(x + i_b * sx_b, before + i_b * sb_b, pos + i_b * sp_b, w, bias, rows, cols, in_cols, T,
                          sx_t, sx_c, sb_t, sb_c, sp_t, sw_c, sw_k, K, HAS_BIAS, HAS_BEFORE, HAS_POSITIONS)
    if ACT:
        pre = pre * tl.sigmoid(pre)
    tl.store(y + (i_b * T + rows.to(tl.int64))[:, None] * C + cols[None, :], pre.to(y.dtype.element_ty),
             mask=(rows < T)[:, None] & in_cols[None, :])


@triton.jit
def _backward_kernel(x, w, bias, pos, before, dy, dx, d_before, partial, T, C, sx_b, sx_t, sx_c, sb_b, sb_t, sb_c,
                     sp_b, sp_t, sw_c, sw_k, sd_b, sd_t, sd_c, K: tl.constexpr, ACT: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_BEFORE: tl.constexpr, HAS_POSITIONS: tl.constexpr,
                     D_BEFORE: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BH: tl.constexpr):
    """dx of the block, d_before in each row's first block (D_BEFORE), and the block's partial sums of dw
    (``[C, K]``) and db (``[C]``, with HAS_BIAS) at its row ``partial[row, i_t]`` of ``[B, NT, C·K (+ C)]``."""
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rows = i_t * BT + tl.arange(0, BT)
    cols = i_c * BC + tl.arange(0, BC)
    in_cols = cols < C
    x_b, before_b, pos_b, dy_b = x + i_b * sx_b, before + i_b * sb_b, pos + i_b * sp_b, dy + i_b * sd_b
    g = _pre_gradient(x_b, before_b, pos_b, w, bias, dy_b, rows, cols, in_cols, T, sx_t, sx_c, sb_t, sb_c, sp_t,
                      sw_c, sw_k, sd_t, sd_c, K, ACT, HAS_BIAS, HAS_BEFORE, HAS_POSITIONS)

    part = partial + (i_b * tl.num_programs(0) + i_t) * (C * (K + HAS_BIAS))
    if HAS_POSITIONS:
        position = _positions(pos_b, rows, T, sp_t)
    for i in tl.static_range(K):
        earlier = _tap_input(x_b, before_b, rows - i, cols, in_cols, T, sx_t, sx_c, sb_t, sb_c, K, HAS_BEFORE)
        if HAS_POSITIONS:
            earlier = tl.where((position >= i)[:, None], earlier, 0.0)
        tl.store(part + cols * K + i, tl.sum(g * earlier, 0), mask=in_cols)
    if HAS_BIAS:
        tl.store(part + C * K + cols, tl.sum(g, 0), mask=in_cols)

    grad = _weight(w, cols, in_cols, sw_c, sw_k, 0) * g + _later_taps_gradient(
        x_b, before_b, pos_b, w, bias, dy_b, rows, cols, in_cols, T, sx_t, sx_c, sb_t, sb_c, sp_t, sw_c, sw_k, sd_t,
        sd_c, BT, BC, K, ACT, HAS_BIAS, HAS_BEFORE, HAS_POSITIONS)
    tl.store(dx + (i_b * T + rows.to(tl.int64))[:, None] * C + cols[None, :], grad.to(dx.dtype.element_ty),
             mask=(rows < T)[:, None] & in_cols[None, :])
    if D_BEFORE:
        if i_t == 0:  # the K − 1 inputs behind the row, tokens −(K − 1) … −1
            behind = tl.arange(0, BH) - (K - 1)
            # its own name: a variable an `if` reassigns must keep its shape (the compiler refuses it, the
            # interpreter does not)
            grad_behind = _later_taps_gradient(x_b, before_b, pos_b, w, bias, dy_b, behind, cols, in_cols, T, sx_t,
                                               sx_c, sb_t, sb_c, sp_t, sw_c, sw_k, sd_t, sd_c, BH, BC, K, ACT,
                                               HAS_BIAS, HAS_BEFORE, HAS_POSITIONS)
            tl.store(d_before + (i_b * (K - 1) + (behind + K - 1))[:, None] * C + cols[None, :],
                     grad_behind.to(d_before.dtype.element_ty), mask=(behind < 0)[:, None] & in_cols[None, :])


def _strides(t: torch.Tensor | None, dims: int) -> tuple[int, ...]:
    return tuple(t.stride()) if t is not None else (0,) * dims


class _ShortConv(torch.autograd.Function):
    """``act(b + Σ_i w_i ⊙ x_{t−i})`` from x ``[B, T, C]``, weight ``[C, K]``, bias ``[C]`` or None, before
    ``[B, K − 1, C]`` or None and positions ``[B, T]`` or None; y in ``out_dtype``."""

    @staticmethod
    def forward(ctx, x, weight, bias, before, positions, activation, out_dtype):
        seq_len, channels = x.shape[1:]
        y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        launch = _Launch(x, weight, bias, before, positions, activation)
        _forward_kernel[launch.grid](x, weight, launch.bias, launch.positions, launch.before, y, seq_len, channels,
                                     *launch.strides, **launch.flags, num_warps=CONFIG["num_warps"])
        ctx.save_for_backward(x, weight, bias, before, positions)
        ctx.activation = activation
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, before, positions = ctx.saved_tensors
        batch, seq_len, channels = x.shape
        K = weight.shape[1]
        launch = _Launch(x, weight, bias, before, positions, ctx.activation)
        d_before_wanted = launch.flags["HAS_BEFORE"] and ctx.needs_input_grad[3]
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        d_before = None
        if ctx.needs_input_grad[3]:  # (K = 1: before is [B, 0, C], its gradient empty)
            d_before = torch.empty(before.shape, dtype=before.dtype, device=x.device)
        width = channels * (K + (bias is not None))
        partial = torch.empty(batch, launch.grid[0], width, dtype=torch.float32, device=x.device)
        _backward_kernel[launch.grid](
            x, weight, launch.bias, launch.positions, launch.before, dy, dx, d_before if d_before_wanted else dx,
            partial, seq_len, channels, *launch.strides, *dy.stride(), **launch.flags, D_BEFORE=d_before_wanted,
            BH=triton.next_power_of_2(max(K - 1, 1)), num_warps=CONFIG["num_warps"])
        sums = partial.sum((0, 1))  # the blocks' dw (and db) added
        if bias is None or bias.dtype == weight.dtype:
            sums = sums.to(weight.dtype)  # one cast for both
        dw = sums[:channels * K].view(channels, K).to(weight.dtype)
        db = None if bias is None else sums[channels * K:].to(bias.dtype)
        return dx, dw, db, d_before, None, None, None


class _Launch:
    """The grid, strides and compile-time flags of one call; absent tensors stand in as x (never read)."""

    def __init__(self, x, weight, bias, before, positions, activation):
        batch, seq_len, channels = x.shape
        K = weight.shape[1]
        has_before = before is not None and K > 1
        self.bias = x if bias is None else bias
        self.before = before if has_before else x
        self.positions = x if positions is None else positions
        BT, BC = CONFIG["token_block"], min(CONFIG["channel_block"], triton.next_power_of_2(channels))
        self.grid = (triton.cdiv(seq_len, BT), triton.cdiv(channels, BC), batch)
        self.strides = (*x.stride(), *_strides(before if has_before else None, 3),
                        *_strides(positions, 2), *weight.stride())
        self.flags = dict(K=K, ACT=activation == "silu", HAS_BIAS=bias is not None, HAS_BEFORE=has_before,
                          HAS_POSITIONS=positions is not None, BT=BT, BC=BC)


def short_conv_triton(x, weight, bias=None, *, positions=None, before=None, activation="silu"):
    """``short_conv(..., impl="triton")``: the same arguments, already checked; y in the dtype the naive form
    gives (x's, promoted with the weight's, bias's and before's)."""
    tensors = [t for t in (x, weight, bias, before) if t is not None]
    out_dtype = functools.reduce(torch.promote_types, [t.dtype for t in tensors])
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"impl='triton' takes fp32, bf16 or fp16; got {out_dtype}")
    bias = None if bias is None else bias.contiguous()  # (read with stride 1; a parameter already is)
    return _ShortConv.apply(x, weight, bias, before, positions, activation, out_dtype)
