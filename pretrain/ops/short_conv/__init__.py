"""The short causal depthwise convolution: ``y_t = act(b + Σ_{i<K} w_i ⊙ x_{t−i})`` per channel.

The math: docs/MIXERS.md#short-convolution. One public entry, ``short_conv``, checks its inputs and hands them to
an implementation: ``naive`` (the loop over taps, ``naive.py``: the CPU form and the oracle) or ``triton`` (one
kernel forward and one backward, ``triton.py``: the loop is ~16 launches forward and ~40 backward, and an eager
step on a GPU waits on launches). ``auto`` takes ``triton`` on CUDA once it passed its first-use check
(``ops/first_use.py``), and ``naive`` elsewhere and under ``torch.compile`` (inductor fuses the loop itself; the
Triton form is no custom op the compiler could keep opaque).
"""
import torch

from ..first_use import first_use_ok, sample_inputs
from .naive import ACTIVATIONS, short_conv_naive

try:  # Triton is optional (the gpu extra); without it impl="auto" takes the loop
    from .triton import CONFIG, short_conv_triton
except ImportError:
    short_conv_triton = None

IMPLS = ("auto", "naive", "triton")


def short_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               positions: torch.Tensor | None = None, before: torch.Tensor | None = None,
               activation: str | None = "silu", impl: str = "auto") -> torch.Tensor:
    """``act(b + Σ_{i<K} w[:, i] ⊙ x_{t−i})`` over ``x [B, T, C]`` with ``weight [C, K]`` (``weight[:, i]`` weighs
    ``x_{t−i}``) and ``bias [C]`` or None.

    positions ``[B, T]``: each token's position in its document; a tap that would reach an earlier document is
    dropped (None: each row is one document, continuing from ``before``). before ``[B, K − 1, C]``: the inputs just
    before x, oldest first (a decoding tail, a sequence-parallel halo; None: zeros); its gradient is returned too.
    activation: ``"silu"`` or None. impl: ``auto``, ``naive`` or ``triton`` (CUDA, or CPU under
    ``TRITON_INTERPRET=1``; fp32, bf16, fp16). Returns ``[B, T, C]`` in x's dtype promoted with the others'.
    """
    check_inputs(x, weight, bias, positions=positions, before=before, activation=activation, impl=impl)
    if impl == "auto":
        impl = "triton" if (not torch.compiler.is_compiling() and _triton_may_run(x)
                            and _triton_trusted(x, weight, bias, positions, before, activation)) else "naive"
    if impl == "triton" and short_conv_triton is None:
        raise ValueError("impl='triton' needs the triton package (pip install -e '.[gpu]')")
    run = short_conv_triton if impl == "triton" else short_conv_naive
    return run(x, weight, bias, positions=positions, before=before, activation=activation)


def _triton_may_run(x) -> bool:
    """Whether ``auto`` may consider the Triton form at all: CUDA, a dtype it takes, Triton installed."""
    return x.is_cuda and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and short_conv_triton is not None


def _triton_trusted(x, weight, bias, positions, before, activation) -> bool:
    """The kernel's first-use check (``ops/first_use.py``) for this device, dtype and request class (K, activation,
    bias, packed, a ``before``): two rows of three token blocks, the last partial, and two channel blocks, the
    second partial; when the request packs documents, a one-token document and documents across block boundaries.
    Nothing is made on the device once the class has its verdict."""
    K, packed = weight.shape[1], positions is not None
    key = ("short_conv_triton", str(x.device), x.dtype, K, activation, bias is not None, packed, before is not None)
    block = CONFIG["token_block"]
    length, channels = 2 * block + 5, CONFIG["channel_block"] + 3
    shapes = [(2, length, channels), (channels, K)] + [(channels,)] * (bias is not None) + \
        [(2, K - 1, channels)] * (before is not None)

    def run(impl):
        def call(x, weight, *rest):
            return short_conv(x, weight, rest[0] if bias is not None else None,
                              positions=_check_positions(block, x.device) if packed else None,
                              before=rest[-1] if before is not None else None, activation=activation, impl=impl)
        return call

    return first_use_ok(key, run("triton"), run("naive"), lambda: sample_inputs(shapes, like=x),
                        kernel_name="the Triton short convolution", reference_name="the tap loop (impl='naive')")


def _check_positions(block: int, device) -> torch.Tensor:
    """Positions of the check's two rows of ``2·block + 5`` tokens: row 0 a document continuing from before it
    (``block − 1`` tokens), a one-token document, one from ``block`` across ``2·block``; row 1 a document begun 4
    tokens before the row, across ``block``, then one across ``2·block``."""
    rows = [[range(block - 1), range(1), range(block + 5)], [range(4, block + 6), range(block + 3)]]
    return torch.tensor([[p for document in row for p in document] for row in rows], device=device)


def check_inputs(x, weight, bias=None, *, positions=None, before=None, activation="silu", impl="auto") -> None:
    """What shapes and options show (no tensor values read); errors name the shape expected."""
    if impl not in IMPLS:
        raise ValueError(f"short_conv impl must be one of {IMPLS}; got {impl!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"short_conv activation must be one of {list(ACTIVATIONS)}; got {activation!r}")
    if weight.dim() != 2 or weight.shape[1] < 1:
        raise ValueError(f"short_conv's weight must be [C, K] with K ≥ 1; got {tuple(weight.shape)}")
    channels, reach = weight.shape[0], weight.shape[1] - 1
    if x.dim() != 3 or x.shape[2] != channels:
        raise ValueError(f"short_conv expects x [B, T, {channels}]; got {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (channels,):
        raise ValueError(f"short_conv's bias must be [C] = ({channels},); got {tuple(bias.shape)}")
    if positions is not None and tuple(positions.shape) != tuple(x.shape[:2]):
        raise ValueError(f"short_conv's positions must be [B, T] = {tuple(x.shape[:2])}; got "
                         f"{tuple(positions.shape)}")
    if before is not None and tuple(before.shape) != (x.shape[0], reach, channels):
        raise ValueError(f"short_conv's before must be [B, K − 1, C] = {(x.shape[0], reach, channels)}; "
                         f"got {tuple(before.shape)}")


__all__ = ["short_conv", "short_conv_naive", "check_inputs", "ACTIVATIONS", "IMPLS"]
