"""A resume's checkpoint conversion outside every collective, and the same conversion ahead of the launch
(issue 46 item 3; pretrain/train/universal.py, tools/reshard.py).

A run of 4 steps on one rank at ZeRO 2 (partitioned optimizer states) is the checkpoint under test: its step-2
copy is converted while two ranks wait under a 2-second process-group timeout, and converted ahead by the tool
before a resume on two ranks that must continue as the uninterrupted run.
"""
import json
import subprocess

import pytest

from pretrain.train import checkpoint, universal

import launching
from launching import PYTHON, REPO, launch, read_metrics, tiny_overrides

pytestmark = pytest.mark.dist
STEPS = 4


def overrides(lm_data, run_dir, **extra):
    settings = dict(train__max_steps=STEPS, checkpoint__every=2, schedule__warmup_steps=1, log__val_every=100,
                    optim__eps=1e-6, deepspeed__zero_stage=2)
    return tiny_overrides(lm_data, run_dir, **{**settings, **extra})


@pytest.fixture(scope="module")
def reference(lm_data, tmp_path_factory):
    """An uninterrupted one-rank run whose global batch two ranks keep without accumulation."""
    run = tmp_path_factory.mktemp("reshard") / "reference"
    launch(overrides(lm_data, run, train__grad_accum_steps=2))
    return run


def rewound(run, tmp_path):
    return launching.rewound(run, tmp_path, to=checkpoint.tag_for(2), drop=checkpoint.tag_for(STEPS))


def test_ranks_wait_for_a_conversion_longer_than_the_process_group_timeout(reference, tmp_path):
    tag_dir = rewound(reference, tmp_path) / "checkpoints" / checkpoint.tag_for(2)
    timeout_s = 2.0
    command = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "tests/train/reshard_worker.py", str(tag_dir), str(tmp_path), str(timeout_s)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert seen[0]["seconds"] > 0 and seen[1]["seconds"] is None  # rank 0 converted; rank 1 did not
    assert seen[1]["waited"] > 3 * timeout_s  # rank 1 waited past the timeout, outside any collective
    assert universal.universal_dir(tag_dir).is_dir()
    assert not list(tag_dir.glob("universal.*"))  # no temporary folder, no failure record left


def test_a_conversion_made_ahead_is_loaded_by_the_resume(reference, lm_data, tmp_path):
    resumed = rewound(reference, tmp_path)
    tool = subprocess.run([PYTHON, "tools/reshard.py", "--run", str(resumed), "--workers", "2"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert tool.returncode == 0, tool.stderr[-3000:]
    assert tool.stdout.startswith(f"converted {resumed / 'checkpoints' / checkpoint.tag_for(2)} (")
    assert "s per billion parameters" in tool.stdout
    out = launch(overrides(lm_data, resumed, parallel__collective_timeout_s=60), ranks=2).stdout
    assert "elastic resume: written by 1 rank(s)" in out and "converted ahead of the launch" in out
    got, want = read_metrics(resumed), read_metrics(reference)
    for step in (3, 4):
        for key in ("train/loss", "train/grad_norm"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-5), (step, key)
    assert not universal.universal_dir(resumed / "checkpoints" / checkpoint.tag_for(2)).exists()  # loaded, removed


def test_the_tool_names_what_it_cannot_convert(tmp_path):
    result = subprocess.run([PYTHON, "tools/reshard.py", "--run", str(tmp_path)], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == f"error: {tmp_path / 'checkpoints' / 'latest'}: no complete checkpoint there"
