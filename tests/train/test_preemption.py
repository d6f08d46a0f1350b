"""A clean stop under every launcher (issue 28, item 2): SIGTERM to the launcher's pid, to the process group or to
one rank makes every rank save once and exit non-zero, and leaves no process behind, loader workers included."""
import os
import re
import signal

import pytest
from test_faults import complete_tags, finish, rank_pid, start, wait_for

from pretrain.exit_codes import PREEMPTED
from pretrain.train import checkpoint

from launching import read_metrics, tiny_overrides

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("launcher,target,workers", [
    ("deepspeed", "launcher", 1),  # the `deepspeed` command forwards nothing: its ranks once trained on as orphans
    ("deepspeed", "launcher", 0),
    ("deepspeed", "group", 1),     # its per-node launcher SIGTERMs every rank's workers before the rank
    ("torchrun", "launcher", 1),
    ("torchrun", "launcher", 0),
    ("pretrain-torchrun", "launcher", 1),  # torchrun's agent inside ours: the ranks' 75, no SignalException report
    ("python", "rank", 0),         # the rank is the process: it must exit with PREEMPTED
])
def test_sigterm_saves_once_on_every_rank_and_leaves_no_process(lm_data, tmp_path, launcher, target, workers):
    run = tmp_path / "run"
    ranks = 1 if launcher == "python" else 2
    process = start(tiny_overrides(lm_data, run, data__num_workers=workers, train__max_steps=10_000,
                                   checkpoint__every=1_000, log__val_every=10_000), ranks=ranks, launcher=launcher)
    last_rank = (lambda: process.pid) if launcher == "python" else (lambda: rank_pid(process.pid, ranks - 1))
    wait_for(lambda: (run / "metrics.jsonl").exists() and max(read_metrics(run), default=0) >= 2 and last_rank(),
             process, "training steps")
    if target == "launcher":
        os.kill(process.pid, signal.SIGTERM)
    elif target == "group":
        os.killpg(process.pid, signal.SIGTERM)
    else:
        os.kill(last_rank(), signal.SIGTERM)
    output = finish(process)

    said = re.findall(r"stopped by (.+) at step (\d+); relaunch the same command to resume", output)
    assert len(said) == 1, output[-4000:]  # rank 0 speaks for every rank
    step = int(said[0][1])
    assert complete_tags(run / "checkpoints") == [checkpoint.tag_for(step)], output[-4000:]  # saved once, complete
    if launcher in ("python", "pretrain-torchrun"):
        assert process.returncode == PREEMPTED, output[-4000:]
        assert "Traceback" not in output and "SignalException" not in output, output[-4000:]
    else:
        assert process.returncode != 0, output[-4000:]
    if target == "launcher" and launcher == "deepspeed":
        assert said[0][0].startswith("the end of the command that started the deepspeed launcher"), said
