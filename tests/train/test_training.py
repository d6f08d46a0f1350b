"""Real training runs: launch/pretrain.py on 2 gloo ranks (torchrun) or one plain python process.

One 20-step run per ZeRO stage is shared by the tests (each launch costs seconds of DeepSpeed start-up).
"""
import json
import math
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from pretrain.train import checkpoint

from launching import PYTHON, REPO, launch, read_metrics, tiny_overrides

pytestmark = pytest.mark.dist
STEPS = 20


def run_overrides(lm_data, run_dir, stage, **extra):
    return tiny_overrides(lm_data, run_dir, deepspeed__zero_stage=stage, train__max_steps=STEPS,
                          checkpoint__every=5, **extra)


@pytest.fixture(scope="module")
def zero_run(lm_data, tmp_path_factory):
    """``zero_run(stage)``: the run directory of a finished 2-rank run under that ZeRO stage (launched once).
    ZeRO 3 also recomputes activations (DeepSpeed's activation checkpointing), which must not change the math."""
    root, done = tmp_path_factory.mktemp("runs"), {}

    def get(stage: int) -> Path:
        if stage not in done:
            extra = {"deepspeed__activation_checkpointing": "true"} if stage == 3 else {}
            result = launch(run_overrides(lm_data, root / f"zero{stage}", stage, **extra), ranks=2)
            done[stage], STDERR[stage] = root / f"zero{stage}", result.stderr
        return done[stage]

    return get


STDERR: dict[int, str] = {}  # what zero_run's launches printed there, by stage


def losses(run_dir: Path) -> list[float]:
    metrics = read_metrics(run_dir)
    return [metrics[step]["train/loss"] for step in range(1, STEPS + 1)]


def test_loss_falls_and_every_metric_is_logged(zero_run):
    run = zero_run(0)
    curve = losses(run)
    assert sum(curve[-5:]) / 5 < sum(curve[:5]) / 5 - 1.0, curve
    metrics = read_metrics(run)
    for key in ("train/lr", "train/grad_norm", "train/tokens_per_s", "train/tokens_per_s_per_rank",
                "train/flops_per_s_per_rank", "train/peak_memory_bytes", "train/epoch", "train/tokens_seen"):
        assert all(math.isfinite(metrics[step][key]) for step in range(1, STEPS + 1)), key
    assert metrics[STEPS]["train/tokens_seen"] == STEPS * 2 * 4 * 64  # steps × ranks × micro-batch × seq_len
    assert metrics[1]["train/lr"] < metrics[5]["train/lr"] > metrics[STEPS]["train/lr"]  # warmup, then decay
    assert metrics[10]["val/ppl"] == pytest.approx(math.exp(metrics[10]["val/loss"]))
    assert metrics[STEPS]["val/loss"] < metrics[10]["val/loss"]
    ckpts = run / "checkpoints"
    assert checkpoint.latest_tag(ckpts) == "step00000020"
    assert sorted(p.name for p in ckpts.glob("step*")) == ["step00000015", "step00000020"]  # keep_last=2
    assert sorted(p.name for p in (ckpts / "step00000020").glob("client_state_*")) == [
        "client_state_rank00000.pt", "client_state_rank00001.pt"]
    saved = (run / "config.yaml").read_text()  # resolved: the vocabulary size comes from the tokenizer
    assert "vocab_size: 320" in saved and "dim: 64" in saved and "zero_stage: 0" in saved


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_follow_zero0(zero_run, stage):
    reference, metrics = read_metrics(zero_run(0)), read_metrics(zero_run(stage))
    for step in range(1, STEPS + 1):
        for key in ("train/loss", "train/grad_norm"):
            assert metrics[step][key] == pytest.approx(reference[step][key], rel=1e-5), (step, key)
    assert metrics[STEPS]["val/loss"] == pytest.approx(reference[STEPS]["val/loss"], rel=1e-5)
    # DeepSpeed's reduce_scatter_tensor call warned on every rank at every ZeRO step, 20 lines in 10 steps
    assert "Warning" not in STDERR[stage], STDERR[stage][-3000:]


