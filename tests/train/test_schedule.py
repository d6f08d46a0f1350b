"""LR schedules against their definitions: warmup, cosine, warmup-stable-decay, constant."""
import math

import pytest

from pretrain.train.schedule import lr_at

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


def test_unknown_schedule_names_the_key():
    with pytest.raises(ValueError, match="schedule.name"):
        lr_at(50, name="linear", **BASE)
