"""Every sequence-parallel mixer on N ranks equals the same mixer on whole rows, forward and backward (fp64).

torchrun starts N gloo ranks once per N for all cases; each rank runs its slice. The slices' outputs and input
gradients, laid side by side, and the parameter gradients, summed over ranks, must equal one process's.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sequence_cases import CASES, run_case, run_model

pytestmark = pytest.mark.dist
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def ranks_output(tmp_path_factory):
    """``ranks_output(N)``: every case's per-rank results from one torchrun of N ranks."""
    done = {}

    def get(size: int) -> list[dict]:
        if size not in done:
            out = tmp_path_factory.mktemp(f"sp{size}")
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={size}",
                       str(HERE / "sequence_worker.py"), str(out), ",".join(CASES)]
            result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                                    env=dict(os.environ, OMP_NUM_THREADS="1"))
            assert result.returncode == 0, result.stderr[-4000:]
            done[size] = [torch.load(out / f"rank{r}.pt") for r in range(size)]
        return done[size]

    return get


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", sorted(CASES))
def test_slices_equal_whole_rows(ranks_output, name, size):
    reference = run_case(CASES[name], None)
    ranks = [results[name] for results in ranks_output(size)]
    for key in ("y", "x_grad"):
        joined = torch.cat([r[key] for r in ranks], dim=1)
        torch.testing.assert_close(joined, reference[key], rtol=1e-10, atol=1e-10, msg=f"{name} {key}")
    for key in reference:
        if key.startswith("grad/"):
            summed = sum(r[key] for r in ranks)
            torch.testing.assert_close(summed, reference[key], rtol=1e-10, atol=1e-10, msg=f"{name} {key}")


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("model", ["model", "model_sliced"])
def test_a_model_of_every_mixer_on_slices_equals_whole_rows(ranks_output, size, model):
    """The slices' losses add up to the rows' loss; the parameter gradients, summed over ranks, are the rows'.
    ``model_sliced``: with mini-sequence feed-forwards (5 tokens a slice) and activation checkpointing as well."""
    reference = run_model(None)
    ranks = [results[model] for results in ranks_output(size)]
    torch.testing.assert_close(sum(r["loss"] for r in ranks), reference["loss"], rtol=1e-10, atol=1e-10)
    for key in reference:
        if key.startswith("grad/"):
            summed = sum(r[key] for r in ranks)
            torch.testing.assert_close(summed, reference[key], rtol=1e-10, atol=1e-10, msg=key)