def test_sigterm_saves_and_relaunch_resumes_exactly(zero_run, lm_data, tmp_path):
    """Preempt a ZeRO-2 run mid-way with SIGTERM to the whole process group (data-loader workers included); the
    relaunched run (without workers: the data state does not depend on them) must log the same losses, gradient
    norms and validation losses, bit for bit, as the uninterrupted one."""
    run = tmp_path / "preempted"
    overrides = run_overrides(lm_data, run, 2)
    argv = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "launch/pretrain.py",
            "--config", "configs/tiny_lm.yaml", *overrides, "data.num_workers=1"]
    process = subprocess.Popen(argv, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while not ((run / "metrics.jsonl").exists() and max(read_metrics(run), default=0) >= 3):
        assert process.poll() is None and time.time() < deadline, process.communicate()[0][-4000:]
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGTERM)
    output = process.communicate(timeout=300)[0]
    assert "stopped by SIGTERM" in output, output[-4000:]
    stopped_at = int(checkpoint.latest_tag(run / "checkpoints")[4:])
    assert 3 <= stopped_at < STEPS, output[-4000:]

    launch(overrides, ranks=2)
    resumed, reference = read_metrics(run), read_metrics(zero_run(2))
    assert [resumed[s]["train/loss"] for s in range(1, STEPS + 1)] == losses(zero_run(2))
    assert [resumed[s]["train/grad_norm"] for s in range(1, STEPS + 1)] == [
        reference[s]["train/grad_norm"] for s in range(1, STEPS + 1)]
    assert resumed[STEPS]["val/loss"] == reference[STEPS]["val/loss"]


def test_a_relaunch_with_more_steps_replans_the_decay_from_where_it_was(zero_run, lm_data, tmp_path):
    """train.max_steps may change on relaunch: the cosine decay goes on from the LR the resumed step had reached
    down to min_lr at the new max_steps, without a jump, and the relaunch says so; a later relaunch keeps that plan.
    The finished run relaunched as it is has nothing to do; a lowered max_steps is refused."""
    import shutil

    from pretrain.train.schedule import lr_at

    run = tmp_path / "extended"
    shutil.copytree(zero_run(0), run)
    (run / "checkpoints" / "latest").write_text(checkpoint.tag_for(15))
    overrides = [*run_overrides(lm_data, run, 0), f"train.max_steps={2 * STEPS}"]  # the later override wins
    out = launch(overrides, ranks=2).stdout
    assert f"train.max_steps changed from {STEPS} to {2 * STEPS}: the decay re-planned from step 15's LR" in out
    logged = read_metrics(run)
    schedule = dict(lr=3e-3, min_lr=3e-4, name="cosine", warmup_steps=5, decay_steps=0)  # tiny_overrides' values
    start = lr_at(15, max_steps=STEPS, **schedule)  # what the uninterrupted run logged at step 16
    assert logged[16]["train/lr"] == pytest.approx(start, rel=1e-9)
    for step in (17, 30, 2 * STEPS):  # a half cosine from (step index 15, start) to (2 * STEPS, min_lr)
        progress = (step - 1 - 15) / (2 * STEPS - 15)
        assert logged[step]["train/lr"] == pytest.approx(3e-4 + 0.5 * (start - 3e-4) * (1 + math.cos(math.pi *
                                                                                                     progress)))
    (run / "checkpoints" / "latest").write_text(checkpoint.tag_for(35))  # resumed again: the saved plan holds
    launch([*overrides, f"train.max_steps={2 * STEPS}"], ranks=2)
    assert read_metrics(run)[2 * STEPS]["train/lr"] == pytest.approx(logged[2 * STEPS]["train/lr"], rel=1e-12)

    # the finished run relaunched with the same command: one line, exit 0, decided from `latest` before any engine
    # is built or checkpoint loaded; a lowered max_steps is refused as early. Nothing of the run changes (run.lock
    # included: it is not even taken).
    def files():
        return {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in run.rglob("*") if p.is_file()}

    before = files()
    again = launch(overrides)
    assert again.returncode == 0 and "resumed from" not in again.stdout, again.stdout[-3000:]
    assert (f"run.dir {run} already finished at step {2 * STEPS} (train.max_steps {2 * STEPS}); nothing to do"
            in again.stdout.splitlines()), again.stdout[-3000:]
    lowered = launch([*overrides, f"train.max_steps={STEPS}"], check=False)
    assert lowered.returncode == 2 and "Traceback" not in lowered.stderr, lowered.stderr[-3000:]
    assert lowered.stderr.strip().splitlines()[-1] == (f"config error: train.max_steps: {STEPS} is not past the "
                                                       f"resumed step {2 * STEPS}: nothing to train; raise it to "
                                                       "continue"), lowered.stderr[-3000:]
    assert files() == before


