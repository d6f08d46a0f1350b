"""The gated delta rule (DeltaNet, Gated DeltaNet): ``S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ``,
``o_t = S_tᵀ q_t``.

The math: docs/MIXERS.md#deltanet. One public entry, ``delta_rule``, checks its inputs once and hands them to an
implementation: ``naive`` (the token-by-token recurrence with the transition as a matrix, the oracle), ``chunk``
(the WY/UT chunked form), ``recurrent`` (rank-1 updates, for decoding) and ``triton`` (the chunked form with its
scan over chunks in Triton, CUDA). Each module exposes
``delta_rule_<impl>(q, k, v, beta, g, *, cu_seqlens, initial_state, output_final_state, chunk_size)`` with the
inputs checked and ``g`` filled in, and returns ``o`` or ``(o, S)``. ``fla`` (``fla.py``: flash-linear-attention's
``chunk_gated_delta_rule``, CUDA) gets ``g`` as given, None included, since fla has a kernel without gates.
``auto`` on CUDA takes ``triton`` once it passed its first-use check, else fla where it is installed and passed its
own, else ``chunk``.
"""
import torch
import torch.nn.functional as F

from ..documents import check_offsets, check_packing
from ..first_use import first_use_ok, sample_inputs
from ..flash_linear import fla_may_run
from .chunk import delta_rule_chunk
from .fla import delta_rule_fla
from .library import delta_rule_op
from .naive import delta_rule_naive
from .recurrent import delta_rule_recurrent
from .state import check_state

try:  # Triton is optional (the gpu extra); without it impl="auto" takes fla or the chunked form
    from .triton import MAX_HEAD_DIM, delta_rule_triton
except ImportError:
    delta_rule_triton = None

IMPLS = ("auto", "naive", "chunk", "recurrent", "triton", "fla")


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None = None,
               *, cu_seqlens: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
               output_final_state: bool = False, chunk_size: int = 64, impl: str = "auto"):
    """The (gated) delta rule over ``q, k [B, T, H, Dk]``, ``v [B, T, H, Dv]``.

    The caller L2-normalizes k (the transition ``I − β k kᵀ`` is then a contraction) and scales q as it likes.
    beta ``[B, T, H]`` in (0, 1): how far each token moves the state's prediction for its key to its value.
    g ``[B, T, H]``: the log of the decay α (≤ 0), or None for α = 1 (DeltaNet).
    cu_seqlens: int offsets of packed documents along T (B = 1); each document starts from its own state.
    initial_state ``[N, H, Dk, Dv]`` (N = batch, or documents): the state before the first token (None: zeros).
    This is flash-linear-attention's ``chunk_gated_delta_rule`` (state k × v, ``o_t = S_tᵀ q_t``) without its
    built-in ``Dk^-1/2`` scale of q. Returns ``o`` in the input dtype, or ``(o, final_state)`` in fp32 (fp64 for
    fp64 inputs).
    impl: ``auto`` (on CUDA ``triton``, or fla where ours cannot run, each once it passed its first-use check;
    else ``chunk``), ``naive``, ``chunk``, ``recurrent``, ``triton`` (CUDA; fp32, bf16, fp16) or ``fla``
    (flash-linear-attention's kernels, CUDA).
    """
    _check_inputs(q, k, v, beta, g, cu_seqlens, chunk_size, impl)
    if torch.compiler.is_compiling():  # one opaque op (library.py) whose body comes back here, eagerly
        return delta_rule_op(q, k, v, beta, g, cu_seqlens=cu_seqlens, initial_state=initial_state,
                             output_final_state=output_final_state, chunk_size=chunk_size, impl=impl)
    num = q.shape[0]
    if cu_seqlens is not None:
        num = check_offsets(cu_seqlens, q.shape[1])
    if initial_state is not None:
        check_state(initial_state, num, q.shape[2], q.shape[3], v.shape[3])
    if impl == "auto":
        impl = _auto(q, v, g is not None, cu_seqlens, chunk_size)
    if impl == "triton" and delta_rule_triton is None:
        raise ValueError("impl='triton' needs the triton package (pip install -e '.[gpu]')")
    if impl == "fla":
        return delta_rule_fla(q, k, v, beta, g, cu_seqlens=cu_seqlens, initial_state=initial_state,
                              output_final_state=output_final_state, chunk_size=chunk_size)
    if g is None:
        g = beta.new_zeros(beta.shape)
    run = {"naive": delta_rule_naive, "chunk": delta_rule_chunk, "recurrent": delta_rule_recurrent,
           "triton": delta_rule_triton}[impl]
    return run(q, k, v, beta, g, cu_seqlens=cu_seqlens, initial_state=initial_state,
               output_final_state=output_final_state, chunk_size=chunk_size)


