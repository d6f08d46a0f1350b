"""Runs that fail fast and lose nothing: real faults (a full disk, a corrupt shard, a killed process) in real runs.

Each run has a data-loader worker alive when the fault strikes (``data.num_workers=1``): a worker that outlived its
trainer's error once kept the process waiting on it forever.
"""
import os
import resource
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from pretrain.data import TokenLoader
from pretrain.exit_codes import CONFIG_ERROR, CORRUPT_SHARD
from pretrain.train import checkpoint

from launching import PYTHON, REPO, launch, read_metrics, tiny_overrides

pytestmark = pytest.mark.dist
PROMPTLY = 90  # seconds a failing run may take to end (DeepSpeed's start-up included)


def start(overrides: list[str], ranks: int = 1, launcher: str = "python") -> subprocess.Popen:
    """launch/pretrain.py in a session of its own, output merged, as a user would start it."""
    if launcher == "python":
        argv = [PYTHON, "launch/pretrain.py"]
    elif launcher in ("torchrun", "pretrain-torchrun"):  # torchrun's agent, or ours around it (launch/torchrun.py)
        agent = ["-m", "torch.distributed.run"] if launcher == "torchrun" else ["launch/torchrun.py"]
        argv = [PYTHON, *agent, "--standalone", f"--nproc_per_node={ranks}", "launch/pretrain.py"]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        argv = [PYTHON, "-m", "deepspeed.launcher.runner", f"--num_gpus={ranks}", f"--master_port={port}",
                "launch/pretrain.py"]
    return subprocess.Popen(argv + ["--config", "configs/tiny_lm.yaml", *overrides], cwd=REPO,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(condition, process: subprocess.Popen, what: str, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while not condition():
        if process.poll() is not None or time.time() > deadline:
            output = process.communicate()[0] if process.poll() is not None else "(still running)"
            kill_session(process)
            raise AssertionError(f"no {what}:\n{output[-4000:]}")
        time.sleep(0.01)


def parents() -> dict[int, int]:
    """pid -> parent pid of every live process (zombies are dead)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in ("Z", "X"):
            found[int(stat.parent.name)] = int(fields[1])
    return found


def process_tree(root: int) -> set[int]:
    """A live process and its live descendants (a launcher, its ranks and their loader workers)."""
    links, tree = parents(), {root}
    grew = True
    while grew:
        grown = tree | {pid for pid, parent in links.items() if parent in tree}
        grew, tree = grown != tree, grown
    return tree & set(links)


def kill_tree(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_session(process: subprocess.Popen) -> None:
    kill_tree(process_tree(process.pid))


def finish(process: subprocess.Popen, timeout: float = PROMPTLY) -> str:
    """The run's output once it ended by itself, within ``timeout``; none of its processes may outlive it."""
    running = process_tree(process.pid)
    try:
        output = process.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        kill_tree(running | process_tree(process.pid))
        raise AssertionError(f"the run did not end within {timeout} s:\n{process.communicate()[0][-4000:]}") from None
    deadline = time.time() + 10  # workers notice a dead parent within seconds
    while running & set(parents()) and time.time() < deadline:
        time.sleep(0.1)
    left = running & set(parents())
    kill_tree(left)
    assert not left, f"processes left behind: {left}\n{output[-4000:]}"
    return output


def complete_tags(ckpt_dir: Path) -> list[str]:
    return sorted(p.name for p in ckpt_dir.glob("step*") if checkpoint.is_complete(ckpt_dir, p.name))


UNCAUGHT_WITH_A_WORKER = """
from torch.utils.data import DataLoader, IterableDataset
from pretrain.train.preemption import StopRequest, held_from_child_processes

class Forever(IterableDataset):
    def __iter__(self):
        return iter(int, 1)

with StopRequest():
    with held_from_child_processes():
        batches = iter(DataLoader(Forever(), batch_size=None, num_workers=1))
        next(batches)
    raise RuntimeError("an error nobody catches")
"""


def test_an_uncaught_error_with_a_loader_worker_alive_ends_the_process():
    """The common cause of the hangs: a worker forked with the preemption signals held kept them held, so the
    interpreter's exit, terminating it, waited forever. Any error, caught or not, must end the process."""
    process = subprocess.Popen([PYTHON, "-c", UNCAUGHT_WITH_A_WORKER], cwd=REPO, start_new_session=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = finish(process, timeout=60)
    assert process.returncode == 1 and "RuntimeError: an error nobody catches" in output, output


def test_a_full_disk_at_a_save_ends_the_run_naming_the_tag_and_keeps_latest(lm_data, tmp_path):
    """The trainer's file size limit drops below a checkpoint's size after its first save (a full disk, as the
    process sees it: writes fail with EFBIG); the next save must end the run, non-zero and promptly, with one line
    naming the tag and the space left, and leave the first checkpoint as ``latest`` and no partial tag."""
    run = tmp_path / "run"
    process = start(tiny_overrides(lm_data, run, data__num_workers=1, train__max_steps=10_000, checkpoint__every=5,
                                   log__val_every=10_000))
    ckpts = run / "checkpoints"
    wait_for(lambda: checkpoint.latest_tag(ckpts) is not None, process, "first checkpoint")
    good = checkpoint.latest_tag(ckpts)
    largest = max(path.stat().st_size for path in (ckpts / good).iterdir())
    resource.prlimit(process.pid, resource.RLIMIT_FSIZE, (largest // 2, largest // 2))

    output = finish(process)
    assert process.returncode == 1, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    error = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(error) == 1, output[-4000:]
    assert f"could not write checkpoint {ckpts}/step" in error[0] and "MiB free there" in error[0], error
    assert f"file size limit (ulimit -f) {largest // 2:,} bytes" in error[0], error
    assert f"`latest` still names {good}" in error[0], error
    assert checkpoint.latest_tag(ckpts) == good
    assert checkpoint.partial_tags(ckpts) == [] and complete_tags(ckpts)[-1] == good


def test_a_full_disk_for_the_metrics_ends_the_run_naming_the_run_directory(lm_data, tmp_path):
    """A write that names no file (a failed append or flush of the metrics) still ends the run in one line naming
    where it was writing and the room left there."""
    run = tmp_path / "run"
    process = start(tiny_overrides(lm_data, run, data__num_workers=1, train__max_steps=10_000, checkpoint__every=10_000,
                                   log__val_every=10_000))
    metrics = run / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.stat().st_size > 2000, process, "metrics")
    limit = metrics.stat().st_size
    resource.prlimit(process.pid, resource.RLIMIT_FSIZE, (limit, limit))
    output = finish(process)
    assert process.returncode == 1, output[-4000:]
    error = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(error) == 1, output[-4000:]
    assert f"File too large, writing under {run} (" in error[0] and "MiB free there" in error[0], error


def test_a_corrupt_shard_met_mid_run_saves_the_last_step_and_names_the_key_that_skips_it(lm_data, tmp_path):
    """A shard this rank first reads at step 7 is truncated: the worker meets it mid-run, after the last periodic
    checkpoint. The run must save the last completed step (nothing was, before: the steps since the last checkpoint
    were lost), end at once with ``CORRUPT_SHARD`` and one line naming the shard and ``data.skip_corrupt``; the
    relaunch with it leaves the shard out, counts it, and trains exactly as a run that skipped it from the start."""
    data = tmp_path / "shards"
    shutil.copytree(Path(lm_data["train_shards"]).parent, data)
    pattern = str(data / "shard-{000000..000099}.tar")
    loader = TokenLoader(pattern, seq_len=64, batch_size=4, seed=0)  # the run's rows
    first_read: dict[str, int] = {}
    for row in range(loader.lanes * 4):
        first_read.setdefault(loader.place_of_row(row)[0], row)
    corrupt = Path(min((row, url) for url, row in first_read.items() if row >= 6 * 4)[1])  # first met at step 7
    corrupt.write_bytes(corrupt.read_bytes()[:5000])
    run = tmp_path / "run"
    settings = dict(data__train_shards=pattern, data__num_workers=1, checkpoint__every=1000, log__val_every=1000,
                    schedule__name="constant")  # constant: a changed max_steps leaves the LR as it was
    process = start(tiny_overrides(lm_data, run, train__max_steps=1000, **settings))
    output = finish(process, timeout=PROMPTLY + 60)
    assert process.returncode == CORRUPT_SHARD, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    error = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and corrupt.name in error[0], output[-4000:]
    assert output.startswith("joining 1 rank\n"), output[:2000]  # before anything else; the op is built already
    assert "step 0: opening the training shards (data.num_workers=1)" in output, output[-4000:]
    assert "built successfully" not in output and "Setting accelerator" not in output, output[:2000]
    ckpts = run / "checkpoints"
    saved = max(read_metrics(run))  # the last step trained, before the one whose batch was unreadable
    assert saved >= 4 and checkpoint.latest_tag(ckpts) == checkpoint.tag_for(saved) == complete_tags(ckpts)[-1]
    assert f"at step {saved + 1}; saved step {saved} ({ckpts / checkpoint.tag_for(saved)}). Relaunch the same " \
           "command with data.skip_corrupt=true to leave the shard out" in error[0], error[0]

    steps = saved + 3
    resumed = launch(tiny_overrides(lm_data, run, train__max_steps=steps, data__skip_corrupt="true", **settings))
    assert f"resumed from {ckpts / checkpoint.tag_for(saved)}" in resumed.stdout, resumed.stdout[-3000:]
    reference = tmp_path / "skipping"
    launch(tiny_overrides(lm_data, reference, train__max_steps=steps, data__skip_corrupt="true", **settings))
    after, expected = read_metrics(run), read_metrics(reference)
    assert [after[s]["train/loss"] for s in range(1, steps + 1)] == [expected[s]["train/loss"]
                                                                     for s in range(1, steps + 1)]
    assert after[saved]["train/skipped_shards"] == 0 and after[steps]["train/skipped_shards"] == 1


def wchan(pid: int) -> str:
    """Where in the kernel a process waits (opening a FIFO nobody reads: ``wait_for_partner``, or ``fifo_open``)."""
    try:
        return Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return ""


def test_a_kill_during_a_save_leaves_a_partial_tag_the_relaunch_removes_and_resumes_exactly(lm_data, tmp_path):
    """A FIFO in place of the next tag's client-state file holds the trainer inside that save (DeepSpeed's files
    written, its own not) until it is SIGKILLed with its worker: a real partial tag. The relaunch must remove it and
    resume from the last complete checkpoint, logging what an uninterrupted run logs, bit for bit."""
    overrides = dict(data__num_workers=1, train__max_steps=20, checkpoint__every=5, log__val_every=10)
    reference = tmp_path / "reference"
    launch_run = start(tiny_overrides(lm_data, reference, **overrides))
    assert finish(launch_run, timeout=300) and launch_run.returncode == 0

    run = tmp_path / "run"
    process = start(tiny_overrides(lm_data, run, **overrides))
    ckpts = run / "checkpoints"
    wait_for(lambda: checkpoint.latest_tag(ckpts) == "step00000010", process, "checkpoint at step 10")

    def held_in_the_save_of_step_15() -> bool:
        # The step-10 save prunes partial tags after it moves ``latest``: a FIFO planted in that moment is removed
        # with its tag (CI saw it once), so it is planted again until the trainer waits on it.
        try:
            (ckpts / "step00000015").mkdir(exist_ok=True)
            os.mkfifo(ckpts / "step00000015" / "client_state_rank00000.tmp")
        except OSError:  # planted already, or its tag is being pruned this instant
            pass
        return wchan(process.pid) in ("wait_for_partner", "fifo_open")

    wait_for(held_in_the_save_of_step_15, process, "save of step 15")
    assert (ckpts / "step00000015" / "mp_rank_00_model_states.pt").exists()
    kill_session(process)
    process.communicate(timeout=30)
    assert checkpoint.partial_tags(ckpts) == ["step00000015"] and checkpoint.latest_tag(ckpts) == "step00000010"
    refused = subprocess.run([PYTHON, "tools/eval_ppl.py", "--run", str(run), "--tag", "step00000015", "--data",
                              lm_data["held_out"]], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert (f"checkpoint {ckpts / 'step00000015'} is partial" in refused.stderr
            and "pass a complete tag: step00000005, step00000010" in refused.stderr), refused.stderr[-3000:]

    relaunch = start(tiny_overrides(lm_data, run, **overrides))
    output = finish(relaunch, timeout=300)
    assert relaunch.returncode == 0, output[-4000:]
    assert f"removed partial checkpoint {ckpts / 'step00000015'}" in output, output[-4000:]
    assert f"resumed from {ckpts / 'step00000010'} at step 10" in output, output[-4000:]
    expected, resumed = read_metrics(reference), read_metrics(run)
    for key in ("train/loss", "train/grad_norm"):
        assert [resumed[s][key] for s in range(1, 21)] == [expected[s][key] for s in range(1, 21)], key
    assert resumed[20]["val/loss"] == expected[20]["val/loss"]
    assert complete_tags(ckpts) == ["step00000015", "step00000020"] and checkpoint.partial_tags(ckpts) == []


def test_pruning_never_counts_a_partial_tag(tmp_path):
    """A relaunch with another checkpoint.every once pruned a good checkpoint and kept a broken one: the partial tag
    must go, the complete ones stay."""
    ckpts = tmp_path / "checkpoints"
    for step, complete in ((10, True), (15, True), (20, False)):
        (ckpts / checkpoint.tag_for(step)).mkdir(parents=True)
        if complete:
            (ckpts / checkpoint.tag_for(step) / checkpoint.COMPLETE).touch()
    (ckpts / "latest").write_text("step00000015")
    assert checkpoint.partial_tags(ckpts) == ["step00000020"]
    checkpoint._prune(ckpts, keep_last=2, keep="step00000015")
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step00000010", "step00000015"]


def test_make_shards_verify_finds_a_corrupt_shard_up_front(lm_data, tmp_path):
    data = tmp_path / "shards"
    shutil.copytree(Path(lm_data["train_shards"]).parent, data)
    good = subprocess.run([PYTHON, "tools/make_shards.py", "verify", "--data", str(data)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert good.returncode == 0 and "12 shards match" in good.stdout, good.stderr
    raw = bytearray((data / "shard-000004.tar").read_bytes())
    raw[700] ^= 1  # one flipped bit inside a member: the tar still reads
    (data / "shard-000004.tar").write_bytes(bytes(raw))
    bad = subprocess.run([PYTHON, "tools/make_shards.py", "verify", "--data", str(data / "shard-{000000..000099}.tar")],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr, bad.stderr
    assert bad.stderr.startswith("error: 1 of 12 shards fail verification: ") and "shard-000004.tar" in bad.stderr


def rank_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of a launched rank: the process with that RANK whose parent has none (its loader workers have)."""
    def env_rank(pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return None
        return next((int(v[5:]) for v in env if v.startswith(b"RANK=")), None)

    def parent(pid):
        try:
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            return None

    for pid in process_tree(launcher_pid):
        if env_rank(pid) == rank and env_rank(parent(pid)) is None:
            return pid
    return None


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed", "pretrain-torchrun"])
def test_a_rank_killed_mid_training_ends_the_job_naming_it_and_the_checkpoint(lm_data, tmp_path, launcher):
    """SIGKILL one of two ranks after the first checkpoint: the launcher must end the job, non-zero, within a bounded
    time, and the surviving rank say which rank died and which checkpoint a relaunch resumes from."""
    run = tmp_path / "run"
    process = start(tiny_overrides(lm_data, run, data__num_workers=1, train__max_steps=10_000, checkpoint__every=3,
                                   log__val_every=10_000), ranks=2, launcher=launcher)
    ckpts = run / "checkpoints"
    wait_for(lambda: checkpoint.latest_tag(ckpts) is not None and rank_pid(process.pid, 1), process,
             "first checkpoint")
    victim = rank_pid(process.pid, 1)
    os.kill(victim, signal.SIGKILL)
    output = finish(process)
    assert process.returncode != 0, output[-4000:]
    latest = checkpoint.latest_tag(ckpts)
    assert output.count("joining 2 ranks") == 1, output[-4000:]  # said once, by rank 0
    said = [line for line in output.splitlines() if "error on rank 0: " in line]
    assert len(said) == 1, output[-4000:]
    assert f"rank 1 (pid {victim}) died at step" in said[0], said
    assert f"relaunch the same command to resume from {ckpts / latest}" in said[0], said
    if launcher == "pretrain-torchrun":  # the killed rank named in one line, and a shell's status for its signal
        assert process.returncode == 128 + signal.SIGKILL, output[-4000:]
        assert f"rank 1 (pid {victim}) was killed by SIGKILL" in output.splitlines(), output[-4000:]
        assert "ChildFailedError" not in output and "Traceback" not in output, output[-4000:]


def test_a_config_error_under_torchrun_is_said_once_and_under_pretrain_torchrun_exits_2(lm_data, tmp_path):
    """Every rank finds the same config error: rank 0 says it, once (each rank did, each followed by torchrun's
    35-42-line report); launch/torchrun.py prints nothing else and exits with the ranks' status, not 1."""
    overrides = tiny_overrides(lm_data, tmp_path / "run", model__n_heads=3)
    said = "config error: model.n_heads: model.dim 64 must be divisible by model.n_heads 3"
    plain = start(overrides, ranks=2, launcher="torchrun")
    output = finish(plain)
    assert plain.returncode == 1 and output.count(said) == 1, output[-4000:]
    ours = start(overrides, ranks=2, launcher="pretrain-torchrun")
    output = finish(ours)
    assert ours.returncode == CONFIG_ERROR, output[-4000:]
    assert [line for line in output.splitlines() if line.strip()] == [f"{said} (got 3)"], output[-4000:]


def test_a_build_lock_is_stale_only_when_no_process_holds_it(tmp_path):
    from pretrain.distributed.build_locks import stale_build_locks

    lock = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    fd = os.open(lock, os.O_CREAT | os.O_EXCL)  # as torch's FileBaton takes it, held by this live process
    try:
        assert stale_build_locks(str(tmp_path), recheck_after_s=0) == []
    finally:
        os.close(fd)
    assert stale_build_locks(str(tmp_path), recheck_after_s=0) == [str(lock)]


def test_a_stale_comm_op_build_lock_ends_the_run_naming_what_to_remove(lm_data, tmp_path):
    """A build of DeepSpeed's CPU comm op killed midway leaves its lock; torch would wait on it forever. In a private
    TORCH_EXTENSIONS_DIR (never the shared cache), the run must end at once naming the directory to remove."""
    extensions = tmp_path / "torch_extensions"
    lock = extensions / "deepspeed_shm_comm" / "lock"  # where torch builds the op under TORCH_EXTENSIONS_DIR
    lock.parent.mkdir(parents=True)
    lock.touch()
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=str(extensions))
    process = subprocess.Popen([PYTHON, "launch/pretrain.py", "--config", "configs/tiny_lm.yaml",
                                *tiny_overrides(lm_data, tmp_path / "run")], cwd=REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = finish(process, timeout=60)
    assert process.returncode == 1 and "Traceback" not in output, output[-4000:]
    assert f"error: {lock} is a stale lock" in output and f"remove {lock.parent} " in output, output[-4000:]
