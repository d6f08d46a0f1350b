"""tools/sweep_recall.py end to end: real 3-step recall runs (launch/pretrain.py) for two mixers, scored by
eval_recall at two pair counts and two lengths, tabulated, plotted, and resumed without training again."""
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean

import pytest

from pretrain.train import checkpoint

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
    assert table[0].startswith("| preset | dim | lr | seeds | state bytes") and len(table) == 2 + 2
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    train_logs = {path: path.read_text() for path in out.glob("*/train.log")}
    again = sweep(out)  # every eval.json is there: nothing is trained again
    assert again.returncode == 0, again.stderr[-4000:]
    assert json.loads((out / "rows.json").read_text())["rows"] == rows
    assert {path: path.read_text() for path in out.glob("*/train.log")} == train_logs

    gathered = sweep(out, "--finished-only", "--seeds", "0", "1")  # seed 1 was never run: left out, not trained
    assert gathered.returncode == 0, gathered.stderr[-4000:]
    assert json.loads((out / "rows.json").read_text())["rows"] == rows
    assert sorted(path.name for path in out.iterdir() if path.is_dir()) == ["linear_d16_s0", "softmax_d16_s0"]

    (out / "rows.json").rename(out / "record.json")  # the run directories alone refuse it too
    other = sweep(out, "optim.lr=1e-3")  # another budget in the same folder: its old scores would pass for new
    assert other.returncode == 1 and "holds a run made by another train command" in other.stderr, other.stderr
    (out / "record.json").rename(out / "rows.json")
    assert {path: path.read_text() for path in out.glob("*/train.log")} == train_logs

    for path in out.glob("*/eval.json"):  # a fresh checkout: the run directories are gone, the record is not
        shutil.rmtree(path.parent)
    resumed = sweep(out)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert json.loads((out / "rows.json").read_text())["rows"] == rows
    assert not any(path.is_dir() for path in out.iterdir())  # nothing trained again
    other = sweep(out, "optim.lr=1e-3")
    assert other.returncode == 1 and "rows.json records" in other.stderr and "another train" in other.stderr
    assert not any(path.is_dir() for path in out.iterdir())


def test_a_bad_config_is_refused_before_any_run(tmp_path):
    result = sweep(tmp_path / "sweep", "recall.num_pairs=16")  # 16 pairs need 64 tokens, seq_len is 32
    assert result.returncode == 2
    assert "--configs configs/recall/softmax.yaml" in result.stderr and "train.seq_len" in result.stderr
    assert not (tmp_path / "sweep").exists()


