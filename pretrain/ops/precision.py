"""Accumulation precision shared by the ops: bf16/fp16 inputs are computed in fp32, fp64 stays fp64."""
import os

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # deepspeed.precision, --dtype


def upcast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in their accumulation dtype (at least fp32), for sums over many tokens."""
    return tuple(t.to(torch.promote_types(t.dtype, torch.float32)) for t in tensors)


def finite_or_zero(log_scale: torch.Tensor) -> torch.Tensor:
    """A running max or log-normaliser with the empty state's −∞ read as 0, so ``exp(x − it)`` of an empty sum is 0,
    never NaN (the states that sequence-parallel ranks combine)."""
    return torch.where(torch.isfinite(log_scale), log_scale, 0.0)


def dot_precision(dtype: torch.dtype) -> str:
    """``PRECISION``, what our Triton kernels' matrix products take for inputs of ``dtype``: the GPU's
    (``gpu_dot_precision``), or "interpret" under Triton's CPU interpreter (``TRITON_INTERPRET=1``), whose bf16/fp16
    products are wrong and so run in fp32 there (``linear_attention/triton.py``'s ``_mm``). One rule for every
    kernel, in one place."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "interpret"
    return gpu_dot_precision(dtype)


def gpu_dot_precision(dtype: torch.dtype) -> str:
    """On a GPU: exact for fp32 ("ieee"), the tensor cores' own for bf16/fp16 ("tf32", which Triton ignores for
    them)."""
    return "ieee" if dtype == torch.float32 else "tf32"
