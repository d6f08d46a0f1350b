"""Accumulation precision shared by the ops: bf16/fp16 inputs are computed in fp32, fp64 stays fp64."""
import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # deepspeed.precision, --dtype


def upcast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in their accumulation dtype (at least fp32), for sums over many tokens."""
    return tuple(t.to(torch.promote_types(t.dtype, torch.float32)) for t in tensors)


def finite_or_zero(log_scale: torch.Tensor) -> torch.Tensor:
    """A running max or log-normaliser with the empty state's −∞ read as 0, so ``exp(x − it)`` of an empty sum is 0,
    never NaN (the states that sequence-parallel ranks combine)."""
    return torch.where(torch.isfinite(log_scale), log_scale, 0.0)
