"""Linear attention: ``o_t = φ(q_t)ᵀ S_t``, normalized, with a state carried across calls.

The math: docs/MIXERS.md#linear, #inline (subtractive) and #chunked (the chunked form).

One public entry, ``linear_attention``, checks its inputs once and hands them to an implementation:
``naive`` (the O(T²) definition, the oracle), ``chunk`` (chunked parallel form, CPU/CUDA), ``recurrent``
(token by token, for decoding) and ``triton`` (CUDA kernels). Every implementation module exposes
``linear_attention_<impl>(q, k, v, *, causal, normalize, eps, cu_seqlens, initial_state, output_final_state,
chunk_size)`` with the inputs already checked, and returns ``o`` or ``(o, LinearAttentionState)``.

Under ``torch.compile`` the same entry becomes one opaque ``torch.ops.pretrain.linear_attention`` node
(``library.py``) whose body is this function again, run eagerly: the compiler never traces the implementations'
Python loops or ``cu_seqlens.tolist()``, and eager code keeps the direct call (the op's backward recomputes the
forward, a price worth paying only where the compiler needs it).
"""
import torch

from ..documents import check_offsets, check_packing
from ..first_use import first_use_ok, sample_inputs
from .chunk import linear_attention_chunk
from .library import linear_attention_op
from .naive import linear_attention_naive
from .recurrent import linear_attention_recurrent
from .state import FIELDS, LinearAttentionState, check_state

try:  # Triton is optional (the gpu extra); without it impl="auto" takes the chunked form
    from .triton import linear_attention_triton, segments_forced
except ImportError:
    linear_attention_triton = segments_forced = None

NORMALIZATIONS = tuple(FIELDS)
IMPLS = ("auto", "naive", "chunk", "recurrent", "triton")


def linear_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, normalize: str = "divisive",
    eps: float = 1e-6, cu_seqlens: torch.Tensor | None = None, initial_state: LinearAttentionState | None = None,
    output_final_state: bool = False, chunk_size: int = 64, impl: str = "auto",
):
    """Linear attention over ``[B, T, H, D]`` (q, k already feature-mapped; v ``[B, T, H, Dv]``).

    normalize: ``none`` (φ(q)ᵀS), ``divisive`` (φ(q)ᵀS / (φ(q)·z + eps)) or ``subtractive``
    (InLine, docs/MIXERS.md#inline; ``eps`` unused: the count n_t is at least 1).
    causal: prefix sums (inclusive) or, when False, the sums over the whole sequence (or document).
    cu_seqlens: int offsets of packed documents along T (B = 1); each document starts from its own state.
    initial_state / output_final_state: a ``LinearAttentionState`` per sequence (or per document), so a long
    sequence can be processed in pieces and decoding can continue from a prefix.
    Returns ``o`` in the input dtype, or ``(o, final_state)`` with an fp32 state.
    """
    check_inputs(q, k, v, normalize, cu_seqlens, chunk_size, impl)
    if torch.compiler.is_compiling():
        return linear_attention_op(q, k, v, causal=causal, normalize=normalize, eps=eps, cu_seqlens=cu_seqlens,
                                   initial_state=initial_state, output_final_state=output_final_state,
                                   chunk_size=chunk_size, impl=impl)
    if cu_seqlens is not None:
        check_offsets(cu_seqlens, q.shape[1])
    if initial_state is not None:
        num = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        initial_state = check_state(initial_state, num, q.shape[2], q.shape[3], v.shape[3], normalize)
    if impl == "auto":
        impl = "triton" if _triton_may_run(q) and _triton_trusted(q, v, causal, normalize, cu_seqlens, chunk_size) \
            else "chunk"
    if impl == "triton" and linear_attention_triton is None:
        raise ValueError("impl='triton' needs the triton package (pip install -e '.[gpu]')")
    run = {"naive": linear_attention_naive, "chunk": linear_attention_chunk, "recurrent": linear_attention_recurrent,
           "triton": linear_attention_triton}[impl]
    return run(q, k, v, causal=causal, normalize=normalize, eps=eps, cu_seqlens=cu_seqlens,
               initial_state=initial_state, output_final_state=output_final_state, chunk_size=chunk_size)


def _triton_may_run(q) -> bool:
    """Whether ``auto`` may consider the Triton kernel at all: CUDA, a dtype it takes, the package installed."""
    return q.is_cuda and q.dtype != torch.float64 and linear_attention_triton is not None


def _triton_trusted(q, v, causal, normalize, cu_seqlens, chunk_size) -> bool:
    """The kernel's first-use check (``ops/first_use.py``) for this device, dtype and request class: a few chunks
    of two heads of the request's widths, with a document boundary inside a chunk when the request packs them."""
    heads, dk, dv = min(q.shape[2], 2), q.shape[3], v.shape[3]
    length = 2 * chunk_size + 5
    packed = cu_seqlens is not None
    key = ("linear_attention_triton", str(q.device), q.dtype, dk, dv, causal, normalize, packed, chunk_size)
    inputs = sample_inputs([(1, length, heads, dk)] * 2 + [(1, length, heads, dv)], like=q, positive=(True, True))
    cu = torch.tensor([0, chunk_size // 2 + 1, length], device=q.device) if packed else None

    def run(impl):
        return lambda q, k, v: linear_attention(q, k, v, causal=causal, normalize=normalize, cu_seqlens=cu,
                                                chunk_size=chunk_size, impl=impl)

    return trusted_whole_and_cut(key, run("triton"), run("chunk"), inputs,
                                 kernel_name="the Triton linear-attention kernel",
                                 reference_name="the chunked form (impl='chunk')")


def trusted_whole_and_cut(key, kernel, reference, inputs, *, kernel_name, reference_name) -> bool:
    """``first_use_ok`` for a kernel that cuts long documents into segments (``triton.segment_chunks``): once with
    every document whole, then cut into segments of one chunk (the segmented launches: a sums pass, a running sum,
    slotted and unslotted rows), which the check's small inputs would otherwise never take. Trusted if both pass;
    each verdict, and warning, is its own."""
    def forced(chunks):
        def call(*args):
            with segments_forced(chunks):
                return kernel(*args)
        return call

    return first_use_ok(key + ("whole",), forced(0), reference, inputs, kernel_name=kernel_name,
                        reference_name=reference_name) and \
        first_use_ok(key + ("cut",), forced(1), reference, inputs,
                     kernel_name=f"{kernel_name} (documents cut into segments)", reference_name=reference_name)


def check_inputs(q, k, v, normalize, cu_seqlens, chunk_size, impl):
    """What shapes, dtypes and options show (traceable: no tensor values read)."""
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS}; got {normalize!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
    if q.dim() != 4 or q.shape != k.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"linear_attention wants q, k [B, T, H, D] and v [B, T, H, Dv]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] == 0:
        raise ValueError("linear_attention got an empty sequence (T = 0)")
    if not (q.dtype == k.dtype == v.dtype and q.is_floating_point()):
        raise ValueError(f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not isinstance(chunk_size, int) or chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two; got {chunk_size!r}")
    check_packing(q.shape[0], cu_seqlens)


__all__ = ["linear_attention", "linear_attention_naive", "LinearAttentionState", "NORMALIZATIONS", "IMPLS"]
