"""The AFT definitions, O(T²·C): every form is ``aft_full_naive`` with its bias — the one oracle the fast forms
are held to.
"""
import torch

from ..documents import document_mask, document_positions
from ..precision import upcast


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


def local_bias_matrix(w_rel, total, *, window, causal):
    """The dense ``[T, T]`` bias of AFT-local: ``w_rel`` at offsets inside the window, 0 outside."""
    offset = torch.arange(total, device=w_rel.device)[:, None] - torch.arange(total, device=w_rel.device)[None, :]
    index = offset if causal else offset + window - 1
    inside = (offset.abs() < window) & (index >= 0) & (index < w_rel.shape[0])
    return w_rel[index.clamp(0, w_rel.shape[0] - 1)].masked_fill(~inside, 0)


def aft_local_naive(q, k, v, w_rel, *, window, causal=True, cu_seqlens=None):
    bias = local_bias_matrix(w_rel, k.shape[1], window=window, causal=causal)
    return aft_full_naive(q, k, v, bias, causal=causal, cu_seqlens=cu_seqlens)


def aft_simple_naive(q, k, v, *, causal=True, cu_seqlens=None):
    no_bias = k.new_zeros(k.shape[1], k.shape[1])
    return aft_full_naive(q, k, v, no_bias, causal=causal, cu_seqlens=cu_seqlens)


def aft_conv2d_naive(q, k, v, w, *, hw, heads):
    """Per head, a dense T×T bias from the s×s kernel (2-D offsets inside it, 0 outside), then ``aft_full_naive``."""
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
