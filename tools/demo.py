#!/usr/bin/env python
"""The whole product in minutes on a laptop: corpus → tokenizer → shards → DeepSpeed on 2 CPU ranks → perplexity.

The corpus is the Python standard library's own source, which every machine with Python has, so the demo needs
no network and no data set. Each stage is the same command a user would type; the demo only strings them together
and prints them, so it doubles as a tutorial.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pretrain.cli_help import HelpFormatter

REPO = Path(__file__).resolve().parent.parent


def stdlib_sources(limit_bytes: int) -> list[Path]:
    """Deterministic choice of stdlib modules (sorted paths, tests and vendored code left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "lib2to3", "ensurepip", "__pycache__"}
    chosen, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if skip & set(path.relative_to(root).parts):
            continue
        size = path.stat().st_size
        if size < 2_000:
            continue
        chosen.append(path)
        total += size
        if total >= limit_bytes:
            break
    return chosen


def write_corpus(out_dir: Path, limit_bytes: int, held_out_bytes: int) -> tuple[Path, Path, Path]:
    """Every 20th module is held out (validation shards); the first of them, up to ``held_out_bytes``, also form
    the plain-text file that ``eval_ppl`` scores. The rest are training documents."""
    out_dir.mkdir(parents=True, exist_ok=True)
    train, valid, held_out = out_dir / "train.jsonl", out_dir / "valid.jsonl", out_dir / "held_out.txt"
    held = 0
    with train.open("w") as tr, valid.open("w") as va, held_out.open("w") as ho:
        for i, path in enumerate(stdlib_sources(limit_bytes)):
            text = path.read_text(encoding="utf-8", errors="replace")
            if i % 20 != 10:
                tr.write(json.dumps({"text": text}) + "\n")
                continue
            va.write(json.dumps({"text": text}) + "\n")
            if held < held_out_bytes:
                ho.write(text if text.endswith("\n") else text + "\n")
                held += len(text.encode())
    return train, valid, held_out


def step(title: str, argv: list[str], env: dict | None = None) -> None:
    print(f"\n==> {title}\n$ {shlex.join(argv)}", flush=True)
    start = time.time()
    subprocess.run(argv, cwd=REPO, check=True, env=env)
    print(f"    ({time.time() - start:.0f} s)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--run", "--run-dir", dest="run", default="runs/demo",
                        help="where the corpus, shards, logs and checkpoints go")
    parser.add_argument("--corpus-bytes", type=int, default=6_000_000, help="stdlib source to take (bytes)")
    parser.add_argument("--held-out-bytes", type=int, default=100_000, help="held-out text eval_ppl scores (bytes)")
    parser.add_argument("--steps", type=int, default=400, help="training steps")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences of 512 tokens per rank and step")
    parser.add_argument("--ranks", type=int, default=2, help="CPU ranks (gloo)")
    args = parser.parse_args()

    py = sys.executable
    run = Path(args.run)
    data = run / "data"
    t0 = time.time()
    train, valid, held_out = write_corpus(data / "corpus", args.corpus_bytes, args.held_out_bytes)
    print(f"corpus: {train} and {valid} from the Python standard library")

    tok = data / "tokenizer" / "stdlib"
    step("train a sentencepiece tokenizer",
         [py, "tools/train_tokenizer.py", "--input", str(train), "--vocab-size", "4096", "--out", str(tok)])
    for split, src in (("train", train), ("valid", valid)):
        step(f"shard the {split} split",
             [py, "tools/make_shards.py", "text", "--input", str(src), "--tokenizer", f"{tok}.model",
              "--out", str(data / "shards" / split), "--docs-per-shard", "64"])

    env = dict(os.environ, OMP_NUM_THREADS="1")
    step(f"train a small LM with DeepSpeed on {args.ranks} CPU ranks",
         [py, "launch/torchrun.py", "--standalone", f"--nproc_per_node={args.ranks}",  # torchrun, quieter
          "launch/pretrain.py", "--config", "configs/tiny_lm.yaml",
          f"run.dir={run}", f"data.tokenizer={tok}.model",
          f"data.train_shards={data / 'shards' / 'train'}", f"data.val_shards={data / 'shards' / 'valid'}",
          f"train.max_steps={args.steps}", f"train.micro_batch_size={args.micro_batch}"], env=env)
    step("evaluate perplexity on held-out stdlib modules",
         [py, "tools/eval_ppl.py", "--run", str(run), "--data", str(held_out), "--json"])

    print(f"\nDone in {time.time() - t0:.0f} s.")
    print(f"  config       {run / 'config.yaml'}")
    print(f"  checkpoints  {run / 'checkpoints'}")
    print(f"  tensorboard  tensorboard --logdir {run / 'tensorboard'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
