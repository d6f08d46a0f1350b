"""AFT — the Attention Free Transformer (Zhai et al. 2021): per-channel attention with a learned position bias.

REFERENCE §5. Layout ``[B, T, C]`` (AFT has no heads except AFT-conv's kernel groups).
``Y_t = σ(Q_t) ⊙ Σ_{t'} e^{K_{t'} + w_{t,t'}} ⊙ V_{t'} / Σ_{t'} e^{K_{t'} + w_{t,t'}}``; causal: ``t' ≤ t``.

- ``aft_full``: any bias ``w [T_max, T_max]``; O(T·C) memory beside the bias by two matmuls with ``e^w``.
- ``aft_local``: a relative bias inside a window of ``s`` tokens and **0 outside** (distant tokens still count):
  ``num = Σ_all e^K V + Σ_{|t−t'|<s} (e^w − 1) e^K V`` (den: V → 1). Causal form: ``aft_causal.py``.
- ``aft_simple``: no bias — a (prefix) softmax over positions, per channel.
- ``aft_conv2d``: per-head s×s relative biases on an image grid, as a depthwise convolution.
Each has a naive O(T²·C) reference built on ``aft_full_naive``, the one oracle.
"""
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .aft_causal import causal_aft
from .documents import document_mask, document_positions, per_document
from .precision import upcast


def aft_full_naive(q, k, v, w, *, causal=True, cu_seqlens=None):
    """The definition: for each (t, channel) a masked softmax over t' of ``K_{t'} + w_{t,t'}``.

    With ``cu_seqlens`` the bias is indexed by positions within each document.
    """
    total = k.shape[1]
    allowed = document_mask(total, cu_seqlens, causal=causal, device=k.device)
    positions = document_positions(total, cu_seqlens, device=k.device)
    q, k, v_acc, w = upcast(q, k, v, w)
    bias = w[positions[:, None], positions[None, :]]  # [t, t']
    logits = (k[:, None, :, :] + bias[None, :, :, None]).masked_fill(~allowed[None, :, :, None], float("-inf"))
    weights = torch.softmax(logits, dim=2)  # over t'
    return (torch.sigmoid(q) * torch.einsum("btjc,bjc->btc", weights, v_acc)).to(v.dtype)


def aft_full(q, k, v, w, *, causal=True, cu_seqlens=None, chunk_size=64):
    """q, k, v ``[B, T, C]``, w ``[T_max, T_max]`` with T ≤ T_max (its top-left T×T block is used) → ``[B, T, C]``.

    O(T·C) memory beside the bias: ``num = e^w @ (e^K ⊙ V)``, ``den = e^w @ e^K`` after subtracting the per-row
    max of w and the per-channel max of K (both cancel in the ratio). Causal: rows in blocks of ``chunk_size``,
    each against the keys up to its end, with the max of K over those keys only — a single max over the whole
    sequence would underflow the early rows to 0/0 once a later key is ~80 larger — and the upper blocks skipped.
    """
    _check_same_shape("aft_full", q, k, v)
    longest = k.shape[1] if cu_seqlens is None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    if w.dim() != 2 or w.shape[0] != w.shape[1] or w.shape[0] < longest:
        raise ValueError(
            f"aft_full: bias w has shape {tuple(w.shape)}; it must be square with T_max ≥ the sequence "
            f"length {longest} (AFT-full has no form beyond its T_max)"
        )
    if cu_seqlens is not None:
        return per_document(aft_full, cu_seqlens, q, k, v, w=w, causal=causal, chunk_size=chunk_size)
    total = k.shape[1]
    q, k, v_acc, w = upcast(q, k, v, w[:total, :total])
    if not causal:
        return _aft_rows(q, k, v_acc, w).to(v.dtype)
    visible = torch.ones_like(w, dtype=torch.bool).tril()
    blocks = []
    for start in range(0, total, chunk_size):
        end = min(start + chunk_size, total)
        rows = w[start:end, :end].masked_fill(~visible[start:end, :end], float("-inf"))
        # checkpointed: the block's e^K over its prefix is recomputed in backward, keeping memory O(T·C)
        blocks.append(checkpoint(_aft_rows, q[:, start:end], k[:, :end], v_acc[:, :end], rows, use_reentrant=False))
    return torch.cat(blocks, dim=1).to(v.dtype)


