"""First-use checks: ``impl="auto"`` trusts a kernel on a device only after it has matched a reference there.

Our Triton kernels have passed their tests on one GPU so far (an H200, benchmarks/gpu_h200.md); flash-attn has run
on none, and fla refused its gated backward there (its own guard against that image's Triton 3.6). So the first
time ``auto`` would choose such a kernel for a request (the kernel, the device, the dtype and the request's shape
class), a small input goes through the kernel and through a reference form on the same device, forward and input
gradients, and the two are compared. A mismatch or an error warns once, naming both forms and the measured error,
and ``auto`` keeps to the reference form for that request class for the rest of the process. A kernel asked for by
name (``impl="triton"``) is never checked: the caller chose it.

The check draws its inputs from its own generator, so it consumes nothing of the training run's random streams.
"""
import warnings
from collections.abc import Callable, Sequence

import torch

from .custom_ops import recording_autograd

# Relative error (‖got − want‖ / ‖want‖) a correct kernel stays under, by the kernel's dtype. The reference runs in
# fp32 at least; fp32 kernels may multiply in TF32 on a GPU (~1e-3); bf16 has 8 bits of mantissa (~4e-3 per rounding).
TOLERANCE = {torch.float64: 1e-8, torch.float32: 5e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}

_verdicts: dict[tuple, bool] = {}


def first_use_ok(key: tuple, kernel: Callable[..., torch.Tensor], reference: Callable[..., torch.Tensor],
                 inputs: Sequence[torch.Tensor] | Callable[[], Sequence[torch.Tensor]], *, kernel_name: str,
                 reference_name: str) -> bool:
    """Whether ``kernel(*inputs)`` matches ``reference(*inputs)`` (the output and the gradient of every input)
    within ``TOLERANCE`` of the inputs' dtype; decided once per ``key`` and remembered for the process.

    ``inputs`` are small tensors on the device and in the dtype of the request (the check makes its own leaves),
    or a function that makes them, called only when ``key`` is new: copying them to a GPU waits for it, which a
    caller asking on every layer of every step should not pay. The reference gets them upcast to fp32 when they
    are narrower.
    """
    if key not in _verdicts:
        inputs = inputs() if callable(inputs) else inputs
        problem = _compare(kernel, reference, inputs)
        _verdicts[key] = problem is None
        if problem is not None:
            device, dtype = inputs[0].device, inputs[0].dtype
            warnings.warn(f"{kernel_name} failed its first-use check on {device} in {str(dtype)[6:]} ({problem}); "
                          f"impl='auto' uses {reference_name} instead for the rest of this run", RuntimeWarning,
                          stacklevel=3)
    return _verdicts[key]


def forget_verdicts() -> None:
    """Drop every remembered verdict (tests; a process that changed its kernels)."""
    _verdicts.clear()


def sample_inputs(shapes: Sequence[tuple[int, ...]], *, like: torch.Tensor, positive: Sequence[bool] = (),
                 seed: int = 0) -> list[torch.Tensor]:
    """Random tensors of ``shapes`` on ``like``'s device and dtype, from a private generator (uniform in [0, 1)
    where ``positive[i]``, as features after φ are; standard normal elsewhere)."""
    gen = torch.Generator().manual_seed(seed)
    made = []
    for i, shape in enumerate(shapes):
        sample = torch.rand if i < len(positive) and positive[i] else torch.randn
        made.append(sample(shape, generator=gen, dtype=torch.float64).to(device=like.device, dtype=like.dtype))
    return made


def _compare(kernel, reference, inputs) -> str | None:
    """None if the kernel agrees with the reference; else what differed (or what it raised)."""
    dtype = inputs[0].dtype
    wide = torch.promote_types(dtype, torch.float32)
    try:
        with recording_autograd():  # also where a compiled model's first call comes from: inside a custom op
            mine = [x.detach().clone().requires_grad_() for x in inputs]
            theirs = [x.detach().to(wide).requires_grad_() for x in inputs]
            got, want = kernel(*mine), reference(*theirs)
            upstream = sample_inputs([tuple(want.shape)], like=want, seed=1)[0]
            got_grads = torch.autograd.grad(got, mine, upstream.to(got.dtype))
            want_grads = torch.autograd.grad(want, theirs, upstream)
    except Exception as err:  # any failure of an unproven kernel means: do not use it
        return f"it raised {type(err).__name__}: {err}"
    tolerance = TOLERANCE[dtype]
    names = ["output"] + [f"gradient of input {i}" for i in range(len(inputs))]
    for name, a, b in zip(names, [got, *got_grads], [want, *want_grads]):
        if a.shape != b.shape:
            return f"{name} has shape {tuple(a.shape)}, expected {tuple(b.shape)}"
        a, b = a.detach().double(), b.detach().double()
        if not torch.isfinite(a).all():
            return f"{name} is not finite"
        error = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        if error > tolerance:
            return f"{name} off by {error:.2g} relative, tolerance {tolerance:g}"
    return None
