"""LR schedules against their definitions: warmup, cosine, warmup-stable-decay, constant."""
import math

import pytest

from pretrain.train.schedule import Plan, lr_at

BASE = dict(lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=20, max_steps=100)


@pytest.mark.parametrize("name", ["cosine", "wsd", "constant"])
def test_warmup_is_linear_up_to_the_peak(name):
    lrs = [lr_at(k, name=name, **BASE) for k in range(10)]
    assert lrs == pytest.approx([(k + 1) / 10 for k in range(10)])
    assert lr_at(10, name=name, **BASE) == pytest.approx(1.0)


def test_cosine_follows_half_a_cosine_to_min_lr():
    for k in (10, 37, 55, 99, 100):
        progress = (k - 10) / 90
        assert lr_at(k, name="cosine", **BASE) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
    assert lr_at(150, name="cosine", **BASE) == pytest.approx(0.1)  # held after max_steps


def test_wsd_holds_then_decays_linearly_over_decay_steps():
    assert all(lr_at(k, name="wsd", **BASE) == 1.0 for k in range(10, 80))
    decay = [lr_at(k, name="wsd", **BASE) for k in range(80, 100)]
    assert decay == pytest.approx([1.0 - 0.9 * (k + 1) / 20 for k in range(20)])
    assert decay[-1] == pytest.approx(0.1)


def test_constant_stays_at_lr():
    assert {lr_at(k, name="constant", **BASE) for k in range(10, 200)} == {1.0}


def test_a_warmup_longer_than_the_run_is_shortened_to_a_tenth_of_the_run_and_said():
    """A first ten-step try of a config with a 30-step warmup: it warms up over 1 step, then decays as usual."""
    short = dict(BASE, warmup_steps=30, max_steps=10)
    assert [lr_at(k, name="cosine", **short) for k in range(10)] == pytest.approx(
        [lr_at(k, name="cosine", **dict(short, warmup_steps=1)) for k in range(10)])
    assert lr_at(0, name="cosine", **short) == 1.0 and lr_at(10, name="cosine", **short) == pytest.approx(0.1)
    assert Plan(name="cosine", **short).warmup_notice() == (
        "schedule.warmup_steps 30 is longer than train.max_steps 10: warming up over 1 step instead (a tenth of the "
        "run)")
    assert lr_at(0, name="cosine", **dict(short, max_steps=100)) == pytest.approx(1 / 30)  # 100 steps: as configured
    assert Plan(name="cosine", **dict(short, warmup_steps=10)).warmup_notice() is None  # the whole run: as asked


def test_unknown_schedule_names_the_key():
    with pytest.raises(ValueError, match="schedule.name"):
        lr_at(50, name="linear", **BASE)


def test_a_changed_max_steps_replans_the_decay_from_the_resumed_step():
    """Resumed at step 60 of 100 with max_steps 200: the LR goes on from where it was (no jump) down a half cosine
    to min_lr at 200; a later resume with 200 follows that plan, one with 300 re-plans again from its step."""
    old = Plan(name="cosine", **BASE)
    saved = old.state()
    plan = Plan(name="cosine", **{**BASE, "max_steps": 200})
    said = plan.resume(saved, 60)
    assert said.startswith("train.max_steps changed from 100 to 200: the decay re-planned from step 60's LR")
    assert plan(60) == pytest.approx(old(60), rel=1e-12)  # no jump (steps before 60 are history)
    for k in (60, 130, 199):
        progress = (k - 60) / 140
        assert plan(k) == pytest.approx(0.1 + 0.5 * (old(60) - 0.1) * (1 + math.cos(math.pi * progress)))
    again = Plan(name="cosine", **{**BASE, "max_steps": 200})
    assert again.resume(plan.state(), 130) is None and again(150) == plan(150)
    further = Plan(name="cosine", **{**BASE, "max_steps": 300})
    assert further.resume(plan.state(), 130) and further(130) == pytest.approx(plan(130), rel=1e-12)


@pytest.mark.parametrize("name,step", [("wsd", 50), ("constant", 60), ("cosine", 5)])
def test_max_steps_changed_where_the_lr_is_the_same_either_way_keeps_the_schedule(name, step):
    plan = Plan(name=name, **{**BASE, "max_steps": 200})  # wsd before its decay, constant, or in warmup
    assert "unchanged" in plan.resume(Plan(name=name, **BASE).state(), step)
    assert plan.start is None and plan(150) == lr_at(150, name=name, **{**BASE, "max_steps": 200})
