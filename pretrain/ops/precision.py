"""Accumulation precision shared by the ops: bf16/fp16 inputs are computed in fp32, fp64 stays fp64."""
import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # deepspeed.precision, --dtype


def upcast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in their accumulation dtype (at least fp32), for sums over many tokens."""
    return tuple(t.to(torch.promote_types(t.dtype, torch.float32)) for t in tensors)
