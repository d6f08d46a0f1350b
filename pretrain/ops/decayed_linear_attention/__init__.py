"""Decayed linear attention: ``S_t = exp(g_t) S_{t−1} + k_t v_tᵀ``, ``o_t = q_tᵀ S_t`` (docs/MIXERS.md#decay).

The state forgets at a rate given in log space, ``g ≤ 0``: a constant per head ``[H]`` (RetNet, Lightning
Attention) or a gate per token and head ``[B, T, H]`` (Mamba-2, simple GLA), applied at token t before k_t v_tᵀ is
added — flash-linear-attention's ``chunk_simple_gla`` convention without its scale, so one can be checked against the
other. A sibling of ``ops.linear_attention``: it shares that family's state type, its normalization-by-augmented-v
(``normalize.py``), its packed-document layout (``Chunks``) and runs (``runs.py``).

One public entry, ``decayed_linear_attention``, checks its inputs once and hands them to ``naive`` (the O(T²)
definition with the decay matrix, the oracle), ``chunk`` (chunked parallel form), ``recurrent`` (token by
token, for decoding), ``triton`` (our kernels, CUDA: ``triton.py``) or ``fla`` (flash-linear-attention's
``chunk_simple_gla``, CUDA, ``normalize="none"``: ``fla.py``). ``auto`` on CUDA takes ours once it has passed its
first-use check, fla where ours cannot run (Triton missing, or its check failed), fla is installed, the request fits
it and fla passed its own check; on CPU, and otherwise, ``chunk``. Each
exposes ``decayed_linear_attention_<impl>(q, k, v, g, *, normalize, eps, cu_seqlens,
initial_state, output_final_state, chunk_size)`` with g already ``[B, T, H]``.
"""
import torch

from ..first_use import first_use_ok, sample_inputs
from ..flash_linear import fla_may_run
from ..documents import check_offsets
from ..linear_attention import check_inputs, trusted_whole_and_cut
from ..linear_attention.state import LinearAttentionState, check_state
from .chunk import decayed_linear_attention_chunk
from .fla import decayed_linear_attention_fla
from .library import decayed_linear_attention_op
from .naive import decayed_linear_attention_naive
from .recurrent import decayed_linear_attention_recurrent

try:  # Triton is optional (the gpu extra)
    from .triton import decayed_linear_attention_triton
except ImportError:
    decayed_linear_attention_triton = None

NORMALIZATIONS = ("none", "divisive")
IMPLS = ("auto", "naive", "chunk", "recurrent", "triton", "fla")
_RUN = {"naive": decayed_linear_attention_naive, "chunk": decayed_linear_attention_chunk,
        "recurrent": decayed_linear_attention_recurrent, "triton": decayed_linear_attention_triton,
        "fla": decayed_linear_attention_fla}
_KERNEL_NAMES = {"triton": "the Triton decayed linear-attention kernel",
                 "fla": "flash-linear-attention's chunk_simple_gla"}


