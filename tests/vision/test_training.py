"""Vision runs under launch/pretrain.py: 2 gloo ranks with ZeRO 2 on generated colour images, exact resume,
tools/eval_cls.py at the training resolution and at another, and bad vision keys named.

The classes are colours (with noise), so a tiny backbone learns them in a dozen steps and at any resolution.
"""
import json
import math
import os
import random
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pretrain.data.images import make_image_shards
from pretrain.tasks.vision import mix_batch, smoothed_targets, soft_cross_entropy_sum

from train.launching import PYTHON, REPO, launch, read_metrics

pytestmark = pytest.mark.dist
CONFIG = "configs/vision/cifar10_base.yaml"
STEPS = 12
ONE_THREAD = dict(os.environ, OMP_NUM_THREADS="1")  # as launch() runs ranks: no thread oversubscription
COLOURS = {"blue": (30, 40, 220), "green": (30, 200, 40), "red": (220, 30, 30), "yellow": (230, 220, 30)}


@pytest.fixture(scope="module")
def image_data(tmp_path_factory) -> dict[str, str]:
    """A generated ImageFolder (train/val, one noisy solid colour per class, odd sizes) → image shards."""
    root, rng = tmp_path_factory.mktemp("images"), random.Random(0)
    for split, per_class in (("train", 32), ("val", 8)):
        for name, rgb in COLOURS.items():
            (root / "folder" / split / name).mkdir(parents=True)
            for i in range(per_class):
                pixels = Image.effect_noise((rng.randint(32, 48), rng.randint(32, 48)), 40).convert("L")
                image = Image.merge("RGB", [pixels.point(lambda p, c=c: max(0, min(255, c + p - 128))) for c in rgb])
                image.save(root / "folder" / split / name / f"{i}.png")
        make_image_shards(str(root / "folder"), str(root / split), split=split, images_per_shard=16)
    return {"train": str(root / "train"), "val": str(root / "val")}


def overrides(image_data, run_dir, **extra) -> list[str]:
    """A tiny four-stage backbone (one block per stage, a different mixer in each) at 32 px on the colour set."""
    values = {
        "run.dir": str(run_dir), "data.train_shards": image_data["train"], "data.val_shards": image_data["val"],
        "data.num_workers": 0, "vision.num_classes": 0, "vision.image_size": 32, "vision.patch_size": 4,
        "vision.stage_dims": "[8,16,16,16]", "vision.stage_depths": "[1,1,1,1]", "vision.stage_heads": "[1,2,2,2]",
        "vision.stage_mixers": "[linear,soft,inline,softmax]", "vision.drop_path": 0.1,
        "augment.mixup_alpha": 0.4, "augment.cutmix_alpha": 1.0, "train.micro_batch_size": 8,
        "train.max_steps": STEPS, "optim.lr": 3e-3, "schedule.name": "constant", "schedule.warmup_steps": 2,
        "deepspeed.zero_stage": 2, "log.every": 1, "log.val_every": STEPS, "log.val_batches": 100,
        "checkpoint.every": STEPS, "checkpoint.keep_last": 2,
    }
    values.update({key.replace("__", "."): value for key, value in extra.items()})
    return [f"{key}={value}" for key, value in values.items()]


@pytest.fixture(scope="module")
def trained(image_data, tmp_path_factory):
    """The run directory of an uninterrupted 2-rank ZeRO-2 run (mixup, cutmix, drop path and smoothing on)."""
    run = tmp_path_factory.mktemp("runs") / "colours"
    launch(overrides(image_data, run), ranks=2, config=CONFIG)
    return run