def _aft_rows(q, k, v, w):
    """AFT for the query rows of ``w [rows, keys]`` against all given keys, by two matmuls."""
    exp_w = (w - w.max(dim=1, keepdim=True).values.detach()).exp()
    exp_k = (k - k.max(dim=1, keepdim=True).values.detach()).exp()
    return torch.sigmoid(q) * torch.matmul(exp_w, exp_k * v) / torch.matmul(exp_w, exp_k)


def local_bias_matrix(w_rel, total, *, window, causal):
    """The dense ``[T, T]`` bias of AFT-local: ``w_rel`` at offsets inside the window, 0 outside."""
    offset = torch.arange(total, device=w_rel.device)[:, None] - torch.arange(total, device=w_rel.device)[None, :]
    index = offset if causal else offset + window - 1
    inside = (offset.abs() < window) & (index >= 0) & (index < w_rel.shape[0])
    return w_rel[index.clamp(0, w_rel.shape[0] - 1)].masked_fill(~inside, 0)


def aft_local_naive(q, k, v, w_rel, *, window, causal=True, cu_seqlens=None):
    _check_local_bias(w_rel, window, causal)
    bias = local_bias_matrix(w_rel, k.shape[1], window=window, causal=causal)
    return aft_full_naive(q, k, v, bias, causal=causal, cu_seqlens=cu_seqlens)


def aft_local(q, k, v, w_rel, *, window, causal=True, cu_seqlens=None, chunk_size=64):
    """AFT-local with a relative bias: ``w_rel[i]`` is the bias at offset ``t − t' = i`` (causal, ``[window]``)
    or ``t − t' = i − (window − 1)`` (non-causal, ``[2·window − 1]``); 0 for ``|t − t'| ≥ window``.

    Causal: all chunks of ``max(chunk_size, window)`` tokens at once, packed documents included
    (``aft_causal.py``). Non-causal: global sums plus a 1-D convolution with kernel ``e^w − 1``.
    """
    _check_same_shape("aft_local", q, k, v)
    _check_local_bias(w_rel, window, causal)
    if causal:
        return causal_aft(q, k, v, w_rel, chunk=max(chunk_size, window), cu_seqlens=cu_seqlens)
    if cu_seqlens is not None:
        return per_document(aft_local, cu_seqlens, q, k, v, w_rel=w_rel, window=window, causal=False)
    q, k, v_acc, w_rel = upcast(q, k, v, w_rel)
    exp_k = (k - k.max(dim=1, keepdim=True).values.detach()).exp()
    kernel = (w_rel.exp() - 1).flip(0)  # conv1d correlates: tap i reads offset t − t' = (window − 1) − i

    def band(x):  # [B, T, C] → Σ_{|t−t'|<window} (e^{w(t−t')} − 1) x_{t'}
        batch, total, channels = x.shape
        rows = x.transpose(1, 2).reshape(batch * channels, 1, total)
        out = F.conv1d(rows, kernel.view(1, 1, -1), padding=window - 1)
        return out.view(batch, channels, total).transpose(1, 2)

    num = (exp_k * v_acc).sum(dim=1, keepdim=True) + band(exp_k * v_acc)
    den = exp_k.sum(dim=1, keepdim=True) + band(exp_k)
    return (torch.sigmoid(q) * num / den).to(v.dtype)


def aft_simple_naive(q, k, v, *, causal=True, cu_seqlens=None):
    no_bias = k.new_zeros(k.shape[1], k.shape[1])
    return aft_full_naive(q, k, v, no_bias, causal=causal, cu_seqlens=cu_seqlens)


