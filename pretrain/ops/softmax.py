"""Softmax attention (REFERENCE §0), the baseline every linear mixer is measured against.

Fast forms: flash-attn's kernels when the package is importable and the tensors are fp16/bf16 on CUDA, otherwise
PyTorch's ``scaled_dot_product_attention`` (which picks its own flash kernel on CUDA when there is no mask).
Packed documents (``cu_seqlens``, B = 1) go to ``flash_attn_varlen_func``; on the SDPA path, SDPA runs once per
document. That costs one host sync (reading the offsets) and one kernel call per document, but only the work of
each document alone: a block-diagonal mask over the packed B·T tokens would do B× the work of the unpacked batch
and hold a (B·T)² mask.
"""
import torch
import torch.nn.functional as F

from .documents import document_mask, per_document
from .precision import upcast

try:
    from flash_attn import flash_attn_func, flash_attn_varlen_func
except ImportError:  # CPU machines and GPUs without the package: SDPA
    flash_attn_func = flash_attn_varlen_func = None


def softmax_attention(q, k, v, *, causal: bool = True, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(q kᵀ/√D) v`` per head; ``[B, T, H, D]`` in and out; ``cu_seqlens`` keeps documents apart."""
    _check_shapes(q, k, v, cu_seqlens)
    if flash_attn_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return _flash(q, k, v, causal, cu_seqlens)
    if cu_seqlens is not None:
        return per_document(_sdpa, cu_seqlens, q, k, v, causal=causal)
    return _sdpa(q, k, v, causal=causal)


def softmax_attention_naive(q, k, v, *, causal: bool = True, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The definition, in (at least) fp32 with the whole ``[T, T]`` score matrix: the oracle for the fast forms."""
    _check_shapes(q, k, v, cu_seqlens)
    q32, k32, v32 = upcast(q, k, v)
    scores = torch.einsum("bthd,bshd->bhts", q32, k32) * q.shape[-1] ** -0.5
    allowed = document_mask(q.shape[1], cu_seqlens, causal=causal, device=q.device)
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhts,bshd->bthd", weights, v32).to(q.dtype)


def _sdpa(q, k, v, *, causal):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


def _flash(q, k, v, causal, cu_seqlens):
    if cu_seqlens is None:
        return flash_attn_func(q, k, v, causal=causal)
    max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    out = flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens, cu_seqlens, max_len, max_len, causal=causal)
    return out.unsqueeze(0)


def _check_shapes(q, k, v, cu_seqlens):
    if q.dim() != 4 or q.shape != k.shape or q.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"softmax_attention wants q, k [B, T, H, D] and v [B, T, H, Dv]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs batch size 1 (flatten [B, T] to [1, B*T]); got batch {q.shape[0]}")