def eval_cls(run, data, *extra) -> dict:
    result = subprocess.run([PYTHON, "tools/eval_cls.py", "--run", str(run), "--data", data, "--batch-size", "5",
                             "--json", *extra], cwd=REPO, env=ONE_THREAD, capture_output=True, text=True)
    assert result.returncode == 0, f"eval_cls failed ({result.returncode}):\n{result.stderr[-6000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_loss_falls_and_vision_metrics_are_logged(trained):
    metrics = read_metrics(trained)
    curve = [metrics[step]["train/loss"] for step in range(1, STEPS + 1)]
    assert sum(curve[-4:]) / 4 < sum(curve[:4]) / 4 - 0.1, curve  # mixed, smoothed targets: a higher floor
    assert metrics[STEPS]["val/loss"] < math.log(len(COLOURS)) - 0.3  # well below guessing among the colours
    for key in ("train/images_per_s", "train/flops_per_s_per_rank", "train/grad_norm", "train/lr"):
        assert all(math.isfinite(metrics[step][key]) and metrics[step][key] > 0 for step in range(1, STEPS + 1)), key
    assert metrics[STEPS]["train/images_seen"] == STEPS * 2 * 8  # steps × ranks × micro-batch
    assert metrics[STEPS]["val/images"] == 32  # every validation image once over the two ranks
    assert metrics[STEPS]["val/top1"] >= 75 and metrics[STEPS]["val/top5"] == 100  # chance: 25 %
    events = EventAccumulator(str(trained / "tensorboard")).Reload()
    assert {"train/loss", "train/images_per_s", "val/loss", "val/top1", "val/top5"} <= set(events.Tags()["scalars"])
    assert "num_classes: 4" in (trained / "config.yaml").read_text()  # resolved from the shards' manifest


def test_a_stopped_run_resumes_exactly(trained, image_data, tmp_path):
    """Stopped at step 5 (a run of max_steps=5, constant LR), relaunched to 12: the same losses, gradient norms and
    validation as the uninterrupted run, so weights, optimizer, data order, augmentation and mixing all resumed."""
    run = tmp_path / "resumed"
    launch(overrides(image_data, run, train__max_steps=5, checkpoint__every=5), ranks=2, config=CONFIG)
    launch(overrides(image_data, run), ranks=2, config=CONFIG)
    resumed, reference = read_metrics(run), read_metrics(trained)
    for key in ("train/loss", "train/grad_norm"):
        assert [resumed[s][key] for s in range(1, STEPS + 1)] == [reference[s][key] for s in range(1, STEPS + 1)]
    assert resumed[STEPS]["val/top1"] == reference[STEPS]["val/top1"]
    assert resumed[STEPS]["val/loss"] == reference[STEPS]["val/loss"]
    # the images are split among ranks by shard: another number of ranks is refused in one line (docs: Resuming)
    refused = launch(overrides(image_data, run, train__max_steps=STEPS + 1), config=CONFIG, check=False)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert refused.stderr.strip().splitlines()[-1].startswith(f"error: cannot resume {run / 'checkpoints'}")
    assert "'world_size' is 2, but this loader has 1" in refused.stderr


def test_eval_cls_agrees_with_the_logged_validation_and_runs_at_another_resolution(trained, image_data):
    logged = read_metrics(trained)[STEPS]
    same = eval_cls(trained, image_data["val"])
    assert same["resolution"] == 32 and same["images"] == logged["val/images"]
    assert same["top1"] == pytest.approx(logged["val/top1"]) and same["top5"] == pytest.approx(logged["val/top5"])
    assert same["loss"] == pytest.approx(logged["val/loss"], rel=1e-5)
    larger = eval_cls(trained, image_data["val"], "--resolution", "64")  # weights trained at 32 px
    assert larger["resolution"] == 64 and larger["images"] == 32
    assert larger["top1"] >= 75  # colours do not depend on the resolution: far above chance (25 %)