def decayed_linear_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *, normalize: str = "none",
    eps: float = 1e-6, cu_seqlens: torch.Tensor | None = None, initial_state: LinearAttentionState | None = None,
    output_final_state: bool = False, chunk_size: int = 64, impl: str = "auto",
):
    """Causal decayed linear attention over q, k ``[B, T, H, D]`` (already feature-mapped and scaled), v
    ``[B, T, H, Dv]`` and the log-decay g ``[H]`` or ``[B, T, H]`` (finite, ≤ 0).

    normalize: ``none`` (q_tᵀS_t) or ``divisive`` (q_tᵀS_t / (q_t·z_t + eps), with ``z_t = exp(g_t) z_{t−1} + k_t``
    decaying as S does). cu_seqlens: int offsets of packed documents along T (B = 1); each document starts from
    its own initial state (zeros by default) and its decay starts there. initial_state / output_final_state: a
    ``LinearAttentionState`` (S, and z when divisive) per sequence or document. Returns ``o`` in the input dtype,
    or ``(o, final_state)`` with an fp32 state (fp64 for fp64 inputs).
    impl: ``auto`` (on CUDA ours, else fla, each once it passed its first-use check; else ``chunk``), ``naive``,
    ``chunk``, ``recurrent``, ``triton`` (CUDA, or CPU under ``TRITON_INTERPRET=1``) or ``fla``
    (flash-linear-attention's ``chunk_simple_gla``; CUDA, normalize none).
    """
    if normalize == "subtractive":
        raise ValueError("normalize='subtractive' does not combine with decay: InLine's correction divides by the "
                         "count of tokens seen and subtracts their plain mean, which a decaying state no longer "
                         f"holds; use one of {NORMALIZATIONS}")
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS} for decayed_linear_attention; got {normalize!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
    check_inputs(q, k, v, normalize, cu_seqlens, chunk_size, "auto")  # impl checked above, against this op's list
    if torch.compiler.is_compiling():  # one opaque op (library.py) whose body comes back here, eagerly
        return decayed_linear_attention_op(q, k, v, g, normalize=normalize, eps=eps, cu_seqlens=cu_seqlens,
                                           initial_state=initial_state, output_final_state=output_final_state,
                                           chunk_size=chunk_size, impl=impl)
    g = _checked_decay(g, q)
    if cu_seqlens is not None:
        check_offsets(cu_seqlens, q.shape[1])
    if initial_state is not None:
        num = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        initial_state = check_state(initial_state, num, q.shape[2], q.shape[3], v.shape[3], normalize)
    if impl == "auto":
        impl = _automatic(q, v, normalize, cu_seqlens, chunk_size)
    if impl == "triton" and decayed_linear_attention_triton is None:
        raise ValueError("impl='triton' needs the triton package (pip install -e '.[gpu]')")
    run = _RUN[impl]
    return run(q, k, v, g, normalize=normalize, eps=eps, cu_seqlens=cu_seqlens, initial_state=initial_state,
               output_final_state=output_final_state, chunk_size=chunk_size)


def _automatic(q, v, normalize, cu_seqlens, chunk_size) -> str:
    """``auto``'s choice: ours on CUDA, then fla, each only once trusted; else the chunked form."""
    if _triton_may_run(q) and _trusted("triton", q, v, normalize, cu_seqlens, chunk_size):
        return "triton"
    if normalize == "none" and fla_may_run(q) and _trusted("fla", q, v, normalize, cu_seqlens, chunk_size):
        return "fla"
    return "chunk"


def _triton_may_run(q) -> bool:
    """Whether ``auto`` may consider our kernel at all: CUDA, a dtype it takes, Triton installed."""
    return q.is_cuda and q.dtype != torch.float64 and decayed_linear_attention_triton is not None


def _trusted(impl, q, v, normalize, cu_seqlens, chunk_size) -> bool:
    """A kernel's first-use check (``ops/first_use.py``) for this device, dtype and request class: three chunks of
    64 tokens (fla's) and a few more, two heads of the request's widths, per-token decay, an initial state in and the
    final state out (folded into the compared output), a document boundary inside a chunk when the request packs
    them."""
    heads, dk, dv = min(q.shape[2], 2), q.shape[3], v.shape[3]
    length, packed, divisive = 2 * 64 + 5, cu_seqlens is not None, normalize == "divisive"
    key = (f"decayed_linear_attention_{impl}", str(q.device), q.dtype, dk, dv, normalize, packed, chunk_size)
    cu = torch.tensor([0, 37, length], device=q.device) if packed else None
    num = 2 if packed else 1
    shapes = [(1, length, heads, dk)] * 2 + [(1, length, heads, dv), (1, length, heads), (num, heads, dk, dv)]
    positive = (True, True, False, True, False, True)  # q, k, v, −g, S, z
    inputs = sample_inputs(shapes + [(num, heads, dk)] * divisive, like=q, positive=positive)

    def run(impl):
        def call(q, k, v, forget, *state):
            o, final = decayed_linear_attention(q, k, v, -forget, normalize=normalize, cu_seqlens=cu,
                                                initial_state=LinearAttentionState(*state), output_final_state=True,
                                                chunk_size=chunk_size, impl=impl)
            return torch.cat([o.flatten(), *(f.flatten().to(o.dtype) for f in final if f is not None)])
        return call

    check = trusted_whole_and_cut if impl == "triton" else first_use_ok  # ours cuts long documents; fla never
    return check(key, run(impl), run("chunk"), inputs, kernel_name=_KERNEL_NAMES[impl],
                 reference_name="the chunked form (impl='chunk')")


def _checked_decay(g: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """g as ``[B, T, H]``, refusing a shape, dtype or value that is not a log-decay."""
    batch, length, heads, _ = q.shape
    if not isinstance(g, torch.Tensor) or not g.is_floating_point():
        raise ValueError(f"g (the log-decay) must be a floating tensor; got {getattr(g, 'dtype', type(g).__name__)}")
    if tuple(g.shape) not in ((heads,), (batch, length, heads)):
        raise ValueError(f"g (the log-decay) must be [H] = [{heads}] or [B, T, H] = [{batch}, {length}, {heads}]; "
                         f"got {tuple(g.shape)}")
    values = g.detach()  # a check: no graph (isfinite's abs would record one, saving g)
    message = "g is a log-decay: every value must be finite and ≤ 0 (exp(g) in (0, 1])"
    try:  # on CPU at once; on a GPU on the device, which fails a later launch: reading it here would wait per layer
        torch._assert_async(((values <= 0) & (values > float("-inf"))).all(), message)
    except RuntimeError as err:
        raise ValueError(f"{message}; got min {values.min().item():.3g}, max {values.max().item():.3g}") from err
    return g.expand(batch, length, heads)


__all__ = ["decayed_linear_attention", "LinearAttentionState", "NORMALIZATIONS", "IMPLS"]
