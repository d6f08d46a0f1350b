"""Softmax attention (docs/MIXERS.md#softmax), the baseline every linear mixer is measured against.

Fast forms: flash-attn's kernels when the package is importable and the tensors are fp16/bf16 on CUDA, otherwise
PyTorch's ``scaled_dot_product_attention`` (which picks its own flash kernel on CUDA when there is no mask).
Packed documents (``cu_seqlens``, B = 1) go to ``flash_attn_varlen_func``; on the SDPA path, SDPA runs once per
document. That costs one host sync (reading the offsets) and one kernel call per document, but only the work of
each document alone: a block-diagonal mask over the packed B·T tokens would do B× the work of the unpacked batch
and hold a (B·T)² mask.

``naive.py`` holds the definition (the oracle), ``kernels.py`` the library kernels.
"""
import torch

from ..documents import per_document
from ..first_use import first_use_ok, sample_inputs
from .kernels import flash, flash_available, sdpa
from .naive import softmax_attention_naive


def softmax_attention(q, k, v, *, causal: bool = True, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(q kᵀ/√D) v`` per head; ``[B, T, H, D]`` in and out; ``cu_seqlens`` keeps documents apart."""
    _check_shapes(q, k, v, cu_seqlens)
    if _flash_may_run(q) and _flash_trusted(q, v, causal, cu_seqlens):
        return flash(q, k, v, causal, cu_seqlens)
    return _sdpa(q, k, v, causal, cu_seqlens)


def _sdpa(q, k, v, causal, cu_seqlens):
    if cu_seqlens is not None:
        return per_document(sdpa, cu_seqlens, q, k, v, causal=causal)
    return sdpa(q, k, v, causal=causal)


def _flash_may_run(q) -> bool:
    """flash-attn installed, CUDA tensors, a dtype its kernels take."""
    return flash_available and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def _flash_trusted(q, v, causal, cu_seqlens) -> bool:
    """flash-attn's first-use check (``ops/first_use.py``) against SDPA for this device, dtype and request class:
    two heads of the request's widths, two packed documents when the request packs them."""
    length, packed = 77, cu_seqlens is not None
    key = ("flash_attn", str(q.device), q.dtype, q.shape[3], v.shape[3], causal, packed)
    heads = min(q.shape[2], 2)
    inputs = sample_inputs([(1, length, heads, q.shape[3])] * 2 + [(1, length, heads, v.shape[3])], like=q)
    cu = torch.tensor([0, 30, length], device=q.device, dtype=torch.int32) if packed else None
    return first_use_ok(key, lambda q, k, v: flash(q, k, v, causal, cu),
                        lambda q, k, v: _sdpa(q, k, v, causal, cu), inputs,
                        kernel_name="flash-attn", reference_name="PyTorch's scaled_dot_product_attention")


def _check_shapes(q, k, v, cu_seqlens):
    if q.dim() != 4 or q.shape != k.shape or q.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"softmax_attention wants q, k [B, T, H, D] and v [B, T, H, Dv]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs batch size 1 (flatten [B, T] to [1, B*T]); got batch {q.shape[0]}")


__all__ = ["softmax_attention", "softmax_attention_naive"]
