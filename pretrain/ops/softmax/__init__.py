"""Softmax attention (docs/MIXERS.md#softmax), the baseline every linear mixer is measured against.

``impl`` picks the form: ``naive`` (the definition, ``naive.py``: the oracle), ``sdpa`` (PyTorch's SDPA; packed
documents one call each), ``masked`` (SDPA once over packed documents with a block-diagonal mask), ``varlen``
(PyTorch's ``varlen_attn``, CUDA) and ``flash`` (flash-attn) — the library kernels in ``kernels.py``.

``auto`` on CUDA in fp16/bf16 takes flash-attn where it imports, then (packed documents) ``varlen``, each only after
its first-use check against per-document SDPA (``ops/first_use.py``): packed documents then cost one kernel call and
no host sync. Everywhere else it takes ``sdpa``: on CPU reading the offsets stalls nothing, and each document alone
is the least work (one ``masked`` call over the packed row does B× the work of its rows and holds a ``(B·T)²``
mask: 4–14× slower on CPU, benchmarks/softmax_packed_cpu.md).
"""
import torch

from ..documents import check_packing
from ..first_use import first_use_ok, sample_inputs
from .kernels import flash, flash_available, masked, sdpa, varlen, varlen_available
from .library import softmax_attention_op
from .naive import softmax_attention_naive


def naive(q, k, v, causal, cu_seqlens=None, max_seqlen=None):
    return softmax_attention_naive(q, k, v, causal=causal, cu_seqlens=cu_seqlens)


KERNELS = {"naive": naive, "sdpa": sdpa, "masked": masked, "varlen": varlen, "flash": flash}
IMPLS = ("auto", *KERNELS)
INSTALLED = {"flash": flash_available, "varlen": varlen_available}
NAMES = {"flash": "flash-attn", "varlen": "PyTorch's varlen_attn"}


def softmax_attention(q, k, v, *, causal: bool = True, cu_seqlens: torch.Tensor | None = None,
                      max_seqlen: int | None = None, impl: str = "auto") -> torch.Tensor:
    """``softmax(q kᵀ/√D) v`` per head; ``[B, T, H, D]`` in and out; ``cu_seqlens`` keeps documents apart.

    max_seqlen: the longest packed document, or any bound at or above it (a caller whose rows each start a
    document passes the row length): the varlen kernels need it on the host, and None makes them read it from
    ``cu_seqlens``, a host sync. impl: ``auto``, ``naive``, ``sdpa``, ``masked``, ``varlen`` or ``flash``.
    """
    _check(q, k, v, cu_seqlens, max_seqlen, impl)
    if torch.compiler.is_compiling() and not _traceable(q, cu_seqlens, impl):
        # one opaque op (library.py) whose body comes back here, eagerly
        return softmax_attention_op(q, k, v, causal=causal, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, impl=impl)
    if impl == "auto":
        impl = next((name for name in _candidates(q, cu_seqlens is not None)
                     if _trusted(name, q, v, causal, cu_seqlens)), "sdpa")
    return KERNELS[impl](q, k, v, causal, cu_seqlens, max_seqlen)


def _traceable(q, cu_seqlens, impl) -> bool:
    """Whether the compiler may trace this request itself: SDPA over whole rows, as ``auto`` takes it off flash's
    ground (its own backward then kept; the custom op's recomputes the forward). Packed documents (read on the
    host), the library kernels and their first-use checks stay inside the op."""
    return cu_seqlens is None and (impl == "sdpa" or impl == "auto" and not _candidates(q, False))


def _candidates(q, packed: bool) -> list[str]:
    """The library kernels ``auto`` may try for this request, best first: installed, CUDA, a dtype they take
    (varlen_attn only for packed documents: over whole rows SDPA already reaches the same flash kernel)."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        return []
    return [name for name in ("flash", "varlen") if INSTALLED[name] and (packed or name == "flash")]


def _trusted(name, q, v, causal, cu_seqlens) -> bool:
    """The kernel's first-use check (``ops/first_use.py``) against per-document SDPA for this device, dtype and
    request class: two heads of the request's widths, three packed documents (one of a single token) when the
    request packs them. Nothing is made on the device once the class has its verdict."""
    length, packed = 77, cu_seqlens is not None
    key = (name, str(q.device), q.dtype, q.shape[3], v.shape[3], causal, packed)
    heads = min(q.shape[2], 2)

    def inputs():
        return sample_inputs([(1, length, heads, q.shape[3])] * 2 + [(1, length, heads, v.shape[3])], like=q)

    def documents(x):
        return torch.tensor([0, 30, 31, length], device=x.device, dtype=torch.int32) if packed else None

    return first_use_ok(key, lambda q, k, v: KERNELS[name](q, k, v, causal, documents(q), length),
                        lambda q, k, v: sdpa(q, k, v, causal, documents(q)), inputs,
                        kernel_name=NAMES[name], reference_name="PyTorch's scaled_dot_product_attention")


def _check(q, k, v, cu_seqlens, max_seqlen, impl):
    """What shapes and options show (nothing read from the device)."""
    if impl not in IMPLS:
        raise ValueError(f"softmax_attention's impl must be one of {IMPLS}; got {impl!r}")
    if q.dim() != 4 or q.shape != k.shape or v.dim() != 4 or q.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"softmax_attention wants q, k [B, T, H, D] and v [B, T, H, Dv]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    check_packing(q.shape[0], cu_seqlens)
    if max_seqlen is not None and not (isinstance(max_seqlen, (int, torch.SymInt)) and max_seqlen >= 1):
        raise ValueError(f"max_seqlen must be a positive int (a bound on the longest document); got {max_seqlen!r}")


__all__ = ["IMPLS", "softmax_attention", "softmax_attention_naive"]
