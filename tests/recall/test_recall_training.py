"""task: recall through the real launcher: a run stopped and relaunched continues the MQAR stream exactly, so its
losses and validation accuracy equal those of an uninterrupted run."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist  # starts launch/pretrain.py processes

REPO = Path(__file__).resolve().parents[2]


def launch(run_dir: Path, steps: int) -> None:
    overrides = [f"run.dir={run_dir}", f"train.max_steps={steps}", "train.seq_len=32", "train.micro_batch_size=4",
                 "recall.vocab_size=64", "recall.num_pairs=4", "model.dim=16", "model.n_heads=1",
                 "schedule.warmup_steps=1", "log.every=1", "log.val_every=2", "log.val_batches=1", "checkpoint.every=2",
                 "checkpoint.keep_last=2"]
    result = subprocess.run([sys.executable, "launch/pretrain.py", "--config", "configs/recall/linear.yaml",
                             *overrides], cwd=REPO, capture_output=True, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-4000:]


def metrics(run_dir: Path) -> dict[int, dict]:
    by_step: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step.setdefault(record["step"], {}).update(record)
    return by_step


def test_a_relaunched_run_continues_the_stream_exactly(tmp_path):
    launch(tmp_path / "whole", 4)
    shutil.copytree(tmp_path / "whole", tmp_path / "halves")  # as if stopped after its step-2 checkpoint
    shutil.rmtree(tmp_path / "halves" / "checkpoints" / "step00000004")
    (tmp_path / "halves" / "checkpoints" / "latest").write_text("step00000002")
    launch(tmp_path / "halves", 4)  # resumes from the step-2 checkpoint
    whole, halves = metrics(tmp_path / "whole"), metrics(tmp_path / "halves")
    for step in (3, 4):
        assert halves[step]["train/loss"] == whole[step]["train/loss"]
    assert halves[4]["val/recall_accuracy"] == whole[4]["val/recall_accuracy"]
    assert halves[4]["val/loss"] == whole[4]["val/loss"]
    assert whole[4]["val/answers"] == 4 * 4  # one batch of 4 rows, 4 answers each
