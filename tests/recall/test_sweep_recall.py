"""tools/sweep_recall.py end to end: real 3-step recall runs (launch/pretrain.py) for two mixers, scored by
eval_recall at two pair counts and two lengths, tabulated, plotted, and resumed without training again."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist  # starts launch/pretrain.py and eval_recall processes

REPO = Path(__file__).resolve().parents[2]
BUDGET = ["train.max_steps=3", "train.seq_len=32", "train.micro_batch_size=4", "recall.vocab_size=64",
          "recall.num_pairs=4", "schedule.warmup_steps=1", "log.every=1", "log.val_every=3", "log.val_batches=1",
          "checkpoint.every=3", "model.n_heads=1"]


def sweep(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/sweep_recall.py", "--configs", "configs/recall/softmax.yaml",
                           "configs/recall/linear.yaml", *BUDGET[:2], "--widths", "16", "--out", str(out),
                           "--pairs", "2", "4", "--seq-lens", "32", "64", "--rows", "8",
                           "--json", str(out / "rows.json"),
                           "--plot", str(out / "plot.png"), *BUDGET[2:], *extra],
                          cwd=REPO, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_trains_scores_tabulates_plots_and_resumes(tmp_path):
    out = tmp_path / "sweep"
    first = sweep(out)
    assert first.returncode == 0, first.stderr[-4000:]
    rows = json.loads((out / "rows.json").read_text())["rows"]
    assert [(row["mixer"], row["dim"], row["seed"], row["steps"]) for row in rows] == [
        ("softmax", 16, 0, 3), ("linear", 16, 0, 3)]
    for row in rows:
        settings = [(r["seq_len"], r["num_pairs"]) for r in row["results"]]
        assert settings == [(32, 2), (32, 4), (64, 2), (64, 4)]
        assert all(0 <= r["accuracy"] <= 1 and r["answers"] == 8 * r["num_pairs"] for r in row["results"])
        assert 0 <= row["val_recall_accuracy"] <= 1
    state = {row["mixer"]: [r["state_bytes"] for r in row["results"]] for row in rows}
    assert state["softmax"] == [2 * 2 * 32 * 16 * 4] * 2 + [2 * 2 * 64 * 16 * 4] * 2  # K and V per layer, fp32
    assert len(set(state["linear"])) == 1  # a fixed-size state at any length
    table = first.stdout.strip().splitlines()
    assert table[0].startswith("| mixer | dim | state bytes") and len(table) == 2 + 2
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    train_logs = {path: path.read_text() for path in out.glob("*/train.log")}
    again = sweep(out)  # every eval.json is there: nothing is trained again
    assert again.returncode == 0, again.stderr[-4000:]
    assert json.loads((out / "rows.json").read_text())["rows"] == rows
    assert {path: path.read_text() for path in out.glob("*/train.log")} == train_logs

    other = sweep(out, "optim.lr=1e-3")  # another budget in the same folder: its old scores would pass for new
    assert other.returncode == 1 and "holds a run made by another train command" in other.stderr, other.stderr
    assert {path: path.read_text() for path in out.glob("*/train.log")} == train_logs


def test_a_bad_config_is_refused_before_any_run(tmp_path):
    result = sweep(tmp_path / "sweep", "recall.num_pairs=16")  # 16 pairs need 64 tokens, seq_len is 32
    assert result.returncode == 2
    assert "--configs configs/recall/softmax.yaml" in result.stderr and "train.seq_len" in result.stderr
    assert not (tmp_path / "sweep").exists()
