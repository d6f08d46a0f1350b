"""What a run learns. The training loop is the same for every task; a ``Task`` supplies the task-specific parts.

A task is built on one rank as ``SomeTask(cfg, world)``, opening its data (a bad path is a ``ConfigError`` naming
the key). ``Task`` below is the contract, checked for every task by ``tests/train/test_tasks.py``.
"""
import functools
from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from pretrain.data.shards import verify_shards
from pretrain.models import build_lm, build_vision_model


@runtime_checkable
class Task(Protocol):
    unit: str                   # what throughput counts: "tokens" or "images"
    units_per_micro_batch: int  # of one rank's micro-batch

    @property
    def epoch(self) -> int:
        """Finished passes over this rank's training data."""

    @property
    def has_validation(self) -> bool:
        """Whether ``validate`` has data to score."""

    def build_model(self) -> nn.Module:
        """The model, on the current default device."""

    def train_flops_per_unit(self, model: nn.Module) -> float:
        """Training FLOPs (≈ 3× forward) per unit of ``model``."""

    def batches(self) -> Iterator[dict]:
        """This rank's training batches, forever."""

    def loss(self, model: nn.Module, batch: dict, device: torch.device) -> tuple[torch.Tensor, float]:
        """(summed loss as a 0-d fp32 tensor, how many units it sums over)."""

    def train_metrics(self) -> dict[str, float]:
        """``{"train/...": scalar}`` of the training data so far (a mixture's counts per source), reduced over
        ranks; every rank calls it on logging steps."""

    def validate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """``{"val/...": scalar}`` over the validation data, reduced over ranks."""

    def state_dict(self) -> dict:
        """The data stream's state, for exact resume."""

    def load_state_dict(self, state: dict) -> None:
        """Resume the data stream from ``state_dict()``."""


def build_task(cfg: DictConfig, world) -> Task:
    """The task ``cfg.task`` names, set up for this rank of ``world``."""
    if cfg.task == "vision":
        from .vision import VisionTask

        return VisionTask(cfg, world)
    if cfg.task == "recall":
        from .recall import RecallTask

        return RecallTask(cfg, world)
    from .lm import LMTask

    return LMTask(cfg, world)


def verify_training_shards(urls: Sequence[str], world) -> None:
    """``data.verify_shards``: before step 1, each rank hashes its share of the shards against their manifests, so
    a corrupt one is a ``ShardError`` naming it now rather than at step 1500; rank 0 reports its progress."""
    say = functools.partial(print, flush=True) if world.rank == 0 else None
    if say:
        say(f"verifying the sha256 of {len(urls)} training shards against their manifests (data.verify_shards, "
            f"{world.world_size} ranks sharing the work)")
    summary = verify_shards(list(urls[world.rank::world.world_size]),
                            report=say and (lambda line: say(f"rank 0: {line}")))
    if say:
        say(f"rank 0: {summary}")


class TokenRowsTask:
    """What the causal-LM tasks (``lm``, ``recall``) share: the model of ``cfg.model``, trained on ``self.loader``'s
    rows of ``train.seq_len`` tokens, resumed exactly from that loader's state."""
    unit = "tokens"

    @property
    def epoch(self) -> int:
        return self.loader.epoch

    def build_model(self) -> nn.Module:
        return build_model(self.cfg)

    def train_flops_per_unit(self, model: nn.Module) -> float:
        return 3 * model.flops_per_token(self.cfg.train.seq_len)

    def batches(self) -> Iterator[dict]:
        return iter(self.loader)

    def train_metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)


def build_model(cfg: DictConfig) -> nn.Module:
    """The model of the run ``cfg`` describes, without opening any data (checkpoint loading, dry runs)."""
    if cfg.task == "vision":
        return build_vision_model(OmegaConf.to_object(cfg.vision), OmegaConf.to_object(cfg.model))
    return build_lm(OmegaConf.to_object(cfg.model))