def test_an_exported_backbone_scores_as_its_run(trained, image_data, tmp_path):
    """tools/export.py on a vision run (no tokenizer to copy); eval_cls takes the directory as --run."""
    out = tmp_path / "export"
    done = subprocess.run([PYTHON, "tools/export.py", "--run", str(trained), "--out", str(out)], cwd=REPO,
                          env=ONE_THREAD, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(path.name for path in out.iterdir()) == ["config.json", "model.safetensors"]
    scores, logged = eval_cls(out, image_data["val"]), read_metrics(trained)[STEPS]
    assert scores["checkpoint"] == str(out) and scores["images"] == logged["val/images"]
    assert scores["top1"] == pytest.approx(logged["val/top1"]) and scores["loss"] == pytest.approx(logged["val/loss"],
                                                                                                   rel=1e-5)


def test_eval_cls_refuses_a_resolution_off_the_grid(trained, image_data):
    result = subprocess.run([PYTHON, "tools/eval_cls.py", "--run", str(trained), "--data", image_data["val"],
                             "--resolution", "40"], cwd=REPO, env=ONE_THREAD, capture_output=True, text=True)
    assert result.returncode == 1 and "--resolution 40" in result.stderr and "Traceback" not in result.stderr


def test_a_bad_vision_key_is_named_and_nothing_is_written(image_data, tmp_path):
    result = launch(overrides(image_data, tmp_path / "bad", vision__stage_heads="[1,3,2,2]"), check=False,
                    config=CONFIG)
    assert result.returncode == 2 and "vision.stage_heads[1]" in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "bad").exists()


def test_dry_run_reports_parameters_and_flops_per_image():
    """The dry run's numbers of a vision preset: no data, the backbone on the meta device; ZeRO shards its states."""
    from pretrain.config import load_config
    from pretrain.estimate import estimate

    cfg = load_config(REPO / "configs/vision/cifar10_soft.yaml", ["deepspeed.zero_stage=2"])
    one, four = estimate(cfg, 1), estimate(cfg, 4)
    assert one["parameters"] == four["parameters"] > 0 and one["image_size"] == 32
    assert one["flops_per_image"] == 3 * one["forward_flops_per_image"] > 2 * one["parameters"]
    assert four["model_state_bytes_per_rank"] < one["model_state_bytes_per_rank"]


@pytest.mark.parametrize("mixup_alpha,cutmix_alpha", [(0.4, 0.0), (0.0, 1.0), (0.4, 1.0)])
def test_mixed_targets_weigh_each_source_image_by_its_share_of_the_pixels(mixup_alpha, cutmix_alpha):
    """Image b is filled with the value b and labelled b: after mixup or cutmix, the mean pixel of each mixed image
    must equal the target-weighted mean of the labels (blend weight, or the pasted box's actual area)."""
    batch, rng = 7, np.random.default_rng(0)
    images = torch.arange(batch, dtype=torch.float64)[:, None, None, None].expand(batch, 3, 12, 20)
    for _ in range(5):
        mixed, targets = mix_batch(images, F.one_hot(torch.arange(batch), batch).double(), mixup_alpha=mixup_alpha,
                                   cutmix_alpha=cutmix_alpha, rng=rng)
        torch.testing.assert_close(targets.sum(-1), torch.ones(batch, dtype=torch.float64))
        torch.testing.assert_close(mixed.mean((1, 2, 3)), targets @ torch.arange(batch, dtype=torch.float64))
    assert not torch.equal(mixed, images)
    unmixed = mix_batch(images, targets, mixup_alpha=0.0, cutmix_alpha=0.0, rng=rng)
    assert unmixed[0] is images and unmixed[1] is targets


def test_smoothed_soft_cross_entropy_is_torchs_label_smoothing():
    logits, labels = torch.randn(6, 5, dtype=torch.float64), torch.tensor([0, 4, 2, 2, 1, 3])
    for smoothing in (0.0, 0.1, 0.5):
        targets = smoothed_targets(labels, 5, smoothing)
        assert targets[0, 0] == pytest.approx(1 - smoothing + smoothing / 5)
        expected = F.cross_entropy(logits.float(), labels, label_smoothing=smoothing, reduction="sum")
        torch.testing.assert_close(soft_cross_entropy_sum(logits, targets), expected)
