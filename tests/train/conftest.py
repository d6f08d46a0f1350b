"""Fixtures of the training tests: a generated corpus, a real tokenizer and real shards, and a launcher helper."""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.data import make_text_shards, train_tokenizer

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
SUBJECTS = ["the cat", "a dog", "my friend", "the river", "some bird", "our teacher"]
VERBS = ["sees", "likes", "follows", "finds", "draws", "hears"]
OBJECTS = ["the moon", "a stone", "the light", "an apple", "the road", "a song"]


def generated_document(rng: random.Random) -> str:
    """Sentences of a tiny grammar: predictable enough that a 2-layer model's loss visibly falls in 30 steps."""
    lines = []
    for _ in range(rng.randint(2, 12)):
        words = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
        lines.append(" ".join(words) + rng.choice([".", "!", " today.", " again."]))
    return "\n".join(lines)


@pytest.fixture(scope="session")
def lm_data(tmp_path_factory) -> dict[str, str]:
    """Tokenizer, train/val shards and a held-out text file, built with the data package's own tools."""
    rng = random.Random(0)
    root = tmp_path_factory.mktemp("lm_data")
    splits = {"train": 600, "val": 24}
    for split, count in splits.items():
        with open(root / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for _ in range(count):
                f.write(json.dumps({"text": generated_document(rng)}) + "\n")
    (root / "held_out.txt").write_text("\n".join(generated_document(rng) for _ in range(8)) + "\n", encoding="utf-8")
    tokenizer = train_tokenizer([str(root / "train.jsonl")], 320, str(root / "tok"))
    for split in splits:
        make_text_shards([str(root / f"{split}.jsonl")], tokenizer.path, str(root / split), docs_per_shard=50)
    return {"tokenizer": tokenizer.path,
            "train_shards": str(root / "train" / "shard-{000000..000099}.tar"),
            "val_shards": str(root / "val" / "shard-{000000..000099}.tar"),
            "held_out": str(root / "held_out.txt"),
            "root": str(root)}


def tiny_overrides(lm_data: dict[str, str], run_dir: Path, **extra) -> list[str]:
    """A dim-64, 2-layer softmax LM on the generated data; ``extra`` (dotted keys with __ for .) wins."""
    values = {
        "run.dir": str(run_dir), "data.tokenizer": lm_data["tokenizer"], "data.train_shards": lm_data["train_shards"],
        "data.val_shards": lm_data["val_shards"], "data.num_workers": 0, "data.shuffle_buffer": 64,
        "model.dim": 64, "model.n_layers": 2, "model.n_heads": 2, "train.seq_len": 64, "train.micro_batch_size": 4,
        "train.max_steps": 30, "optim.lr": 3e-3, "optim.min_lr": 3e-4, "schedule.warmup_steps": 5,
        "deepspeed.zero_stage": 0, "deepspeed.precision": "fp32", "log.every": 1, "log.val_every": 10, "log.val_batches": 50, "checkpoint.every": 10, "checkpoint.keep_last": 2,
    }
    values.update({key.replace("__", "."): value for key, value in extra.items()})
    return [f"{key}={value}" for key, value in values.items()]


def launch(overrides: list[str], *, ranks: int = 1, check: bool = True, **popen) -> subprocess.CompletedProcess:
    """Run launch/pretrain.py as a user would: plain python for one rank, torchrun for several (gloo on CPU)."""
    if ranks == 1:
        argv = [PYTHON, "launch/pretrain.py"]
    else:
        argv = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "launch/pretrain.py"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(argv + ["--config", "configs/tiny_lm.yaml"] + overrides, cwd=REPO, env=env,
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
