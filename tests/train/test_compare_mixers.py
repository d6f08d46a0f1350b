"""tools/compare_mixers.py end to end: two real 4-step runs at one budget, scored, tabulated, and resumed."""
import json
import subprocess
import sys

import pytest

from launching import REPO, tiny_overrides

pytestmark = pytest.mark.dist

CONFIGS = ["configs/tiny_lm.yaml", "configs/lm/linear_tiny.yaml"]


def compare(lm_data, out, *extra):
    overrides = [o for o in tiny_overrides(lm_data, out, train__max_steps=4, schedule__warmup_steps=1,
                                           log__val_every=4, log__val_batches=2, checkpoint__every=4)
                 if not o.startswith("run.dir=")]  # the tool gives each config its own run directory
    # overrides written straight after the nargs="+" options too: they must not be read as configs or files
    return subprocess.run([sys.executable, "tools/compare_mixers.py", "--configs", *CONFIGS, *overrides[:2],
                           "--out", str(out), "--eval-data", lm_data["held_out"], *overrides[2:4],
                           "--json", str(out / "rows.json"), *overrides[4:], *extra],
                          cwd=REPO, capture_output=True, text=True)


def test_runs_every_config_at_one_budget_and_resumes(lm_data, tmp_path):
    out = tmp_path / "compare"
    first = compare(lm_data, out)
    assert first.returncode == 0, first.stderr[-4000:]
    rows = json.loads((out / "rows.json").read_text())["rows"]
    assert [row["mixer"] for row in rows] == ["softmax", "linear"]
    assert {row["tokens"] for row in rows} == {4 * 4 * 64}  # 4 steps × micro-batch 4 × seq_len 64, for both
    for row in rows:
        assert 1 < row["test_ppl"] < 320 and 0 < row["bits_per_byte"] and row["val_ppl"] > 1  # vocabulary 320
    table = first.stdout.strip().splitlines()
    assert table[0].startswith("| mixer | params") and len(table) == 2 + len(CONFIGS)

    train_logs = {path: path.read_text() for path in out.glob("*/train.log")}
    again = compare(lm_data, out)  # every eval.json is there: nothing is trained again
    assert again.returncode == 0, again.stderr[-4000:]
    assert json.loads((out / "rows.json").read_text())["rows"] == rows
    assert {path: path.read_text() for path in out.glob("*/train.log")} == train_logs


def test_a_bad_config_is_refused_before_any_run(lm_data, tmp_path):
    out = tmp_path / "compare"
    result = compare(lm_data, out, "model.n_heads=3")  # dim 64 does not split into 3 heads
    assert result.returncode == 2
    assert "--configs configs/tiny_lm.yaml" in result.stderr and "model." in result.stderr
    assert not out.exists()


def test_a_failing_run_names_its_command_and_log(lm_data, tmp_path):
    result = compare(lm_data, tmp_path / "compare", f"data.train_shards={tmp_path}/none-{{000..009}}.tar")
    assert result.returncode != 0
    assert "launch/pretrain.py --config configs/tiny_lm.yaml" in result.stderr
    assert "tiny_lm/train.log" in result.stderr