def _auto(q, v, gated, cu_seqlens, chunk_size) -> str:
    """``auto``'s choice: our kernel where it runs and matched the chunked form on this device, else fla's under the
    same terms, else the chunked form."""
    if _triton_may_run(q, v) and _trusted("triton", q, v, gated, cu_seqlens, chunk_size):
        return "triton"
    if fla_may_run(q) and _trusted("fla", q, v, gated, cu_seqlens, chunk_size):
        return "fla"
    return "chunk"


def _triton_may_run(q, v) -> bool:
    """Whether ``auto`` may consider our Triton form at all: CUDA, a dtype and head widths it takes, Triton there."""
    return (q.is_cuda and q.dtype in (torch.float32, torch.bfloat16, torch.float16) and delta_rule_triton is not None
            and max(q.shape[3], v.shape[3]) <= MAX_HEAD_DIM)


def _trusted(impl, q, v, gated, cu_seqlens, chunk_size) -> bool:
    """``impl``'s first-use check (``ops/first_use.py``) for this device, dtype and request class: three of fla's
    chunks of two heads of the request's widths, k L2-normalized, an initial state in and the final state out
    (folded into the compared output), a document boundary inside a chunk when the request packs them. Nothing is
    made on the device once the class has its verdict (each copy there waits for it)."""
    heads, dk, dv = min(q.shape[2], 2), q.shape[3], v.shape[3]
    length, packed = 2 * 64 + 5, cu_seqlens is not None
    key = (f"delta_rule_{impl}", str(q.device), q.dtype, dk, dv, gated, packed, chunk_size)
    num = 2 if packed else 1
    shapes = [(1, length, heads, dk)] * 2 + [(1, length, heads, dv), (num, heads, dk, dv)] + [(1, length, heads)] * (
        2 if gated else 1)  # beta, and the forgetting -g where gated: every input must reach the output

    def inputs():
        return sample_inputs(shapes, like=q, positive=(False, False, False, False, True, True))

    def run(impl):
        def call(q, k, v, S, beta, *forget):
            cu = torch.tensor([0, 37, length], device=q.device) if packed else None
            o, final = delta_rule(q * dk ** -0.5, F.normalize(k, dim=-1), v, beta, -forget[0] if gated else None,
                                  cu_seqlens=cu, initial_state=S, output_final_state=True, chunk_size=chunk_size,
                                  impl=impl)
            return torch.cat([o.flatten(), final.flatten().to(o.dtype)])
        return call

    kernel_name = "our Triton delta-rule scan" if impl == "triton" else "flash-linear-attention's " + (
        "chunk_gated_delta_rule" if gated else "delta-rule kernel")
    return first_use_ok(key, run(impl), run("chunk"), inputs, kernel_name=kernel_name,
                        reference_name="the chunked form (impl='chunk')")


def _check_inputs(q, k, v, beta, g, cu_seqlens, chunk_size, impl):
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
    if q.dim() != 4 or q.shape != k.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"delta_rule wants q, k [B, T, H, Dk] and v [B, T, H, Dv]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    for name, x in (("beta", beta), ("g", g)):
        if x is not None and tuple(x.shape) != tuple(q.shape[:3]):
            raise ValueError(f"delta_rule wants {name} [B, T, H] = {tuple(q.shape[:3])}; got {tuple(x.shape)}")
    if q.shape[1] == 0:
        raise ValueError("delta_rule got an empty sequence (T = 0)")
    floats = [x for x in (q, k, v, beta, g) if x is not None]
    if not all(x.is_floating_point() for x in floats) or len({x.dtype for x in (q, k, v)}) != 1:
        raise ValueError(f"q, k, v must share one floating dtype and beta, g be floating; got "
                         f"{[x.dtype for x in floats]}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}")
    check_packing(q.shape[0], cu_seqlens)


__all__ = ["delta_rule", "delta_rule_naive", "IMPLS"]
