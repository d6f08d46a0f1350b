"""flash-linear-attention (fla) as a backend: imported on first use, refused where it cannot run, trusted by
``impl="auto"`` only after a first-use check.

fla's kernels are Triton, CUDA only, and the package is optional (``pip install flash-linear-attention``), so
nothing here imports it at module load. The ops with an ``impl="fla"`` form (decayed linear attention → fla's
``chunk_simple_gla``, the delta rule → ``chunk_gated_delta_rule`` / ``chunk_delta_rule``) fetch the kernel with
``fla_function`` and refuse a CPU tensor with ``check_fla_device``; ``auto`` asks ``fla_may_run`` before it
considers fla at all, then ``first_use.first_use_ok`` against our chunked form on the request's device and dtype.
"""
import importlib
import importlib.util

import torch

FLA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what fla's kernels are written for (no fp64)


def fla_function(module: str, name: str):
    """``module.name`` from the fla package, or a ValueError that says how to install it."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as err:
        raise ValueError(f"impl='fla' needs flash-linear-attention (pip install flash-linear-attention); "
                         f"importing {module}.{name} failed: {err}") from err


def on_cuda(x: torch.Tensor) -> bool:
    """Where fla's kernels can run (a function of its own so CPU tests can stand in for a GPU)."""
    return x.is_cuda


def check_fla_device(q: torch.Tensor, op: str) -> None:
    """Refuse inputs fla's Triton kernels cannot take, before fla is called."""
    if not on_cuda(q):
        raise ValueError(f"{op}(impl='fla') runs flash-linear-attention's Triton kernels, which need CUDA tensors; "
                         f"got q on {q.device} (use impl='chunk' or 'auto' there)")


def fla_may_run(q: torch.Tensor) -> bool:
    """Whether ``auto`` may consider fla at all: CUDA, a dtype fla takes, the package installed."""
    return on_cuda(q) and q.dtype in FLA_DTYPES and importlib.util.find_spec("fla") is not None


def fla_offsets(cu_seqlens: torch.Tensor | None, q: torch.Tensor) -> dict:
    """Our ``cu_seqlens`` (any integer dtype, any device) as fla takes them: int64 on q's device, and the CPU copy
    that spares fla a device sync."""
    if cu_seqlens is None:
        return {}
    return {"cu_seqlens": cu_seqlens.to(device=q.device, dtype=torch.long),
            "cu_seqlens_cpu": cu_seqlens.to(device="cpu", dtype=torch.long)}


def state_dtype(q: torch.Tensor) -> torch.dtype:
    """Our states' dtype: fp32, fp64 for fp64 inputs (fla keeps its states in fp32)."""
    return torch.promote_types(q.dtype, torch.float32)
