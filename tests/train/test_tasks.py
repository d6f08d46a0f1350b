"""Every task keeps the ``Task`` contract the loop relies on, on real shards (text and images), one CPU rank."""
import inspect
import random

import pytest
import torch
from PIL import Image

from pretrain.data.images import make_image_shards
from pretrain.distributed.process_group import World
from pretrain.tasks import Task, build_task
from pretrain.tasks.config_checks import load_run_config

CPU = torch.device("cpu")
ONE_RANK = World(rank=0, world_size=1, local_rank=0, device=CPU)


@pytest.fixture(scope="module")
def image_shards(tmp_path_factory) -> dict[str, str]:
    """Two classes of noisy solid colours, train and val shards."""
    root, rng = tmp_path_factory.mktemp("images"), random.Random(0)
    for split in ("train", "val"):
        for name, rgb in {"red": (220, 30, 30), "blue": (30, 40, 220)}.items():
            (root / "folder" / split / name).mkdir(parents=True)
            for i in range(6):
                noise = Image.effect_noise((rng.randint(32, 40), 32), 30).convert("L")
                Image.merge("RGB", [noise.point(lambda p, c=c: max(0, min(255, c + p - 128))) for c in rgb]).save(
                    root / "folder" / split / name / f"{i}.png")
        make_image_shards(str(root / "folder"), str(root / split), split=split, images_per_shard=4)
    return {"train": str(root / "train"), "val": str(root / "val")}


def lm_overrides(lm_data):
    return [f"data.tokenizer={lm_data['tokenizer']}", f"data.train_shards={lm_data['train_shards']}",
            f"data.val_shards={lm_data['val_shards']}", "data.num_workers=0", "model.dim=32", "model.n_layers=1",
            "model.n_heads=2", "train.seq_len=32", "train.micro_batch_size=2", "log.val_batches=2"]


def vision_overrides(image_shards):
    return ["task=vision", f"data.train_shards={image_shards['train']}", f"data.val_shards={image_shards['val']}",
            "data.num_workers=0", "vision.image_size=32", "vision.stage_dims=[8,8,8,8]",
            "vision.stage_depths=[1,1,1,1]", "vision.stage_heads=[1,1,1,1]",
            "vision.stage_mixers=[linear,linear,linear,softmax]", "train.micro_batch_size=2", "log.val_batches=2",
            "augment.mixup_alpha=0.2"]


RECALL_OVERRIDES = ["task=recall", "recall.vocab_size=64", "recall.num_pairs=4", "model.dim=32", "model.n_layers=1",
                    "model.n_heads=2", "train.seq_len=32", "train.micro_batch_size=2", "log.val_batches=2"]


@pytest.fixture(params=["lm", "vision", "recall"])
def task_cfg(request, lm_data, image_shards):
    if request.param == "recall":  # generated rows: no data to point at
        return load_run_config(None, RECALL_OVERRIDES)
    overrides = lm_overrides(lm_data) if request.param == "lm" else vision_overrides(image_shards)
    return load_run_config(None, overrides)


def protocol_methods() -> dict[str, inspect.Signature]:
    return {name: inspect.signature(member) for name, member in vars(Task).items()
            if inspect.isfunction(member) and not name.startswith("_")}


def test_the_protocol_names_every_part_the_loop_uses():
    assert set(protocol_methods()) == {"build_model", "train_flops_per_unit", "batches", "loss", "validate",
                                       "train_metrics", "state_dict", "load_state_dict"}


def test_every_task_keeps_the_contract(task_cfg):
    task = build_task(task_cfg, ONE_RANK)
    assert isinstance(task, Task)
    for name, signature in protocol_methods().items():
        assert list(inspect.signature(getattr(type(task), name)).parameters) == list(signature.parameters), name
    assert task.unit in ("tokens", "images") and task.units_per_micro_batch > 0
    assert task.epoch == 0 and task.has_validation

    torch.manual_seed(0)
    model = task.build_model()
    assert task.train_flops_per_unit(model) > 0
    batches = task.batches()
    loss, count = task.loss(model, next(batches), CPU)
    assert loss.dim() == 0 and loss.dtype == torch.float32 and torch.isfinite(loss) and count > 0
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert all(key.startswith("train/") for key in task.train_metrics())

    model.eval()
    figures = task.validate(model, CPU)
    assert figures and all(key.startswith("val/") for key in figures) and figures["val/loss"] > 0

    state = task.state_dict()
    expected = next(batches)
    resumed = build_task(task_cfg, ONE_RANK)
    resumed.load_state_dict(state)
    again = next(resumed.batches())
    assert again.keys() == expected.keys()
    assert all(torch.equal(again[key], expected[key]) for key in expected)