def aft_simple(q, k, v, *, causal=True, cu_seqlens=None, chunk_size=64):
    """AFT-simple: ``σ(Q_t) ⊙ Σ_{t'} softmax_{t'}(K) ⊙ V_{t'}``; causal: a per-channel prefix softmax."""
    _check_same_shape("aft_simple", q, k, v)
    if causal:
        return causal_aft(q, k, v, None, chunk=chunk_size, cu_seqlens=cu_seqlens)
    if cu_seqlens is not None:
        return per_document(aft_simple, cu_seqlens, q, k, v, causal=False)
    q, k, v_acc = upcast(q, k, v)
    pooled = (torch.softmax(k, dim=1) * v_acc).sum(dim=1, keepdim=True)
    return (torch.sigmoid(q) * pooled).to(v.dtype)


def aft_conv2d_naive(q, k, v, w, *, hw, heads):
    """Per head, a dense T×T bias from the s×s kernel (2-D offsets inside it, 0 outside), then ``aft_full_naive``."""
    _check_conv(q, k, v, w, hw, heads)
    height, width = hw
    size = w.shape[-1]
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    rows, cols = rows.reshape(-1).to(w.device), cols.reshape(-1).to(w.device)
    dy = rows[None, :] - rows[:, None] + size // 2  # t' − t, shifted into kernel indices
    dx = cols[None, :] - cols[:, None] + size // 2
    inside = (dy >= 0) & (dy < size) & (dx >= 0) & (dx < size)
    group = k.shape[-1] // heads
    outputs = []
    for head in range(heads):
        bias = w[head][dy.clamp(0, size - 1), dx.clamp(0, size - 1)].masked_fill(~inside, 0)
        piece = slice(head * group, (head + 1) * group)
        outputs.append(aft_full_naive(q[..., piece], k[..., piece], v[..., piece], bias, causal=False))
    return torch.cat(outputs, dim=-1)


def aft_conv2d(q, k, v, w, *, hw, heads):
    """AFT-conv: q, k, v ``[B, H·W, C]`` on an image grid ``hw``, w ``[heads, s, s]`` (s odd; C/heads channels
    share a kernel). ``Y = σ(Q) ⊙ [conv(e^K V, e^w − 1) + Σ e^K V] / [conv(e^K, e^w − 1) + Σ e^K]``.
    """
    _check_conv(q, k, v, w, hw, heads)
    height, width = hw
    batch, total, channels = k.shape
    size = w.shape[-1]
    q, k, v_acc, w = upcast(q, k, v, w)
    exp_k = (k - k.max(dim=1, keepdim=True).values.detach()).exp()
    kernel = (w.exp() - 1).repeat_interleave(channels // heads, dim=0)[:, None]  # [C, 1, s, s]

    def conv(x):
        grid = x.transpose(1, 2).reshape(batch, channels, height, width)
        out = F.conv2d(grid, kernel, padding=size // 2, groups=channels)
        return out.reshape(batch, channels, total).transpose(1, 2)

    num = conv(exp_k * v_acc) + (exp_k * v_acc).sum(dim=1, keepdim=True)
    den = conv(exp_k) + exp_k.sum(dim=1, keepdim=True)
    return (torch.sigmoid(q) * num / den).to(v.dtype)


def _check_same_shape(name, q, k, v):
    if not (q.dim() == 3 and q.shape == k.shape == v.shape):
        raise ValueError(f"{name}: q, k, v must share one shape [B, T, C]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")


def _check_local_bias(w_rel, window, causal):
    expected = window if causal else 2 * window - 1
    if window < 1 or tuple(w_rel.shape) != (expected,):
        raise ValueError(f"aft_local: w_rel has shape {tuple(w_rel.shape)}; window={window} "
                         f"{'causal' if causal else 'non-causal'} needs ({expected},)")


def _check_conv(q, k, v, w, hw, heads):
    _check_same_shape("aft_conv2d", q, k, v)
    if hw is None or hw[0] * hw[1] != k.shape[1]:
        raise ValueError(f"aft_conv2d: hw={hw} does not tile the {k.shape[1]} tokens")
    if k.shape[-1] % heads or w.dim() != 3 or w.shape[0] != heads or w.shape[1] != w.shape[2] or w.shape[1] % 2 == 0:
        raise ValueError(f"aft_conv2d: w has shape {tuple(w.shape)}; need [heads={heads}, s, s] with s odd and "
                         f"channels {k.shape[-1]} divisible by heads")
