"""MQAR across mixers, widths and seeds: one recall run per setting, each scored by eval_recall, one table and plot.

    python tools/sweep_recall.py --configs configs/recall/*.yaml --widths 32 64 --seeds 0 1 --out runs/recall_sweep \\
        --pairs 4 8 16 --seq-lens 64 128 256 --json benchmarks/recall_mqar.json --plot benchmarks/recall_mqar.png \\
        train.max_steps=600
    python tools/sweep_recall.py --configs configs/recall_zoology/*.yaml --widths 64 128 --lrs 1e-3 3e-3 1e-2 \\
        --search-width 64 --seeds 0 1 --settings 64:4 128:8 256:16 512:64 1024:64 --out runs/recall_zoology

Every run gets the same overrides (the budget), plus its width (``model.dim``) and seed (``run.seed``), so only the
configs' own keys differ. With ``--lrs``, each mixer and width first trains at every learning rate with the first
seed (``optim.min_lr`` keeping its ratio to it); the rate with the best mean accuracy over the trained settings is
kept, and the other seeds train at it only (the table and plot show the kept rate's runs, the JSON every run).
With ``--search-width W`` the search runs at width W alone and every other width trains each seed at W's kept rate
(Zoology searches each width; this halves the cost of a second width when the budget is two CPU cores).
Runs go one at a time, each as one process (``launch/pretrain.py`` under plain python), and are scored by
``tools/eval_recall.py`` at every ``--pairs`` × ``--seq-lens`` (or at each ``--settings``). A run whose ``eval.json``
exists is not redone, so an interrupted sweep continues where it stopped (one trained or scored by other commands is
refused: its figures would pass for this sweep's), and a run stopped part-way (SIGTERM, which makes it save) goes on
from its checkpoint, its training seconds summed over its attempts. The ``--json`` file is the sweep's record: every run
is added to it as soon as it is scored, and a run found there is not redone either, so the sweep goes on in a fresh
checkout whose run directories are gone (they are not committed; the record is). ``--finished-only`` trains nothing: it
gathers the runs already scored, so a sweep run in parts (several processes on disjoint configs, over several sessions)
gets one table, JSON and plot; a learning rate is then kept among the rates finished. ``--rescore`` trains nothing
either: it scores every finished run again on its checkpoint, so what ``eval_recall`` learned to report after a run was
scored joins its row (its accuracies must come back as recorded). Prints a markdown table of accuracy (mean over seeds,
and their range) per mixer and width at each setting, for the configs given (the record keeps the others' rows too), the
rate search, and each decaying run's gate readings; ``--plot`` draws accuracy against the decoding state's bytes at the
trained length, one panel per number of pairs (the plot of Zoology, arXiv 2312.04927).
"""
import argparse
import fcntl
import json
import os
import re
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from pretrain.cli_help import HelpFormatter  # noqa: E402
from pretrain.config import ConfigError  # noqa: E402
from pretrain.tasks.config_checks import load_run_config  # noqa: E402
from pretrain.train import checkpoint  # noqa: E402

import benchlib  # noqa: E402  (tools/, beside this script)
from eval_recall import setting_arg  # noqa: E402


def mixer_label(cfg) -> str:
    return "+".join(cfg.model.layer_pattern) if cfg.model.layer_pattern else cfg.model.mixer


def run_dir_of(row: dict) -> str:
    return next(word.split("=", 1)[1] for word in shlex.split(row["train_command"]) if word.startswith("run.dir="))


