"""What the Triton kernels' tests share."""
import pytest
import torch

from pretrain.ops.first_use import forget_verdicts


@pytest.fixture
def unwritten_outputs_are_nan():
    """Deterministic mode fills torch.empty with NaN, so an element of an output, or of a buffer between a kernel's
    sweeps, that no kernel wrote shows as NaN. On CPU only: some CUDA ops around the kernels have no such form."""
    torch.use_deterministic_algorithms(not torch.cuda.is_available())
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.fixture
def fresh_verdicts():
    """No first-use verdict remembered before or after the test."""
    forget_verdicts()
    yield
    forget_verdicts()
