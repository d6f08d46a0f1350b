"""Diagonal-plus-low-rank transitions (Kimi Delta Attention, RWKV-7; flash-linear-attention's generalized delta
rule): ``S_t = (Diag(e^{g_t}) + a_t b_tᵀ) S_{t−1} + k_t v_tᵀ``, ``o_t = S_tᵀ q_t``.

The math: docs/MIXERS.md#dplr. One public entry, ``dplr_delta_rule``, checks its inputs once and hands them to an
implementation: ``naive`` (the transition as a matrix, token by token: the oracle), ``chunk`` (the UT chunked form,
per-channel log-decays masked before ``exp``) and ``recurrent`` (rank-1 updates, for decoding), each
``dplr_<impl>(q, k, v, a, b, g, *, cu_seqlens, initial_state, output_final_state, chunk_size)`` with ``g`` filled
in. The gated delta rule is the case ``g`` equal over channels, ``a = −β k``, ``b = e^g k``, keys ``β k``.

``kda_delta_rule`` is Kimi Delta Attention's case, ``a = −β k``, ``b = e^g ⊙ k``, keys ``β k`` from ``k``, β and
``g``: the same forms, the chunked one computing two products per chunk instead of four. Both have ``triton`` (the
chunked form in Triton, CUDA: KDA's ``triton.py``, the general rule's ``triton_general.py`` on KDA's kernels), which
``auto`` takes on CUDA once it passed its first-use check.
"""
import torch
import torch.nn.functional as F

from ..delta_rule.state import check_state
from ..documents import check_offsets, check_packing
from ..first_use import first_use_ok, sample_inputs
from .chunk import dplr_chunk, kda_chunk
from .library import dplr_delta_rule_op, kda_delta_rule_op
from .naive import dplr_naive
from .recurrent import dplr_recurrent

try:  # Triton is optional (the gpu extra); without it impl="auto" takes the chunked form
    from .triton import MAX_HEAD_DIM, kda_triton
    from .triton_general import dplr_triton
except ImportError:
    kda_triton = dplr_triton = None

IMPLS = ("auto", "naive", "chunk", "recurrent", "triton")


def dplr_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    g: torch.Tensor | None = None, *, cu_seqlens: torch.Tensor | None = None,
                    initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                    chunk_size: int = 64, impl: str = "auto"):
    """The diagonal-plus-low-rank rule over ``q, k, a, b [B, T, H, Dk]``, ``v [B, T, H, Dv]``.

    Each token decays the state per key channel by ``e^{g_t}``, reads it along ``b_t`` (before the decay), writes
    what it read along ``a_t``, and adds ``k_t v_tᵀ``: ``S_t = Diag(e^{g_t}) S_{t−1} + a_t (b_tᵀ S_{t−1}) + k_t v_tᵀ``.
    g ``[B, T, H, Dk]``: the log-decay, ≤ 0 (the chunked form relies on it), or None for none. The caller keeps the
    transition a contraction (the mixers L2-normalize the keys a and b are made of).
    cu_seqlens: int offsets of packed documents along T (B = 1); each document starts from its own state.
    initial_state ``[N, H, Dk, Dv]`` (N = batch, or documents): the state before the first token (None: zeros).
    Returns ``o`` in the input dtype, or ``(o, final_state)`` in fp32 (fp64 for fp64 inputs).
    impl: ``auto``, ``naive``, ``chunk``, ``recurrent`` or ``triton`` (CUDA; fp32, bf16, fp16): ``auto`` on CUDA
    takes ``triton`` once it passed its first-use check, else ``chunk``.
    """
    _check_inputs(q, k, v, a, b, g, cu_seqlens, chunk_size, impl)
    if torch.compiler.is_compiling():  # one opaque op (library.py) whose body comes back here, eagerly
        return dplr_delta_rule_op(q, k, v, a, b, g, cu_seqlens=cu_seqlens, initial_state=initial_state,
                                  output_final_state=output_final_state, chunk_size=chunk_size, impl=impl)
    _check_state(q, v, cu_seqlens, initial_state)
    if g is None:
        g = q.new_zeros(q.shape)
    if impl == "auto":
        impl = "triton" if _triton_may_run(q, v) and _trusted(dplr_delta_rule, q, v, cu_seqlens, chunk_size) \
            else "chunk"
    run = _triton_form(dplr_triton) if impl == "triton" else {
        "chunk": dplr_chunk, "naive": dplr_naive, "recurrent": dplr_recurrent}[impl]
    return run(q, k, v, a, b, g, cu_seqlens=cu_seqlens, initial_state=initial_state,
               output_final_state=output_final_state, chunk_size=chunk_size)


