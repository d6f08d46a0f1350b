"""The library kernels behind softmax attention, each ``(q, k, v, causal, cu_seqlens, max_seqlen) → o``.

``sdpa``: PyTorch's ``scaled_dot_product_attention``, once per packed document (everywhere). ``masked``: SDPA once
over the packed row with a block-diagonal mask (everywhere). ``varlen``: PyTorch's own flash kernel over packed
documents (``torch.nn.attention.varlen.varlen_attn``, CUDA). ``flash``: flash-attn's kernels (where it is installed).
``max_seqlen`` is the longest document's length or any bound above it, a host int the varlen kernels size their
grids by; None reads it from ``cu_seqlens`` (one host sync).
"""
import functools
import importlib.util
import inspect

import torch
import torch.nn.functional as F

from ..documents import document_mask, per_document

try:
    from flash_attn import flash_attn_func, flash_attn_varlen_func
except ImportError:  # CPU machines and GPUs without the package: SDPA
    flash_attn_func = flash_attn_varlen_func = None

flash_available = flash_attn_func is not None
# absent in a torch before the varlen API; imported at its first call, as importing it imports torch's compiler
# (TorchDynamo and sympy: ~1 s at the start of every process, most of which never call it)
varlen_available = importlib.util.find_spec("torch.nn.attention.varlen") is not None


@functools.cache
def _varlen_attn():
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def sdpa(q, k, v, causal, cu_seqlens=None, max_seqlen=None):
    """SDPA over each row, or over each packed document alone: only each document's work, but one call and one
    host read of the offsets per document (free on CPU, a stall of the stream on a GPU)."""
    if cu_seqlens is not None:
        return per_document(sdpa, cu_seqlens, q, k, v, causal=causal)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


def masked(q, k, v, causal, cu_seqlens=None, max_seqlen=None):
    """One SDPA call over the packed row, documents kept apart by a ``[T, T]`` mask built on the device (nothing
    read on the host): the form with no per-document step that runs everywhere, at the price of the whole row's
    T² scores and mask (B× the work of the rows alone)."""
    if cu_seqlens is None:
        return sdpa(q, k, v, causal)
    allowed = document_mask(q.shape[1], cu_seqlens, causal=causal, device=q.device)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed)
    return out.transpose(1, 2)


def varlen(q, k, v, causal, cu_seqlens=None, max_seqlen=None):
    """PyTorch's flash kernel over the packed documents in one call (rows unpacked: each row a document)."""
    if not varlen_available:
        raise ValueError("impl='varlen' needs torch.nn.attention.varlen.varlen_attn, which this torch lacks")
    if q.device.type == "cpu":
        raise ValueError("impl='varlen' is PyTorch's CUDA flash kernel; on CPU use impl='sdpa' or 'masked'")
    cu, max_seqlen = _as_documents(q, cu_seqlens, max_seqlen)
    out = _varlen_attn()(*(t.reshape(-1, *t.shape[2:]) for t in (q, k, v)), cu, cu, max_seqlen, max_seqlen,
                      **_varlen_causal(causal))
    return out.view(v.shape)


def flash(q, k, v, causal, cu_seqlens=None, max_seqlen=None):
    """flash-attn: ``flash_attn_func`` over rows, ``flash_attn_varlen_func`` over packed documents."""
    if flash_attn_func is None:
        raise ValueError("impl='flash' needs the flash-attn package, which does not import here")
    if cu_seqlens is None:
        return flash_attn_func(q, k, v, causal=causal)
    cu, max_seqlen = _as_documents(q, cu_seqlens, max_seqlen)
    return flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, max_seqlen, max_seqlen, causal=causal).unsqueeze(0)


def _as_documents(q, cu_seqlens, max_seqlen):
    """The varlen kernels' view of ``q [B, T, H, D]``: the documents' int32 offsets on q's device and a bound on
    the longest. Rows unpacked become documents of T (their offsets made on the device)."""
    batch, length = q.shape[:2]
    if cu_seqlens is None:
        cu_seqlens, max_seqlen = torch.arange(batch + 1, device=q.device) * length, length
    elif max_seqlen is None:
        max_seqlen = int(cu_seqlens.diff().max())  # the one host read; callers that know a bound pass it
    return cu_seqlens.to(device=q.device, dtype=torch.int32), max_seqlen


@functools.cache
def _varlen_causal(causal: bool) -> dict:
    """How this torch's ``varlen_attn`` is told to be causal: ``window_size=(-1, 0)`` in newer releases,
    ``is_causal`` in the first ones."""
    if "window_size" in inspect.signature(_varlen_attn()).parameters:
        return {"window_size": (-1, 0) if causal else (-1, -1)}
    return {"is_causal": causal}