class Record:
    """The ``--json`` file as the sweep's record of scored runs, one row per run directory. Rows are added as runs
    finish, under a lock on the file's folder, so parts of a sweep run side by side can share one file; a write goes
    to a temporary file renamed over the old one, so a crash leaves the old record whole."""

    def __init__(self, path: Path | None):
        self.path = path

    def rows(self) -> dict[str, dict]:
        if self.path is None or not self.path.exists():
            return {}
        return {run_dir_of(row): row for row in json.loads(self.path.read_text())["rows"]}

    def add(self, rows: list[dict], header: dict, field: str = "kept") -> None:
        """Merge ``rows`` into the file. A run already there keeps its row and takes only the new ``field``: the
        ``kept`` mark, the one field a sweep judges again (a sweep hands back every row it read at its start, and
        the file's row may have been corrected since, by hand or by a part running beside it), or the ``results``
        of a run scored again."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        folder = os.open(self.path.parent, os.O_RDONLY)
        try:
            fcntl.flock(folder, fcntl.LOCK_EX)
            merged = self.rows()
            for row in rows:
                run_dir = run_dir_of(row)
                if run_dir not in merged:
                    merged[run_dir] = row
                elif field in row:
                    merged[run_dir][field] = row[field]
            temporary = self.path.with_name(self.path.name + ".tmp")
            temporary.write_text(json.dumps({**header, "rows": list(merged.values())}, indent=1))
            temporary.replace(self.path)
        finally:
            os.close(folder)  # closing the folder releases the lock


def sweep_one(config_path: str, width: int, seed: int, args: argparse.Namespace, lr: float | None = None
              ) -> dict | None:
    """Train and score one setting, or read its row from the record or its ``eval.json`` when an earlier sweep got
    that far, scored again with ``--rescore`` (None: not scored yet, with ``--finished-only`` or ``--rescore``)."""
    rate = "" if lr is None else f"_lr{lr:g}"
    run_dir = args.out / f"{Path(config_path).stem}_d{width}{rate}_s{seed}"
    result_file = run_dir / "eval.json"
    overrides = [*args.overrides, f"model.dim={width}", f"run.seed={seed}", f"run.dir={run_dir}"]
    if lr is not None:  # the schedule's floor keeps its ratio to the rate
        base = load_run_config(config_path, args.overrides).optim
        overrides += [f"optim.lr={lr:g}", f"optim.min_lr={lr * base.min_lr / base.lr:g}"]
    train = [sys.executable, "launch/pretrain.py", "--config", config_path, *overrides]
    scored = ["--settings", *(f"{t}:{n}" for t, n in args.settings)] if args.settings else \
        ["--pairs", *map(str, args.pairs), "--seq-lens", *map(str, args.seq_lens)]
    evaluate = [sys.executable, "tools/eval_recall.py", "--run", str(run_dir), "--json", str(run_dir / "scores.json"),
                *scored, "--rows", str(args.rows)]
    recorded = args.recorded.get(str(run_dir))
    if recorded is not None or result_file.exists():
        row = dict(recorded) if recorded else json.loads(result_file.read_text())
        row.pop("kept", None)  # the record's mark was its sweep's: sweep_mixer judges again
        for kind, command in (("train", train), ("eval", evaluate)):  # the python may differ, the arguments not
            if shlex.split(row[f"{kind}_command"])[1:] != command[1:]:
                where = f"{args.json} records {run_dir} as" if recorded else f"{run_dir} holds"
                raise SystemExit(f"{where} a run made by another {kind} command ({row[f'{kind}_command']}); give "
                                 "another --out (and --json) or delete it")
        return rescored(row, run_dir, evaluate, args) if args.rescore else row
    if args.finished_only or args.rescore:
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    attempts = train_run(train, run_dir)
    benchlib.run_logged(evaluate, run_dir / "eval.log")
    scores = json.loads((run_dir / "scores.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    cfg = load_run_config(config_path, overrides)
    row = {"config": config_path, "mixer": mixer_label(cfg), "dim": width, "seed": seed, "lr": cfg.optim.lr,
           "n_layers": cfg.model.n_layers, "train_seq_len": cfg.train.seq_len, "train_pairs": cfg.recall.num_pairs,
           "steps": cfg.train.max_steps, "train_s": sum(a["train_s"] for a in attempts),
           "load": [attempts[0]["load"][0], attempts[-1]["load"][-1]],
           **({"attempts": attempts} if len(attempts) > 1 else {}),
           "val_recall_accuracy": [m["val/recall_accuracy"] for m in metrics if "val/recall_accuracy" in m][-1],
           "results": scores["results"], "train_command": shlex.join(train), "eval_command": shlex.join(evaluate)}
    result_file.write_text(json.dumps(row, indent=1))
    args.record.add([row], args.header)
    return row


def train_run(train: list[str], run_dir: Path) -> list[dict]:
    """Train one run, or go on with one stopped part-way (a session's end): ``launch/pretrain.py`` resumes from the
    last checkpoint. Returns every attempt that added steps kept, each with its steps, training seconds and 1-minute
    load average before and after it (one for a stopped attempt, which ends at the checkpoint the next one resumed
    from: the work lost past it is not counted). ``attempts.json`` in the run folder keeps them between sweeps."""
    ledger = run_dir / "attempts.json"
    attempts = json.loads(ledger.read_text()) if ledger.exists() else []
    resumed_from = checkpoint.latest_tag(run_dir / "checkpoints")
    step = checkpoint.tag_step(resumed_from) or 0
    if resumed_from is not None and not attempts:
        raise SystemExit(f"{run_dir} holds a checkpoint that no attempt of this tool recorded ({ledger} is missing): "
                         "its training time is unknown; delete the folder to train it again")
    if attempts and "train_s" not in attempts[-1]:  # the last attempt was stopped
        if step > attempts[-1]["from_step"]:
            saved = (run_dir / "checkpoints" / "latest").stat().st_mtime  # moved once the checkpoint was whole
            attempts[-1].update(to_step=step, train_s=saved - attempts[-1]["start"])
        else:
            attempts.pop()  # stopped before its first checkpoint: nothing of it is kept
    attempt = {"from_step": step, "start": time.time(), "load": [round(os.getloadavg()[0], 2)]}
    ledger.write_text(json.dumps([*attempts, attempt], indent=1))
    attempt["train_s"] = benchlib.run_logged(train, run_dir / "train.log")
    attempt["to_step"] = checkpoint.tag_step(checkpoint.latest_tag(run_dir / "checkpoints"))
    attempt["load"].append(round(os.getloadavg()[0], 2))
    if attempt["to_step"] > step:  # not a finished run's no-op (its scoring was what had been stopped)
        attempts.append(attempt)
    ledger.write_text(json.dumps(attempts, indent=1))
    return attempts


def rescored(row: dict, run_dir: Path, evaluate: list[str], args: argparse.Namespace) -> dict:
    """``row`` with its results from its own eval command run again on its checkpoint: what ``eval_recall`` has
    learned to report since the run was scored (its gate readings) joins the record without training. The
    accuracies must come back as recorded, or the checkpoint or the scored rows have changed: the tool stops there,
    naming the run, and leaves its row as it was. A run whose folder is gone keeps its row. Each run is scored once
    however many widths take the rate searched at one."""
    if str(run_dir) in args.rescored:
        return args.rescored[str(run_dir)]
    if not (run_dir / "checkpoints" / "latest").exists():
        print(f"{run_dir}: no checkpoint here, its row stays as scored", file=sys.stderr, flush=True)
        return row
    scores = run_dir / "rescored.json"
    command = [*evaluate]
    command[command.index("--json") + 1] = str(scores)
    benchlib.run_logged(command, run_dir / "rescore.log")
    results = json.loads(scores.read_text())["results"]
    before, after = accuracies(row["results"]), accuracies(results)
    if after != before:
        raise SystemExit(f"{run_dir} scores {after} now ({scores}), {before} in its row: its checkpoint or "
                         "eval_recall's rows changed since it was scored; its row is left as it was")
    scores.replace(run_dir / "scores.json")
    row = {**row, "results": results}
    (run_dir / "eval.json").write_text(json.dumps(row, indent=1))
    args.record.add([row], args.header, field="results")
    args.rescored[str(run_dir)] = row
    return row


def accuracies(results: list[dict]) -> list[tuple]:
    return [(r["seq_len"], r["num_pairs"], r.get("accuracy")) for r in results]


def trained_accuracy(row: dict) -> float:
    """A run's mean accuracy over the settings it trained on: what picks its learning rate."""
    scores = [r["accuracy"] for r in row["results"] if r["trained"] and "accuracy" in r]
    return mean(scores) if scores else float("-inf")


def rate_search(config_path: str, width: int, args: argparse.Namespace) -> tuple[list[tuple[float, dict]], int]:
    """Every ``--lrs`` rate at the first seed (those scored, with ``--finished-only``), and the index of the kept
    one: the best mean accuracy over the trained settings (-1 when none is scored)."""
    searched = [(lr, sweep_one(config_path, width, args.seeds[0], args, lr)) for lr in args.lrs]
    searched = [(lr, row) for lr, row in searched if row is not None]
    if not searched:
        return [], -1
    best = max(range(len(searched)), key=lambda i: trained_accuracy(searched[i][1]))
    print(f"{config_path} dim {width}: learning rate {searched[best][0]:g} kept (trained-setting accuracy "
          + ", ".join(f"{lr:g}: {trained_accuracy(row):.3f}" for lr, row in searched) + ")",
          file=sys.stderr, flush=True)
    return searched, best


def sweep_mixer(config_path: str, width: int, args: argparse.Namespace) -> list[dict]:
    """Every run of one config at one width: the learning-rate search at the first seed (with ``--lrs``), then the
    other seeds at the best rate; with ``--search-width``, another width trains every seed at the rate kept there.
    The kept runs are marked ``kept``."""
    if not args.lrs:
        rows = [sweep_one(config_path, width, seed, args) for seed in args.seeds]
        return [{**row, "kept": True} for row in rows if row is not None]
    if args.search_width not in (None, width):
        searched, best = rate_search(config_path, args.search_width, args)
        if not searched:
            return []
        rows = [sweep_one(config_path, width, seed, args, searched[best][0]) for seed in args.seeds]
        return ([{**row, "kept": True} for row in rows if row is not None]
                + left_behind(config_path, width, args.seeds, searched[best][0], args))
    searched, best = rate_search(config_path, width, args)
    if not searched:
        return []
    kept = [sweep_one(config_path, width, seed, args, searched[best][0]) for seed in args.seeds[1:]]
    return ([{**row, "kept": i == best} for i, (_, row) in enumerate(searched)]
            + [{**row, "kept": True} for row in kept if row is not None]
            + left_behind(config_path, width, args.seeds[1:], searched[best][0], args))


def left_behind(config_path: str, width: int, seeds: list[int], rate: float, args: argparse.Namespace
                ) -> list[dict]:
    """Recorded runs of these seeds at a rate the search no longer keeps (a better one finished since they
    trained), marked not kept: they stay in the record, out of the table (read as any finished run is, so
    ``--rescore`` scores them again too)."""
    return [{**sweep_one(config_path, width, row["seed"], args, row["lr"]), "kept": False}
            for row in list(args.recorded.values())
            if Path(row["config"]).stem == Path(config_path).stem and row["dim"] == width and row["seed"] in seeds
            and row["lr"] != rate]


def settings_of(rows: list[dict]) -> list[tuple[int, int]]:
    return sorted({(r["seq_len"], r["num_pairs"]) for row in rows for r in row["results"]})


def summary(rows: list[dict]) -> dict[tuple[str, int], dict]:
    """Per (preset, width): the state bytes and the mean accuracy over seeds at each (seq_len, pairs) setting. A
    preset is the config's file name: two configs of one mixer (linear with and without short_conv) stay apart."""
    grouped = defaultdict(list)
    for row in rows:
        if row.get("kept", True):
            grouped[Path(row["config"]).stem, row["dim"]].append(row)
    table = {}
    for key, group in grouped.items():
        accuracy, state = defaultdict(list), {}
        for row in group:
            for r in row["results"]:
                if "accuracy" in r:
                    accuracy[r["seq_len"], r["num_pairs"]].append(r["accuracy"])
                    state[r["seq_len"]] = r["state_bytes"]
        table[key] = {"accuracy": {s: mean(v) for s, v in accuracy.items()}, "state_bytes": state,
                      "spread": {s: (min(v), max(v)) for s, v in accuracy.items()}, "seeds": len(group),
                      "lr": group[0]["lr"]}
    return table


def accuracy_cell(entry: dict, setting: tuple[int, int]) -> str:
    """The mean over seeds, and with several seeds their lowest and highest: at this budget seeds can differ by
    more than mixers do."""
    if setting not in entry["accuracy"]:
        return "—"
    low, high = entry["spread"][setting]
    return f"{entry['accuracy'][setting]:.3f}" + (f" ({low:.3f}–{high:.3f})" if entry["seeds"] > 1 else "")


def markdown_table(rows: list[dict]) -> str:
    settings, table = settings_of(rows), summary(rows)
    head = ["preset", "dim", "lr", "seeds", "state bytes (train len)"] + [f"T={t} N={n}" for t, n in settings]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    trained = rows[0]["train_seq_len"]
    for (mixer, dim), entry in table.items():
        cells = [mixer, str(dim), f"{entry['lr']:g}", str(entry["seeds"]),
                 f"{entry['state_bytes'].get(trained, float('nan')):,}"]
        cells += [accuracy_cell(entry, s) for s in settings]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rate_table(rows: list[dict], search_width: int | None = None) -> str:
    """The learning-rate search: per preset and width (``search_width`` only, if given), each rate's mean accuracy
    over the trained settings at the first seed, the kept rate in bold ("" when no preset tried more than one rate)."""
    first_seed = {}
    for row in rows:
        key = Path(row["config"]).stem, row["dim"]
        first_seed[key] = min(first_seed.get(key, row["seed"]), row["seed"])
    searched = defaultdict(dict)
    for row in rows:
        key = Path(row["config"]).stem, row["dim"]
        if row["seed"] == first_seed[key]:
            searched[key][row["lr"]] = row
    if search_width is not None:  # the other widths took its rate: they searched nothing
        searched = {key: by_rate for key, by_rate in searched.items() if key[1] == search_width}
    rates = sorted({lr for by_rate in searched.values() for lr in by_rate})
    if all(len(by_rate) < 2 for by_rate in searched.values()):
        return ""
    lines = ["| preset | dim | " + " | ".join(f"lr {lr:g}" for lr in rates) + " |", "|---|---|" + "---:|" * len(rates)]
    for (preset, dim), by_rate in searched.items():
        cells = [(f"**{trained_accuracy(by_rate[lr]):.3f}**" if by_rate[lr].get("kept", True)
                  else f"{trained_accuracy(by_rate[lr]):.3f}") if lr in by_rate else "—" for lr in rates]
        lines.append(f"| {preset} | {dim} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gate_table(rows: list[dict]) -> str:
    """Each run's mean log-decay per token, layer by layer, at the largest setting it trained on, beside its
    accuracy there: a gate stuck forgetting fast (below about −1/distance between a pair and its query) next to the
    recall it costs. Rows scored before eval_recall read gates have none ("" when no row has)."""
    lines = []
    for row in rows:
        trained = [r for r in row["results"] if r["trained"] and "log_decay" in r]
        if trained:
            at = max(trained, key=lambda r: r["seq_len"])
            lines.append(f"| {Path(row['config']).stem} | {row['dim']} | {row['lr']:g} | {row['seed']} | "
                         f"{'yes' if row.get('kept', True) else ''} | {at['seq_len']}:{at['num_pairs']} | "
                         f"{at['accuracy']:.3f} | " + ", ".join(map(short_number, at["log_decay"].values())) + " |")
    if not lines:
        return ""
    head = "| preset | dim | lr | seed | kept | T:N | accuracy | mean log-decay per token, decaying layers in order |"
    return "\n".join([head, "|---|---|---|---|---|---|---:|---|", *lines])


def short_number(value: float) -> str:
    """Two significant digits, a power of ten written as such: −0.0018, −1.1·10⁻⁶."""
    text = f"{value:.2g}"
    if "e" in text:
        mantissa, exponent = text.split("e")
        text = f"{mantissa}·10" + str(int(exponent)).translate(str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹"))
    return text.replace("-", "−")


def plot(rows: list[dict], path: Path) -> None:
    """Accuracy against decoding-state bytes (log scale), one line per mixer through its widths, a panel per trained
    (length, pairs) setting (where Zoology draws it; the settings beyond them are in the table)."""
    plt = benchlib.pyplot()
    from matplotlib.ticker import EngFormatter, LogLocator, NullFormatter

    table = summary(rows)
    trained = sorted({(r["seq_len"], r["num_pairs"]) for row in rows for r in row["results"] if r["trained"]})
    settings = trained or settings_of(rows)
    mixers = list(dict.fromkeys(mixer for mixer, _ in table))
    colors = plt.get_cmap("tab20").colors  # more presets than the default cycle's 10 colours: none may share one
    fig, axes = plt.subplots(1, len(settings), figsize=(3.2 * len(settings) + 1.8, 3.4), sharey=True, squeeze=False)
    for ax, (seq_len, pairs) in zip(axes[0], settings):
        for i, mixer in enumerate(mixers):
            points = sorted((e["state_bytes"][seq_len], e["accuracy"][seq_len, pairs])
                            for (m, _), e in table.items() if m == mixer and (seq_len, pairs) in e["accuracy"])
            if points:
                ax.plot(*zip(*points), marker="os^Dv<>p"[i % 8], color=colors[i % len(colors)], label=mixer)
        ax.axhline(1 / pairs, color="gray", linestyle="--", linewidth=0.8, label="1/pairs")  # a guess among the values
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))  # within a decade or two: 20k, 50k, 100k, ...
        ax.xaxis.set_major_formatter(EngFormatter(unit="B", sep=" "))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"T={seq_len}, {pairs} pairs", fontsize=9)
        ax.set_xlabel("state bytes")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("recall accuracy")
    axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))  # beside the panels, off the points
    benchlib.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--configs", nargs="+", required=True, help="task: recall configs, one mixer each")
    parser.add_argument("--widths", type=int, nargs="+", required=True, help="model.dim of each run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="run.seed of each run")
    parser.add_argument("--out", type=Path, required=True, help="folder of the run directories")
    parser.add_argument("--lrs", type=float, nargs="+", help="learning rates searched at the first seed (optim.lr; "
                                                              "default: each config's own)")
    parser.add_argument("--search-width", type=int, help="search the rates at this width only: the others train "
                                                          "every seed at the rate kept there")
    parser.add_argument("--pairs", type=int, nargs="+", help="numbers of pairs scored (eval_recall)")
    parser.add_argument("--seq-lens", type=int, nargs="+", help="lengths scored (eval_recall)")
    parser.add_argument("--settings", type=setting_arg, nargs="+", metavar="T:N",
                        help="(length, pairs) settings scored, instead of the grid of --pairs × --seq-lens")
    parser.add_argument("--rows", type=int, default=256, help="rows scored per setting")
    parser.add_argument("--finished-only", action="store_true",
                        help="train nothing: gather the runs already scored (a sweep run in parts)")
    parser.add_argument("--rescore", action="store_true",
                        help="train nothing: score every run already scored again, on its checkpoint, with its own "
                             "eval command, and record what eval_recall reports now (its accuracies must not move)")
    parser.add_argument("--json", type=Path, help="the record: every run's row (with its commands), added as each "
                                                   "is scored; a run recorded here is not redone")
    parser.add_argument("--plot", type=Path, help="write the accuracy-against-state-size plot here (PNG)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides given to every run: the shared budget")
    args = parser.parse_args(argv)
    _take_back_overrides(args, sys.argv[1:] if argv is None else argv)
    if bool(args.settings) == bool(args.pairs and args.seq_lens) or (args.settings and (args.pairs or args.seq_lens)):
        parser.error("give the scored settings as --settings, or as --pairs and --seq-lens")
    if args.search_width is not None and not args.lrs:
        parser.error("--search-width names the width where --lrs are searched: give --lrs")
    for config_path in args.configs:  # all of them load before any run: a typo fails now, not an hour in
        try:
            cfg = load_run_config(config_path, [*args.overrides, f"model.dim={max(args.widths)}"])
        except ConfigError as err:
            parser.error(f"--configs {config_path}: {err}")
        if cfg.task != "recall":
            parser.error(f"--configs {config_path}: task {cfg.task!r}; the sweep trains task: recall configs")
    args.record = Record(args.json)
    args.recorded = args.record.rows()
    args.rescored = {}
    args.header = {"overrides": args.overrides, "lrs": args.lrs, "pairs": args.pairs, "seq_lens": args.seq_lens,
                   "settings": args.settings}
    rows = []
    for width in args.widths:
        for config_path in args.configs:
            done = sweep_mixer(config_path, width, args)
            args.record.add(done, args.header)
            rows += done
            print(f"done {config_path} dim {width}: val accuracy "
                  + (", ".join(f"{row['val_recall_accuracy']:.3f}" for row in done if row["kept"]) or "none scored"),
                  file=sys.stderr, flush=True)
    if not rows:
        raise SystemExit("no run is scored yet: nothing to tabulate (drop --finished-only to train)")
    if args.plot:
        plot(rows, args.plot)
    print(markdown_table(rows))
    if searched := rate_table(rows, args.search_width):
        print(f"\nThe rate search (mean accuracy over the trained settings, seed {min(args.seeds)}; kept in bold):\n")
        print(searched)
    if gates := gate_table(rows):
        print("\nWhat the gates learned (mean log-decay per token at the largest trained setting):\n")
        print(gates)
    return 0


def _take_back_overrides(args, argv: list[str]):
    """``--configs`` takes every word after it, so overrides written after it would be read as files: wherever a
    ``key=value`` that is no existing path stands, it is an override (in argv order)."""
    def is_override(word):
        return re.fullmatch(r"[A-Za-z_][\w.-]*=.*", word) is not None and not Path(word).exists()

    args.overrides = [word for word in argv if is_override(word)]
    args.configs = [word for word in args.configs if not is_override(word)]


if __name__ == "__main__":
    sys.exit(main())
