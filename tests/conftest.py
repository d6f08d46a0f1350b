"""Shared fixtures. `shared_data`: the real data sets in ../shared/data, skipping the test where they are absent.

Without a GPU, Triton kernels run under its CPU interpreter. ``TRITON_INTERPRET`` is read when Triton is first
imported, and torch imports it on the way (``torch.utils.flop_counter`` does): so it is set here, before any test
module is collected, not in the Triton tests themselves.
"""
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SHARED_DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data not present at {SHARED_DATA}")
    return SHARED_DATA
