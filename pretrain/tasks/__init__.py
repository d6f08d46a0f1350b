"""What a run learns. The training loop is the same for every task; a ``Task`` supplies the task-specific parts.

A task, built on one rank as ``Task(cfg, world)`` (opening its data; a bad path is a ``ConfigError`` naming the key):
  unit                     what throughput counts: "tokens" or "images"
  units_per_micro_batch    of one rank's micro-batch
  epoch                    finished passes over the training data (this rank's)
  has_validation           whether ``validate`` has data to score
  build_model()            the model, on the current default device
  train_flops_per_unit(m)  training FLOPs (≈ 3× forward) per unit of the model ``m``
  batches()                this rank's training batches, forever
  loss(model, batch, dev)  (summed loss as a 0-d fp32 tensor, how many units it sums over)
  validate(model, dev)     {"val/...": scalar} over the validation data, reduced over ranks
  state_dict() / load_state_dict(state)   the data stream's state, for exact resume
"""
from omegaconf import DictConfig
from torch import nn


def build_task(cfg: DictConfig, world):
    """The task ``cfg.task`` names, set up for this rank of ``world``."""
    if cfg.task == "vision":
        from .vision import VisionTask

        return VisionTask(cfg, world)
    if cfg.task == "recall":
        from .recall import RecallTask

        return RecallTask(cfg, world)
    from .lm import LMTask

    return LMTask(cfg, world)


def build_model(cfg: DictConfig) -> nn.Module:
    """The model of the run ``cfg`` describes, without opening any data (checkpoint loading, dry runs)."""
    if cfg.task == "vision":
        from pretrain.models.vision import build_vision_model

        return build_vision_model(cfg)
    from pretrain.models import build_lm

    return build_lm(cfg.model)
