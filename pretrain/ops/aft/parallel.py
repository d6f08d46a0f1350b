"""AFT's fast forms over whole sequences: matmuls with ``e^w`` (full), convolutions (local non-causal, conv2d),
sums (simple); causal local and simple hand over to ``chunk.py``.
"""
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..documents import per_document
from ..precision import upcast
from .chunk import causal_aft
from .library import aft_full_op, aft_local_op, aft_simple_op


def aft_full(q, k, v, w, *, causal=True, cu_seqlens=None, chunk_size=64):
    """q, k, v ``[B, T, C]``, w ``[T_max, T_max]`` with T ≤ T_max (its top-left T×T block is used) → ``[B, T, C]``.

    O(T·C) memory beside the bias: ``num = e^w @ (e^K ⊙ V)``, ``den = e^w @ e^K`` after subtracting the per-row
    max of w and the per-channel max of K (both cancel in the ratio). Causal: rows in blocks of ``chunk_size``,
    each against the keys up to its end, with the max of K over those keys only — a single max over the whole
    sequence would underflow the early rows to 0/0 once a later key is ~80 larger — and the upper blocks skipped.
    """
    _check_same_shape("aft_full", q, k, v)
    if torch.compiler.is_compiling():  # one opaque op (library.py) whose body comes back here, eagerly
        return aft_full_op(q, k, v, w, causal=causal, cu_seqlens=cu_seqlens, chunk_size=chunk_size)
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


def aft_local(q, k, v, w_rel, *, window, causal=True, cu_seqlens=None, chunk_size=64):
    """AFT-local with a relative bias: ``w_rel[i]`` is the bias at offset ``t − t' = i`` (causal, ``[window]``)
    or ``t − t' = i − (window − 1)`` (non-causal, ``[2·window − 1]``); 0 for ``|t − t'| ≥ window``.

    Causal: all chunks of ``max(chunk_size, window)`` tokens at once, packed documents included
    (``chunk.py``). Non-causal: global sums plus a 1-D convolution with kernel ``e^w − 1``.
    """
    _check_same_shape("aft_local", q, k, v)
    _check_local_bias(w_rel, window, causal)
    if torch.compiler.is_compiling():  # one opaque op (library.py) whose body comes back here, eagerly
        return aft_local_op(q, k, v, w_rel, window=window, causal=causal, cu_seqlens=cu_seqlens,
                            chunk_size=chunk_size)
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


def aft_simple(q, k, v, *, causal=True, cu_seqlens=None, chunk_size=64):
    """AFT-simple: ``σ(Q_t) ⊙ Σ_{t'} softmax_{t'}(K) ⊙ V_{t'}``; causal: a per-channel prefix softmax."""
    _check_same_shape("aft_simple", q, k, v)
    if torch.compiler.is_compiling():  # one opaque op (library.py) whose body comes back here, eagerly
        return aft_simple_op(q, k, v, causal=causal, cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    if causal:
        return causal_aft(q, k, v, None, chunk=chunk_size, cu_seqlens=cu_seqlens)
    if cu_seqlens is not None:
        return per_document(aft_simple, cu_seqlens, q, k, v, causal=False)
    q, k, v_acc = upcast(q, k, v)
    pooled = (torch.softmax(k, dim=1) * v_acc).sum(dim=1, keepdim=True)
    return (torch.sigmoid(q) * pooled).to(v.dtype)


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
