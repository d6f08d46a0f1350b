"""Our config → a DeepSpeed engine: ZeRO stage, precision, offload, clipping, optimizer and LR schedule."""
from collections.abc import Callable

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from pretrain.config import ConfigError
from pretrain.scopes import OPTIMIZER, scope


def deepspeed_config(cfg: DictConfig, world_size: int) -> dict:
    """The DeepSpeed JSON config for ``cfg`` (already validated) on ``world_size`` ranks; ``deepspeed.extra`` is
    merged in last, so it can set any DeepSpeed key we do not model."""
    ds, train = cfg.deepspeed, cfg.train
    zero: dict = {"stage": int(ds.zero_stage)}
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if ds.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config = {
        "train_micro_batch_size_per_gpu": int(train.micro_batch_size),
        "gradient_accumulation_steps": int(train.grad_accum_steps),
        "train_batch_size": int(train.micro_batch_size * train.grad_accum_steps * world_size),
        "gradient_clipping": float(train.grad_clip),
        "zero_optimization": zero,
        "bf16": {"enabled": ds.precision == "bf16"},
        "fp16": {"enabled": ds.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,  # our own metrics report progress
        "wall_clock_breakdown": False,
    }
    return OmegaConf.to_container(OmegaConf.merge(config, ds.extra), resolve=True)  # deep: nested keys merge


def build_optimizer(cfg: DictConfig, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on norms and biases); DeepSpeed's CPU Adam when offloading."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": float(cfg.optim.weight_decay)},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    kwargs = dict(lr=float(cfg.optim.lr), betas=tuple(cfg.optim.betas), eps=float(cfg.optim.eps))
    if cfg.deepspeed.offload_optimizer:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    return torch.optim.AdamW(groups, fused=torch.cuda.is_available(), **kwargs)


def build_engine(cfg: DictConfig, model: nn.Module, world_size: int, lr_at_step: Callable[[int], float], *,
                 load_universal: bool = False):
    """Wrap ``model`` in a DeepSpeed engine whose scheduler sets the LR of optimizer step k to ``lr_at_step(k)``;
    ``load_universal``: its ``load_checkpoint`` reads a universal checkpoint (a resume on another number of ranks)."""
    import deepspeed

    if cfg.deepspeed.precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("deepspeed.precision", "fp16 needs a CUDA device (DeepSpeed has no fp16 on CPU); "
                                                 "use bf16 or fp32")
    base_lr = float(cfg.optim.lr)

    def scheduler(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at_step(step) / base_lr)

    config = deepspeed_config(cfg, world_size)
    if load_universal:
        config.setdefault("checkpoint", {})["load_universal"] = True
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=build_optimizer(cfg, model),
        lr_scheduler=scheduler,
        config=config,
    )
    return engine


def reapply_lr_schedule(engine) -> None:
    """Set the optimizer's LR from this run's schedule at the restored step, after loading a checkpoint.

    The checkpoint brings back the LR the earlier run computed, and its scheduler only recomputes after the next
    step; a relaunch that changed the schedule (``train.max_steps``) would take one step at the old run's LR.
    Stepping the restored scheduler back and forward once recomputes it with this run's schedule function.
    """
    scheduler = engine.lr_scheduler
    scheduler.last_epoch -= 1
    scheduler.step()


def step_with_grad_norm(engine) -> float | None:
    """``engine.step()``; at an accumulation boundary also the global gradient norm (before clipping).

    DeepSpeed's ZeRO and mixed-precision optimizers record the norm; plain fp32 without ZeRO does not, so it is
    taken here from the already all-reduced gradients.
    """
    boundary = engine.is_gradient_accumulation_boundary()
    own_norm = None
    with scope(OPTIMIZER):
        if boundary and not hasattr(engine.optimizer, "_global_grad_norm"):
            grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
            own_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
        engine.step()
    if not boundary:
        return None
    return own_norm if own_norm is not None else float(engine.get_global_grad_norm())
