"""Elastic resume and what a relaunch may change, with real DeepSpeed runs on gloo ranks (issue 28 items 1, 5).

A run of 4 steps saves at steps 2 and 4; its copy is rewound to step 2 (as if stopped there) and resumed on another
number of ranks, or another ``parallel.sequence_parallel``, with the accumulation that keeps the global batch: its
steps 3 and 4 must equal the uninterrupted run's to 1e-5 (fp32). metrics.jsonl and tensorboard then hold each step
once. A changed global batch is said in one line; a key that may not change, in one line with no traceback. (A
changed ``train.max_steps``: tests/train/test_training.py.)
"""
import json
import shutil

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pretrain.train import checkpoint

import launching
from launching import launch, read_metrics, tiny_overrides

pytestmark = pytest.mark.dist
STEPS = 4


def overrides(lm_data, run_dir, **extra):
    settings = dict(train__max_steps=STEPS, checkpoint__every=2, schedule__warmup_steps=1, log__val_every=100,
                    optim__eps=1e-6)  # optim.eps: see test_sequence_parallel_training
    return tiny_overrides(lm_data, run_dir, **{**settings, **extra})


@pytest.fixture(scope="module")
def runs(lm_data, tmp_path_factory):
    """``runs(ranks, **extra)``: the directory of a finished uninterrupted run (each launched once)."""
    root, done = tmp_path_factory.mktemp("elastic"), {}

    def get(ranks: int, **extra):
        key = (ranks, *sorted(extra.items()))
        if key not in done:
            done[key] = root / f"r{ranks}_{len(done)}"
            launch(overrides(lm_data, done[key], **extra), ranks=ranks)
        return done[key]

    return get


def rewound(run, tmp_path):
    return launching.rewound(run, tmp_path, to=checkpoint.tag_for(2), drop=checkpoint.tag_for(STEPS))


def assert_continues(resumed, reference, *, rel=1e-5):
    got, want = read_metrics(resumed), read_metrics(reference)
    for step in (3, 4):
        for key in ("train/loss", "train/grad_norm", "train/lr"):
            assert got[step][key] == pytest.approx(want[step][key], rel=rel), (step, key)
    assert got[STEPS]["train/tokens_seen"] == want[STEPS]["train/tokens_seen"]
    steps = [json.loads(line)["step"] for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))  # each step once, the resumed run's
    events = EventAccumulator(str(resumed / "tensorboard"))  # reads every launch's event file, as tensorboard does
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (step, pytest.approx(got[step]["train/loss"])) for step in range(1, STEPS + 1)]


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_resume_on_one_with_accumulation_doubled(runs, lm_data, tmp_path, stage):
    reference = runs(2, deepspeed__zero_stage=stage)
    resumed = rewound(reference, tmp_path)
    result = launch(overrides(lm_data, resumed, deepspeed__zero_stage=stage, train__grad_accum_steps=2))
    out = result.stdout
    assert "elastic resume: written by 2 rank(s)" in out and "universal checkpoint" in out
    assert "MPU is not provided" not in out + result.stderr  # DeepSpeed's warning on each rank's universal load
    assert "global batch" not in out
    assert_continues(resumed, reference)
    assert not (resumed / "checkpoints" / checkpoint.tag_for(2) / "universal").exists()  # the converted copy


def test_one_rank_resumes_on_two(runs, lm_data, tmp_path):
    reference = runs(1, train__grad_accum_steps=2)
    resumed = rewound(reference, tmp_path)
    out = launch(overrides(lm_data, resumed), ranks=2).stdout
    assert "elastic resume: written by 1 rank(s)" in out
    assert_continues(resumed, reference)


def test_four_ranks_resume_on_two_with_accumulation_doubled(runs, lm_data, tmp_path):
    """Each of the 4 replicas read its own quarter of the lanes; the 2 that resume read their halves of the same
    rows."""
    reference = runs(4)
    resumed = rewound(reference, tmp_path)
    out = launch(overrides(lm_data, resumed, train__grad_accum_steps=2), ranks=2).stdout
    assert "elastic resume: written by 4 rank(s)" in out and "global batch" not in out
    assert_continues(resumed, reference)


def test_a_sequence_parallel_run_resumes_without_it(runs, lm_data, tmp_path):
    reference = runs(2, parallel__sequence_parallel=2, deepspeed__zero_stage=2)
    resumed = rewound(reference, tmp_path)
    out = launch(overrides(lm_data, resumed, deepspeed__zero_stage=2)).stdout
    assert "(sequence_parallel 2), now 1 (sequence_parallel 1)" in out
    assert_continues(resumed, reference)


def test_a_changed_global_batch_is_said_moved_shards_resume_and_other_keys_are_refused(runs, lm_data, tmp_path):
    reference = runs(1, train__grad_accum_steps=2)
    resumed = rewound(reference, tmp_path)
    for change, key in [({"model__dim": 32}, "model.dim"), ({"train__max_steps": 1}, "train.max_steps")]:
        result = launch(overrides(lm_data, resumed, **change), check=False)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert result.stderr.strip().splitlines()[-1].startswith(f"config error: {key}: ")
    moved = tmp_path / "moved"  # the shards moved elsewhere (same manifest): the stream resumes from them
    shutil.copytree(lm_data["train_shards"].rsplit("/", 1)[0], moved)
    out = launch(overrides(lm_data, resumed, data__train_shards=f"{moved}/shard-{{000000..000099}}.tar")).stdout
    # the global batch halves (one rank, no accumulation): the run says so and goes on
    assert "the global batch changes from 8 to 4 rows a step" in out
    got, want = read_metrics(resumed), read_metrics(reference)
    assert got[STEPS]["train/tokens_seen"] == want[2]["train/tokens_seen"] + 2 * 4 * 64  # 2 steps of 4 rows