@pytest.mark.parametrize("stage,ranks", [(0, 1), (3, 2)])
def test_eval_ppl_agrees_with_the_logged_validation_loss(zero_run, lm_data, stage, ranks):
    """One process, or two ranks sharing the documents; the checkpoint's weights reassembled from any ZeRO stage."""
    run = zero_run(stage)
    launcher = [PYTHON] if ranks == 1 else [PYTHON, "-m", "torch.distributed.run", "--standalone",
                                            f"--nproc_per_node={ranks}"]
    result = subprocess.run(launcher + ["tools/eval_ppl.py", "--run-dir", str(run), "--data", lm_data["val_shards"],
                                        "--batch-size", "3", "--json"],
                            cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    assert result.returncode == 0, f"eval_ppl failed ({result.returncode}):\n{result.stderr[-6000:]}"
    scores = json.loads(result.stdout.strip().splitlines()[-1])
    assert scores["ranks"] == ranks
    logged = read_metrics(run)[STEPS]
    assert scores["tokens"] == logged["val/tokens"]
    assert scores["nll"] == pytest.approx(logged["val/loss"], rel=1e-5)
    assert scores["ppl"] == pytest.approx(math.exp(scores["nll"]))
    assert scores["bits_per_byte"] == pytest.approx(scores["nll"] * scores["tokens"] / math.log(2) / scores["bytes"])


def test_eval_ppl_on_a_text_file_counts_tokens_bytes_and_words(zero_run, lm_data):
    from pretrain.data import Tokenizer

    result = subprocess.run([PYTHON, "tools/eval_ppl.py", "--run", str(zero_run(0)), "--data", lm_data["held_out"],
                             "--seq-len", "48", "--stride", "16", "--json"],
                            cwd=REPO, capture_output=True, text=True, check=True)
    scores = json.loads(result.stdout.strip().splitlines()[-1])
    # one paragraph (no blank line in it), so one document: make_shards' rule drops only the final newline
    text = Path(lm_data["held_out"]).read_text(encoding="utf-8").removesuffix("\n")
    assert scores["tokens"] == len(Tokenizer(lm_data["tokenizer"]).encode(text)) + 1  # + end of document
    assert scores["bytes"] == len(text.encode("utf-8"))
    assert scores["words"] == len(text.split()) + len(text.splitlines())
    total_nll = scores["nll"] * scores["tokens"]
    assert scores["word_ppl"] == pytest.approx(math.exp(total_nll / scores["words"]))
    assert 1.0 < scores["ppl"] < 320  # better than uniform over the vocabulary after training


def test_eval_ppl_by_position_splits_the_same_scores_into_doubling_buckets(zero_run, lm_data):
    command = [PYTHON, "tools/eval_ppl.py", "--run", str(zero_run(0)), "--data", lm_data["held_out"], "--seq-len", "64"]
    scores = json.loads(subprocess.run(command + ["--json", "--by-position"], cwd=REPO, capture_output=True,
                                       text=True, check=True).stdout.strip().splitlines()[-1])
    rows = scores["by_position"]
    assert [row["positions"] for row in rows][:4] == ["0", "1", "2-3", "4-7"]
    assert sum(row["tokens"] for row in rows) == scores["tokens"]
    assert sum(row["nll"] * row["tokens"] for row in rows) == pytest.approx(scores["nll"] * scores["tokens"])
    assert all(row["ppl"] == pytest.approx(math.exp(row["nll"])) for row in rows)
    plain = json.loads(subprocess.run(command + ["--json"], cwd=REPO, capture_output=True, text=True,
                                      check=True).stdout.strip().splitlines()[-1])
    assert plain["nll"] == pytest.approx(scores["nll"], rel=1e-6) and "by_position" not in plain
    table = subprocess.run(command + ["--by-position"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "positions" in table and "\n           2-3" in table


def test_context_position_scores_every_context_as_eval_ppl_does(zero_run, lm_data, tmp_path):
    run = str(zero_run(0))
    command = [PYTHON, "tools/context_position.py", "--run", f"tiny={run}", "--data", lm_data["held_out"],
               "--contexts", "16", "64", "--json", str(tmp_path / "ctx.json"), "--plot", str(tmp_path / "ctx.png")]
    made = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr[-4000:]
    rows = json.loads((tmp_path / "ctx.json").read_text())
    assert [(r["label"], r["context"], r["stride"], r["train_seq_len"]) for r in rows] == [("tiny", 16, 4, 64),
                                                                                          ("tiny", 64, 16, 64)]
    direct = json.loads(subprocess.run([PYTHON, "tools/eval_ppl.py", "--run", run, "--data", lm_data["held_out"],
                                        "--seq-len", "16", "--stride", "4", "--by-position", "--json"], cwd=REPO,
                                       capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    assert [b["positions"] for b in rows[0]["by_position"]] == [b["positions"] for b in direct["by_position"]]
    assert [b["nll"] for b in rows[0]["by_position"]] == pytest.approx([b["nll"] for b in direct["by_position"]])
    assert rows[0]["tokens"] == rows[1]["tokens"] == direct["tokens"]  # every token scored once, whatever the window
    assert "| positions | tokens | tiny @16 | tiny @64 |" in made.stdout and "\n| all |" in made.stdout
    assert (tmp_path / "ctx.png").stat().st_size > 0
    refused = subprocess.run([PYTHON, "tools/context_position.py", "--run", run, "--data", lm_data["held_out"],
                              "--contexts", "16"], cwd=REPO, capture_output=True, text=True)
    assert refused.returncode == 2 and "expected LABEL=RUN_DIR" in refused.stderr

    add = [PYTHON, "tools/context_position.py", "--run", f"again={run}", "--data", lm_data["held_out"], "--contexts",
           "16", "--json", str(tmp_path / "ctx.json"), "--add"]
    added = subprocess.run(add, cwd=REPO, capture_output=True, text=True)
    assert added.returncode == 0, added.stderr[-4000:]
    grown = json.loads((tmp_path / "ctx.json").read_text())
    assert [(r["label"], r["context"]) for r in grown] == [("tiny", 16), ("tiny", 64), ("again", 16)]
    # approx, as against eval_ppl above: two processes' CPU matmuls may round differently (seen: 7e-8 relative)
    assert grown[2]["nll"] == pytest.approx(rows[0]["nll"], rel=1e-6)
    assert "| tiny @16 | tiny @64 | again @16 |" in added.stdout
    (tmp_path / "ctx.json").write_text(json.dumps([dict(r, tokens=r["tokens"] + 1) for r in rows]))
    mismatched = subprocess.run(add, cwd=REPO, capture_output=True, text=True)
    assert mismatched.returncode == 1 and "not the same documents" in mismatched.stderr, mismatched.stderr[-3000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tensorboard_serves_the_logged_losses(zero_run):
    run, port = zero_run(0), _free_port()
    server = subprocess.Popen([str(Path(PYTHON).parent / "tensorboard"), "--logdir", str(run / "tensorboard"),
                               "--host", "127.0.0.1", "--port", str(port), "--reload_interval", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?run=.&tag=train/loss"
        deadline, points = time.time() + 120, []
        while len(points) < STEPS and time.time() < deadline:
            try:
                points = json.loads(urllib.request.urlopen(url, timeout=5).read())
            except (OSError, ValueError):
                time.sleep(0.5)
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert [step for _, step, _ in points] == list(range(1, STEPS + 1))
    assert [value for _, _, value in points] == pytest.approx(losses(run), rel=1e-6)  # stored as float32


def test_relaunch_with_a_changed_model_is_refused_and_loses_nothing(zero_run, lm_data):
    """Nothing of the run is written; run.lock, which names the launch holding the directory, is every launch's."""
    def files(run):
        return {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file() and p.name != "run.lock"}

    run = zero_run(0)
    before = files(run)
    result = launch(run_overrides(lm_data, run, 0, model__dim=96), ranks=1, check=False)
    assert result.returncode != 0
    assert "model.dim" in result.stderr
    assert files(run) == before


def test_bad_config_names_the_key(lm_data, tmp_path):
    result = launch(tiny_overrides(lm_data, tmp_path / "bad", model__n_heads=3), check=False)
    assert result.returncode == 2 and "model.n_heads" in result.stderr
    assert not (tmp_path / "bad").exists()
    nowhere = str(tmp_path / "no_shards" / "shard-{000000..000009}.tar")
    result = launch(tiny_overrides(lm_data, tmp_path / "bad", data__train_shards=nowhere), check=False)
    assert result.returncode == 2 and "data.train_shards" in result.stderr, result.stderr[-3000:]


def test_nonfinite_steps_stop_the_run_keeping_the_last_good_checkpoint(lm_data, tmp_path):
    """A learning rate of 100 blows the weights up within a few steps (plain python, one process, no ZeRO)."""
    run = tmp_path / "diverging"
    result = launch(tiny_overrides(lm_data, run, optim__lr=100.0, optim__min_lr=0, schedule__warmup_steps=10,
                                   checkpoint__every=1, train__max_nonfinite_steps=3, data__val_shards="null"),
                    check=False)
    assert result.returncode == 1
    assert "3 non-finite steps in a row (train.max_nonfinite_steps=3)" in result.stderr, result.stderr[-3000:]
    good = checkpoint.latest_tag(run / "checkpoints")
    assert good is not None and good in result.stderr
    metrics = read_metrics(run)
    good_step = int(good[4:])
    assert all(math.isfinite(metrics[s]["train/loss"]) and math.isfinite(metrics[s]["train/grad_norm"])
               for s in range(1, good_step + 1))
    assert "non-finite" in result.stdout and good_step + 3 not in metrics
    weights = checkpoint.load_model_weights(run / "checkpoints", good, zero_stage=0)
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_dry_run_prints_sizes_as_json():
    """--dry-run wires the launcher to pretrain.estimate: a 1B config on the meta device, no training, no data."""
    def dry_run(world_size):
        result = subprocess.run([PYTHON, "launch/pretrain.py", "--config", "configs/softmax_lm_1b.yaml", "--dry-run",
                                 "--world-size", str(world_size)],
                                cwd=REPO, capture_output=True, text=True, check=True, timeout=600)
        return json.loads(result.stdout.strip().splitlines()[-1])

    one, eight = dry_run(1), dry_run(8)
    assert 0.9e9 < one["parameters"] == eight["parameters"] < 2e9
    assert one["flops_per_token"] > 6 * one["parameters"]  # 3 × forward, attention included
    assert eight["memory_per_rank_bytes"] < one["memory_per_rank_bytes"]  # ZeRO shards states over ranks


def test_dry_run_without_a_vocabulary_is_a_config_error_naming_the_key(tmp_path):
    """A dry run that cannot size the embedding says which key to set, as one line, not a traceback."""
    result = subprocess.run([PYTHON, "launch/pretrain.py", "--config", "configs/tiny_lm.yaml", "--dry-run",
                             f"data.tokenizer={tmp_path / 'absent.model'}"],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 2
    assert "model.vocab_size" in result.stderr and "Traceback" not in result.stderr


def test_gradient_accumulation_reproduces_the_larger_micro_batch(lm_data, tmp_path):
    """Two accumulated micro-batches of 2 rows (ZeRO 2) step like one of 4 rows (no ZeRO): same rows, same mean."""
    runs = {"whole": dict(deepspeed__zero_stage=0, train__micro_batch_size=4, train__grad_accum_steps=1),
            "accumulated": dict(deepspeed__zero_stage=2, train__micro_batch_size=2, train__grad_accum_steps=2)}
    metrics = {}
    for name, extra in runs.items():
        launch(tiny_overrides(lm_data, tmp_path / name, train__max_steps=8, data__val_shards="null", **extra))
        metrics[name] = read_metrics(tmp_path / name)
    assert metrics["accumulated"][8]["train/tokens_seen"] == metrics["whole"][8]["train/tokens_seen"]
    for step in range(1, 9):
        for key in ("train/loss", "train/grad_norm"):
            assert metrics["accumulated"][step][key] == pytest.approx(metrics["whole"][step][key], rel=1e-5)


def test_deepspeed_launcher_trains_and_leaves_no_shared_memory_behind(lm_data, tmp_path):
    """`deepspeed --num_gpus 2` on CPU: both ranks train; the per-rank /dev/shm buffers DeepSpeed maps are unlinked.

    Left behind, each would hold 69 MB of RAM after the run and be mapped stale by the next run on that port.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp_path / "ds"
    argv = [PYTHON, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port),
            "launch/pretrain.py", "--config", "configs/tiny_lm.yaml"]
    result = subprocess.run(argv + tiny_overrides(lm_data, run, train__max_steps=3, schedule__warmup_steps=1,
                                                          data__val_shards="null"),
                            cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    assert result.returncode == 0, f"deepspeed launcher failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    assert sorted(read_metrics(run)) == [1, 2, 3]
    shm = Path("/dev/shm")
    if shm.is_dir():
        assert not [p.name for p in shm.glob(f"deepspeed_allreduce_buffer_*_{port}_*")]
