"""tools/generate.py end to end: a real (3-step) trained run, then sampling from its checkpoint."""
import subprocess
import sys

import pytest

from launching import REPO, launch, tiny_overrides

pytestmark = pytest.mark.dist


def test_generate_cli_on_a_trained_run(lm_data, tmp_path):
    run = tmp_path / "run"
    launch(tiny_overrides(lm_data, run, train__max_steps=3, schedule__warmup_steps=1, checkpoint__every=3,
                          log__val_every=100, model__layer_pattern="[linear,softmax]"))
    result = subprocess.run([sys.executable, "tools/generate.py", "--run", str(run), "--prompt", "the cat sees",
                             "--max-new-tokens", "5", "--temperature", "0"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.startswith("the cat sees")
    assert "tok/s" in result.stderr
