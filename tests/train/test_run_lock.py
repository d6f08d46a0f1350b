"""One run per directory: a second launch is refused naming the holder; a killed holder blocks nothing."""
import os
import signal
import socket
import subprocess
import time

import pytest

from pretrain.train import run_lock

from launching import PYTHON, REPO, launch, tiny_overrides

HOLDER = """
import sys, time
from pathlib import Path
from pretrain.train.run_lock import acquire
acquire(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(600)
"""


def hold_in_another_process(run_dir) -> subprocess.Popen:
    holder = subprocess.Popen([PYTHON, "-c", HOLDER, str(run_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def test_a_held_directory_is_refused_naming_the_holder_and_a_killed_holder_releases_it(tmp_path):
    holder = hold_in_another_process(tmp_path)
    try:
        with pytest.raises(run_lock.RunDirLockedError) as refused:
            run_lock.acquire(tmp_path)
        assert f"pid {holder.pid} on host {socket.gethostname()}" in str(refused.value)
        assert f"({tmp_path / 'run.lock'})" in str(refused.value)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    fd, note = run_lock.acquire(tmp_path)  # the kernel released it; the file still names the dead holder
    assert f"took {tmp_path / 'run.lock'} over from pid {holder.pid} on host" in note
    assert "ended without releasing it" in note
    run_lock.release(fd)
    fd, note = run_lock.acquire(tmp_path)  # a release blanks the name: nothing to report
    assert note == ""
    run_lock.release(fd)


def test_a_forked_child_does_not_keep_the_lock(tmp_path):
    fd, _ = run_lock.acquire(tmp_path)
    child = os.fork()
    if child == 0:  # the parent releases while the child lives on
        time.sleep(3)
        os._exit(0)
    try:
        time.sleep(0.5)  # the child has closed its copy (at once after the fork)
        run_lock.release(fd)
        fd, _ = run_lock.acquire(tmp_path)
        run_lock.release(fd)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


@pytest.mark.dist
def test_a_second_launch_on_a_held_run_dir_is_refused_on_every_rank_in_one_line(lm_data, tmp_path):
    """Two ranks: rank 0 finds the lock held, the other rank is told; one line, exit 1, nothing written."""
    run = tmp_path / "run"
    holder = hold_in_another_process(run)
    try:
        result = launch(tiny_overrides(lm_data, run), ranks=2, check=False, timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode != 0, result.stderr[-3000:]
    assert "RunDirLockedError" not in result.stderr, result.stderr[-3000:]  # torchrun's own report aside, no trace
    said = [line for line in result.stderr.splitlines() if line.startswith("error: run.dir ")]
    assert len(said) == 1, result.stderr[-3000:]
    assert f"is in use by pid {holder.pid} on host {socket.gethostname()}" in said[0], said
    assert sorted(p.name for p in run.iterdir()) == ["run.lock"]
