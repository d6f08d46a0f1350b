"""Helpers of the training tests: tiny-run overrides, launching launch/pretrain.py, reading metrics.jsonl."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


def tiny_overrides(lm_data: dict[str, str], run_dir: Path, **extra) -> list[str]:
    """A dim-64, 2-layer softmax LM on the generated data; ``extra`` (dotted keys with __ for .) wins."""
    values = {
        "run.dir": str(run_dir), "data.tokenizer": lm_data["tokenizer"], "data.train_shards": lm_data["train_shards"],
        "data.val_shards": lm_data["val_shards"], "data.num_workers": 0, "data.shuffle_buffer": 64,
        "model.dim": 64, "model.n_layers": 2, "model.n_heads": 2, "train.seq_len": 64, "train.micro_batch_size": 4,
        "train.max_steps": 30, "optim.lr": 3e-3, "optim.min_lr": 3e-4, "schedule.warmup_steps": 5,
        "deepspeed.zero_stage": 0, "deepspeed.precision": "fp32", "log.every": 1, "log.val_every": 10,
        "log.val_batches": 50, "checkpoint.every": 10, "checkpoint.keep_last": 2,
    }
    values.update({key.replace("__", "."): value for key, value in extra.items()})
    return [f"{key}={value}" for key, value in values.items()]


def launch(overrides: list[str], *, ranks: int = 1, check: bool = True, config: str = "configs/tiny_lm.yaml",
           **popen) -> subprocess.CompletedProcess:
    """Run launch/pretrain.py as a user would: plain python for one rank, torchrun for several (gloo on CPU)."""
    if ranks == 1:
        argv = [PYTHON, "launch/pretrain.py"]
    else:
        argv = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                "launch/pretrain.py"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(argv + ["--config", config] + overrides, cwd=REPO, env=env,
                            capture_output=True, text=True, **popen)
    if check and result.returncode != 0:
        raise AssertionError(f"launch failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return result


def read_metrics(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl by step; a step logged twice (before an interruption and after the resume) keeps the later."""
    by_step: dict[int, dict] = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step.setdefault(record["step"], {}).update(record)
    return by_step


def rewound(run: Path, tmp_path: Path, *, to: str, drop: str) -> Path:
    """A copy of ``run`` as it was when stopped after checkpoint ``to`` (tag ``drop``, saved later, removed; the
    metrics logged after ``to`` stay, as a stopped run's do)."""
    copy = tmp_path / "resumed"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / drop)
    (copy / "checkpoints" / "latest").write_text(to)
    return copy