def kda_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, *,
                   cu_seqlens: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                   output_final_state: bool = False, chunk_size: int = 64, impl: str = "auto"):
    """Kimi Delta Attention's rule, ``S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t−1} + β_t k_t v_tᵀ``: β ``[B, T, H]``,
    g ``[B, T, H, Dk]`` (≤ 0), k L2-normalized by the caller; otherwise as ``dplr_delta_rule``, whose impls it takes,
    and ``triton`` (CUDA; fp32, bf16, fp16): ``auto`` on CUDA takes it once it passed its first-use check, else
    ``chunk``."""
    if tuple(beta.shape) != tuple(q.shape[:3]):
        raise ValueError(f"kda_delta_rule wants beta [B, T, H] = {tuple(q.shape[:3])}; got {tuple(beta.shape)}")
    if torch.compiler.is_compiling():  # one opaque op (library.py) whose body comes back here, eagerly
        return kda_delta_rule_op(q, k, v, beta, g, cu_seqlens=cu_seqlens, initial_state=initial_state,
                                 output_final_state=output_final_state, chunk_size=chunk_size, impl=impl)
    write = beta[..., None].to(k.dtype) * k
    if impl in ("naive", "recurrent"):  # the general forms, on the transition written out
        return dplr_delta_rule(q, write, v, -write, g.exp().to(k.dtype) * k, g, cu_seqlens=cu_seqlens,
                               initial_state=initial_state, output_final_state=output_final_state,
                               chunk_size=chunk_size, impl=impl)
    _check_inputs(q, k, v, write, write, g, cu_seqlens, chunk_size, impl)
    _check_state(q, v, cu_seqlens, initial_state)
    if impl == "auto":
        impl = "triton" if _triton_may_run(q, v) and _trusted(kda_delta_rule, q, v, cu_seqlens, chunk_size) \
            else "chunk"
    if impl == "triton":
        return _triton_form(kda_triton)(q, k, v, beta, g, cu_seqlens=cu_seqlens, initial_state=initial_state,
                          output_final_state=output_final_state, chunk_size=chunk_size)
    return kda_chunk(q, k, v, beta.to(k.dtype), g, cu_seqlens=cu_seqlens, initial_state=initial_state,
                     output_final_state=output_final_state, chunk_size=chunk_size)


def _triton_form(run):
    """``run`` (a Triton form), or a clear error where Triton is not installed (``run`` None)."""
    if run is None:
        raise ValueError("impl='triton' needs the triton package (pip install -e '.[gpu]')")
    return run


def _triton_may_run(q, v) -> bool:
    """Whether ``auto`` may consider a Triton form at all: CUDA, a dtype and head widths it takes, Triton there."""
    return (q.is_cuda and q.dtype in (torch.float32, torch.bfloat16, torch.float16) and kda_triton is not None
            and max(q.shape[3], v.shape[3]) <= MAX_HEAD_DIM)


def _trusted(op, q, v, cu_seqlens, chunk_size) -> bool:
    """The Triton form's first-use check (``ops/first_use.py``) of ``op`` (``kda_delta_rule`` or
    ``dplr_delta_rule``) for this device, dtype and request class, as the delta rule's: three chunks of two heads of
    the request's widths, gates per channel, an initial state in and the final state out (folded into the compared
    output), a document boundary inside a chunk when the request packs them. KDA's: k L2-normalized; the general
    rule's: RWKV-7's transition, ``a = −η ⊙ κ̂``, ``b = κ̂`` (κ̂ L2-normalized), keys of their own."""
    general = op is dplr_delta_rule
    heads, dk, dv = min(q.shape[2], 2), q.shape[3], v.shape[3]
    length, packed = 2 * 64 + 5, cu_seqlens is not None
    key = ("dplr_triton" if general else "kda_triton", str(q.device), q.dtype, dk, dv, packed, chunk_size)
    rates = (1, length, heads, dk) if general else (1, length, heads)  # η per channel, or β
    shapes = [(1, length, heads, dk)] * 2 + [(1, length, heads, dv), (2 if packed else 1, heads, dk, dv), rates,
                                             (1, length, heads, dk)]

    def inputs():
        return sample_inputs(shapes, like=q, positive=(False, False, False, False, True, True))

    def run(impl):
        def call(q, k, v, S, rate, forget):
            cu = torch.tensor([0, 37, length], device=q.device) if packed else None
            kappa = F.normalize(k, dim=-1)
            transition = (k * dk ** -0.5, v, -rate * kappa, kappa) if general else (kappa, v, rate)
            o, final = op(q * dk ** -0.5, *transition, -forget, cu_seqlens=cu, initial_state=S,
                          output_final_state=True, chunk_size=chunk_size, impl=impl)
            return torch.cat([o.flatten(), final.flatten().to(o.dtype)])
        return call

    name = "our Triton DPLR form" if general else "our Triton KDA form"
    return first_use_ok(key, run("triton"), run("chunk"), inputs, kernel_name=name,
                        reference_name="the chunked form (impl='chunk')")


def _check_state(q, v, cu_seqlens, initial_state):
    num = q.shape[0]
    if cu_seqlens is not None:
        num = check_offsets(cu_seqlens, q.shape[1])
    if initial_state is not None:
        check_state(initial_state, num, q.shape[2], q.shape[3], v.shape[3])


def _check_inputs(q, k, v, a, b, g, cu_seqlens, chunk_size, impl):
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
    if q.dim() != 4 or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"dplr_delta_rule wants q [B, T, H, Dk] and v [B, T, H, Dv]; got q {tuple(q.shape)}, "
                         f"v {tuple(v.shape)}")
    for name, x in (("k", k), ("a", a), ("b", b), ("g", g)):
        if x is not None and x.shape != q.shape:
            raise ValueError(f"dplr_delta_rule wants {name} [B, T, H, Dk] = {tuple(q.shape)}; got {tuple(x.shape)}")
    if q.shape[1] == 0:
        raise ValueError("dplr_delta_rule got an empty sequence (T = 0)")
    floats = [x for x in (q, k, v, a, b, g) if x is not None]
    if not all(x.is_floating_point() for x in floats) or len({x.dtype for x in (q, k, v, a, b)}) != 1:
        raise ValueError(f"q, k, v, a, b must share one floating dtype and g be floating; got "
                         f"{[x.dtype for x in floats]}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}")
    check_packing(q.shape[0], cu_seqlens)


__all__ = ["dplr_delta_rule", "kda_delta_rule", "IMPLS"]
