"""Train one LM per config at the same budget, score each on held-out text, and tabulate the mixers side by side.

    python tools/compare_mixers.py --configs configs/tiny_lm.yaml configs/lm/*_tiny.yaml --out runs/compare \\
        --eval-data ../shared/data/text/wikitext-2/test.txt --json benchmarks/quality.json \\
        data.tokenizer=/tmp/wt/tok.model data.train_shards=/tmp/wt/train data.val_shards=/tmp/wt/valid \\
        train.max_steps=200 train.micro_batch_size=8

Every run gets the same overrides (budget, data, seed), so only the configs' own keys differ. Runs go one at a
time, each as one process (``launch/pretrain.py`` under plain python: a CPU or one-GPU sweep), and are scored by
``tools/eval_ppl.py``. A run whose ``eval.json`` exists
is not redone, so an interrupted sweep continues where it stopped. Prints a markdown table; ``--json`` keeps rows.
"""
import argparse
import json
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from pretrain.cli_help import HelpFormatter  # noqa: E402
from pretrain.config import ConfigError  # noqa: E402
from pretrain.tasks import build_model  # noqa: E402
from pretrain.tasks.config_checks import load_run_config  # noqa: E402

import benchlib  # noqa: E402  (tools/, beside this script)

COLUMNS = [("mixer", "{}"), ("params", "{:,}"), ("tokens", "{:,}"), ("train_s", "{:.0f}"), ("tokens_per_s", "{:.0f}"),
           ("val_ppl", "{:.1f}"), ("test_ppl", "{:.1f}"), ("word_ppl", "{:.0f}"), ("bits_per_byte", "{:.3f}")]


def mixer_label(config_path: str, overrides: list[str]) -> str:
    model = load_run_config(config_path, overrides).model
    return "+".join(model.layer_pattern) if model.layer_pattern else model.mixer


def parameter_count(config_path: str, overrides: list[str]) -> int:
    with torch.device("meta"):
        model = build_model(load_run_config(config_path, overrides))
    return sum(p.numel() for p in model.parameters())


def compare(config_path: str, args: argparse.Namespace) -> dict:
    run_dir = args.out / Path(config_path).stem
    result_file = run_dir / "eval.json"
    if result_file.exists():
        return json.loads(result_file.read_text())
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = [*args.overrides, f"run.dir={run_dir}"]
    train = [sys.executable, "launch/pretrain.py", "--config", config_path, *overrides]
    train_s = benchlib.run_logged(train, run_dir / "train.log")
    evaluate = [sys.executable, "tools/eval_ppl.py", "--run", str(run_dir), "--data", *args.eval_data, "--json"]
    benchlib.run_logged(evaluate, run_dir / "eval.log")
    scores = json.loads((run_dir / "eval.log").read_text().strip().splitlines()[-1])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tokens = max(m["train/tokens_seen"] for m in metrics if "train/tokens_seen" in m)
    val = [m["val/ppl"] for m in metrics if "val/ppl" in m]
    row = {"config": config_path, "mixer": mixer_label(config_path, overrides),
           "params": parameter_count(config_path, overrides), "tokens": tokens, "train_s": train_s,
           "tokens_per_s": tokens / train_s, "val_ppl": val[-1] if val else float("nan"),
           "test_ppl": scores["ppl"], "word_ppl": scores["word_ppl"], "bits_per_byte": scores["bits_per_byte"],
           "final_train_loss": [m["train/loss"] for m in metrics if "train/loss" in m][-1],
           "nonfinite_skipped": max(m.get("train/nonfinite_skipped", 0) for m in metrics),
           "train_command": " ".join(train), "eval_command": " ".join(evaluate)}
    result_file.write_text(json.dumps(row, indent=1))
    return row


def markdown_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(name for name, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(fmt.format(row[name]) for name, fmt in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--configs", nargs="+", required=True, action=FilesAmongOverrides,
                        help="LM configs, one run each, in this order")
    parser.add_argument("--out", type=Path, required=True, help="folder of the run directories (one per config)")
    parser.add_argument("--eval-data", nargs="+", required=True, action=FilesAmongOverrides,
                        help="held-out text files or shards (eval_ppl --data)")
    parser.add_argument("--json", type=Path, help="also write every row (with its commands) here")
    parser.add_argument("overrides", nargs="*", action="extend", type=override, default=[],
                        help="key=value overrides given to every run: the shared budget (anywhere on the line)")
    parser.set_defaults(overrides_among_files=[])
    args = parser.parse_intermixed_args(argv)  # overrides may stand between options, in more than one place
    args.overrides = [*args.overrides_among_files, *args.overrides]
    for config_path in args.configs:  # all of them load before any run: a typo fails now, not an hour in
        try:
            load_run_config(config_path, args.overrides)
        except ConfigError as err:
            parser.error(f"--configs {config_path}: {err}")
    rows = []
    for config_path in args.configs:
        rows.append(compare(config_path, args))
        print(f"done {config_path}: test ppl {rows[-1]['test_ppl']:.1f}", file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps({"overrides": args.overrides, "eval_data": args.eval_data, "rows": rows},
                                        indent=1))
    print(markdown_table(rows))
    return 0


def is_override(word: str) -> bool:
    """``dotted.key=value`` that is no existing path."""
    return re.fullmatch(r"[A-Za-z_][\w.-]*=.*", word) is not None and not Path(word).exists()


def override(word: str) -> str:
    if not is_override(word):
        raise argparse.ArgumentTypeError(f"{word!r} is not a dotted.key=value override")
    return word


class FilesAmongOverrides(argparse.Action):
    """``--configs`` and ``--eval-data`` take every word after them, so overrides written after either reach them:
    the ``key=value`` words among those are overrides, which ``main`` puts before the others."""

    def __call__(self, parser, namespace, values, option_string=None):
        files = [word for word in values if not is_override(word)]
        if not files:
            parser.error(f"{option_string} names no file (only key=value overrides followed it)")
        setattr(namespace, self.dest, files)
        namespace.overrides_among_files += [word for word in values if is_override(word)]


if __name__ == "__main__":
    sys.exit(main())