def search_sweep(out: Path, *extra: str) -> subprocess.CompletedProcess:
    """A rate search at width 16 whose rate width 24 takes, trained on a mixture, scored beyond it."""
    return subprocess.run(
        [sys.executable, "tools/sweep_recall.py", "--configs", "configs/recall/linear.yaml", "--widths", "16", "24",
         "--search-width", "16", "--lrs", "1e-4", "3e-3", "--seeds", "0", "1", "--settings", "16:2", "32:4", "64:4",
         "--rows", "8", "--out", str(out), "--json", str(out / "rows.json"), *extra, *BUDGET,
         "recall.mixture=[{seq_len: 16, num_pairs: 2}, {seq_len: 32, num_pairs: 4}]"],
        cwd=REPO, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_a_learning_rate_search_keeps_the_best_rate_for_the_other_seeds(tmp_path):
    """Zoology's protocol: every rate at the first seed, the other seeds at the best one; with --search-width, the
    other width trains its seeds at that rate only; a mixture run scored at --settings, its per-setting validation
    accuracy logged."""
    out = tmp_path / "sweep"
    result = search_sweep(out)
    assert result.returncode == 0, result.stderr[-4000:]
    everything = json.loads((out / "rows.json").read_text())["rows"]
    rows = [row for row in everything if row["dim"] == 16]
    searched = {row["lr"]: row for row in rows if row["seed"] == 0}
    assert sorted(searched) == [1e-4, 3e-3]
    best = max(searched, key=lambda lr: mean(r["accuracy"] for r in searched[lr]["results"] if r["trained"]))
    assert [(row["seed"], row["lr"], row["kept"]) for row in rows if row["seed"] == 1] == [(1, best, True)]
    assert [row["kept"] for row in rows if row["seed"] == 0] == [lr == best for lr in searched]
    assert [(row["seed"], row["lr"], row["kept"]) for row in everything if row["dim"] == 24] == [
        (0, best, True), (1, best, True)]  # no search of its own
    for row in rows:
        assert [(r["seq_len"], r["num_pairs"], r["trained"]) for r in row["results"]] == [
            (16, 2, True), (32, 4, True), (64, 4, False)]
    metrics = [json.loads(line) for line in next(out.glob("*_s1")).joinpath("metrics.jsonl").read_text().splitlines()]
    logged = [m for m in metrics if "val/recall_accuracy" in m][-1]
    assert {"val/recall_accuracy/T16_N2", "val/recall_accuracy/T32_N4"} <= set(logged)
    table, _, search = result.stdout.strip().split("\n\n")
    table = table.splitlines()
    assert len(table) == 4 and f"| 16 | {best:g} | 2 |" in table[2] and f"| 24 | {best:g} | 2 |" in table[3]
    kept = [row for row in rows if row["kept"]]
    low, high = sorted(next(r["accuracy"] for r in row["results"] if r["num_pairs"] == 2) for row in kept)
    assert f"| {(low + high) / 2:.3f} ({low:.3f}–{high:.3f}) |" in table[2]  # the mean over seeds, and their range
    accuracy = {lr: f"{mean(r['accuracy'] for r in row['results'] if r['trained']):.3f}"
                for lr, row in searched.items()}
    assert search.splitlines() == ["| preset | dim | lr 0.0001 | lr 0.003 |", "|---|---|---:|---:|",
                                   "| linear | 16 | " + " | ".join(f"**{accuracy[lr]}**" if lr == best else accuracy[lr]
                                                                   for lr in (1e-4, 3e-3)) + " |"]

    # The other rate scores best after all (as when a rate finishes in a later part): gathering again moves the
    # search, and the runs made at the old rate stay in the record, no longer kept.
    other = next(lr for lr in searched if lr != best)
    record = json.loads((out / "rows.json").read_text())
    for row in record["rows"]:
        if row["dim"] == 16 and row["seed"] == 0 and row["lr"] == other:
            row["results"] = [{**r, "accuracy": 1.0} if r["trained"] else r for r in row["results"]]
    (out / "rows.json").write_text(json.dumps(record))
    moved = search_sweep(out, "--finished-only")
    assert moved.returncode == 0, moved.stderr[-4000:]
    marks = {(row["dim"], row["seed"], row["lr"]): row["kept"]
             for row in json.loads((out / "rows.json").read_text())["rows"]}
    assert marks == {(16, 0, other): True, (16, 0, best): False, (16, 1, best): False, (24, 0, best): False,
                     (24, 1, best): False}
    assert f"| linear | 16 | {other:g} | 1 |" in moved.stdout  # the one seed run at the rate kept now


def _add_rows(path: str, first: int, count: int) -> None:
    """One part of a sweep recording its runs one at a time (a child process: the parts of a sweep run apart)."""
    sys.path.insert(0, str(REPO / "tools"))
    from sweep_recall import Record
    for i in range(first, first + count):
        Record(Path(path)).add([{"train_command": f"python launch/pretrain.py run.dir=runs/r{i}", "i": i}], {})


def test_a_sweep_handing_back_the_rows_it_read_rewrites_only_their_kept_marks(tmp_path, load_tool):
    """A sweep returns every recorded row it read at its start; a correction made to the file since must survive."""
    record = load_tool("sweep_recall").Record(tmp_path / "rows.json")
    command = "python launch/pretrain.py run.dir=runs/r0"
    read_at_start = {"train_command": command, "train_s": 4.0, "kept": False}
    record.add([read_at_start], {"lrs": None})
    corrected = json.loads((tmp_path / "rows.json").read_text())
    corrected["rows"][0]["train_s"] = 1605.0  # a hand edit while the sweep runs
    (tmp_path / "rows.json").write_text(json.dumps(corrected))
    record.add([{**read_at_start, "kept": True}], {"lrs": [1e-3]})
    assert record.rows() == {"runs/r0": {"train_command": command, "train_s": 1605.0, "kept": True}}
    assert json.loads((tmp_path / "rows.json").read_text())["lrs"] == [1e-3]


@pytest.mark.dist
def test_the_record_keeps_every_part_of_a_sweep_run_side_by_side(tmp_path, load_tool):
    record = load_tool("sweep_recall").Record(tmp_path / "rows.json")

    context = multiprocessing.get_context("spawn")
    parts = [context.Process(target=_add_rows, args=(str(tmp_path / "rows.json"), first, 20)) for first in (1, 21)]
    for part in parts:
        part.start()
    for part in parts:
        part.join()
    assert [part.exitcode for part in parts] == [0, 0]
    assert sorted(row["i"] for row in record.rows().values()) == list(range(1, 41))  # no part's row lost
    assert [path.name for path in tmp_path.iterdir()] == ["rows.json"]  # no temporary file left behind


def gated_sweep(out: Path, *extra: str) -> subprocess.CompletedProcess:
    """Mamba-2, whose gates depend on the data, at the smallest size: one run, scored at two settings."""
    return subprocess.run(
        [sys.executable, "tools/sweep_recall.py", "--configs", "configs/recall_zoology/mamba2.yaml", "--widths", "16",
         "--settings", "16:2", "32:4", "--rows", "8", "--out", str(out), "--json", str(out / "rows.json"), *extra,
         *BUDGET, "recall.mixture=[{seq_len: 16, num_pairs: 2}, {seq_len: 32, num_pairs: 4}]",
         "model.mixer_options.mamba2.state_size=8"],
        cwd=REPO, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_rescoring_adds_what_eval_recall_reports_now_without_training(tmp_path):
    """A run scored before eval_recall read gates (its rows stripped of them here) gets them from --rescore: its own
    eval command again, on its checkpoint, its accuracies as recorded, nothing trained. An accuracy that moved stops
    the tool naming the run, with the record as it was."""
    out = tmp_path / "sweep"
    first = gated_sweep(out)
    assert first.returncode == 0, first.stderr[-4000:]
    (row,) = json.loads((out / "rows.json").read_text())["rows"]
    read = [r["log_decay"] for r in row["results"]]
    assert all(list(decay) == ["layers.0.mixer", "layers.1.mixer"] for decay in read)
    assert all(value < 0 for decay in read for value in decay.values())
    assert "What the gates learned" in first.stdout and "| mamba2 | 16 | 0.003 | 0 | yes | 32:4 |" in first.stdout

    record = json.loads((out / "rows.json").read_text())
    for r in record["rows"][0]["results"]:
        del r["log_decay"]
    (out / "rows.json").write_text(json.dumps(record))
    (run_dir,) = [path for path in out.iterdir() if path.is_dir()]
    (run_dir / "eval.json").unlink()  # the record alone holds the old row
    train_log = (run_dir / "train.log").read_text()
    again = gated_sweep(out, "--rescore")
    assert again.returncode == 0, again.stderr[-4000:]
    (rescored,) = json.loads((out / "rows.json").read_text())["rows"]
    assert rescored == {**row, "kept": True}  # the readings back, every other figure as it was
    assert json.loads((run_dir / "eval.json").read_text())["results"] == row["results"]
    assert (run_dir / "train.log").read_text() == train_log
    assert "What the gates learned" in again.stdout

    record = json.loads((out / "rows.json").read_text())
    record["rows"][0]["results"][0]["accuracy"] = -1.0  # a row that no longer matches its checkpoint
    (out / "rows.json").write_text(json.dumps(record))
    moved = gated_sweep(out, "--rescore")
    assert moved.returncode == 1 and str(run_dir) in moved.stderr and "changed since it was scored" in moved.stderr, \
        moved.stderr[-2000:]
    assert json.loads((out / "rows.json").read_text()) == record
    assert json.loads((run_dir / "eval.json").read_text())["results"] == row["results"]


def test_the_gate_table_reads_each_decaying_run_at_its_largest_trained_setting(load_tool):
    tool = load_tool("sweep_recall")
    result = {"trained": True, "accuracy": 0.5, "num_pairs": 4}
    gated = {"config": "configs/recall_zoology/mamba2.yaml", "dim": 64, "lr": 0.01, "seed": 1, "kept": False,
             "results": [{**result, "seq_len": 64, "log_decay": {"layers.0.mixer": -9.0}},
                         {**result, "seq_len": 256, "accuracy": 0.871,
                          "log_decay": {"layers.0.mixer": -1.04e-6, "layers.1.mixer": -0.00838}},
                         {**result, "seq_len": 512, "trained": False, "log_decay": {"layers.0.mixer": -9.0}}]}
    plain = {"config": "configs/recall_zoology/softmax.yaml", "dim": 64, "lr": 0.003, "seed": 0,
             "results": [{**result, "seq_len": 256}]}
    assert tool.gate_table([plain]) == ""  # a run scored before the readings, or one whose state does not decay
    assert tool.gate_table([plain, gated]).splitlines()[2:] == [
        "| mamba2 | 64 | 0.01 | 1 |  | 256:4 | 0.871 | −1·10⁻⁶, −0.0084 |"]
    assert [tool.short_number(v) for v in (-1.0, -10.0, -123.0, -0.036)] == ["−1", "−10", "−1.2·10²", "−0.036"]


def test_a_run_stopped_part_way_goes_on_from_its_checkpoint_and_counts_both_attempts(tmp_path):
    """A session's end: SIGTERM to the sweep's process group stops the run after a save (launch/pretrain.py exits
    PREEMPTED); the next sweep resumes it, and its row counts the first attempt up to that checkpoint and the second
    to the end. A checkpoint the tool did not record (its attempts file gone) is refused: its time is unknown."""
    out = tmp_path / "sweep"
    command = [sys.executable, "tools/sweep_recall.py", "--configs", "configs/recall/linear.yaml", "--widths", "16",
               "--out", str(out), "--pairs", "2", "--seq-lens", "32", "--rows", "8", "--json", str(out / "rows.json"),
               *BUDGET, "train.max_steps=100", "checkpoint.every=100", "log.val_every=100"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run_dir = out / "linear_d16_s0"
    first = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    metrics = run_dir / "metrics.jsonl"
    while first.poll() is None and not (metrics.exists() and '"step"' in metrics.read_text()):  # a step logged
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGTERM)
    assert first.wait(timeout=120) != 0
    for _ in range(600):  # the run's own SIGTERM handler saves, then it exits (the sweep died at once)
        if not subprocess.run(["pgrep", "-f", f"run.dir={run_dir}"], capture_output=True).stdout:
            break
        time.sleep(0.1)
    (stopped,) = json.loads((run_dir / "attempts.json").read_text())
    assert stopped["from_step"] == 0 and "train_s" not in stopped
    saved_at = (run_dir / "checkpoints" / "latest").stat().st_mtime
    step = checkpoint.tag_step(checkpoint.latest_tag(run_dir / "checkpoints"))
    assert 0 < step < 100 and not (run_dir / "eval.json").exists()

    (run_dir / "attempts.json").rename(tmp_path / "attempts.json")
    unknown = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    assert unknown.returncode == 1 and "no attempt of this tool recorded" in unknown.stderr, unknown.stderr[-2000:]
    (tmp_path / "attempts.json").rename(run_dir / "attempts.json")

    second = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-4000:]
    (row,) = json.loads((out / "rows.json").read_text())["rows"]
    first_attempt, second_attempt = row["attempts"]
    assert (first_attempt["from_step"], first_attempt["to_step"]) == (0, step)
    assert (second_attempt["from_step"], second_attempt["to_step"]) == (step, 100)
    assert first_attempt["train_s"] == pytest.approx(saved_at - stopped["start"])
    assert row["train_s"] == pytest.approx(first_attempt["train_s"] + second_attempt["train_s"])
    assert row["load"] == [first_attempt["load"][0], second_attempt["load"][1]]
    log = (run_dir / "train.log").read_text()
    assert log.count("launch/pretrain.py") >= 2 and f"resumed from {run_dir / 'checkpoints'}" in log  # both kept
