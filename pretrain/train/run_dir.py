"""The run directory: the resolved config is saved once, and a relaunch must describe the same run."""
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pretrain.config import ConfigError, save_config

# Keys a relaunch may change (docs/CONTRACTS.md#resuming: the table, and what each one does on resume).
MAY_CHANGE = ("run.dir", "train.max_steps", "data.num_workers", "data.verify_shards", "log.", "checkpoint.",
              "train.micro_batch_size", "train.grad_accum_steps", "parallel.sequence_parallel",  # elastic resume
              "data.skip_corrupt", "train.max_nonfinite_steps", "deepspeed.activation_checkpointing",
              "data.train_shards", "data.val_shards",  # moved shards: the loader checks their manifests' sha256
              "parallel.collective_timeout_s")


def _flat(cfg: DictConfig) -> dict[str, object]:
    flat = {}

    def walk(node, prefix):
        if isinstance(node, dict):  # an empty mapping has no leaves: its keys appear in the other config
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = node

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return flat


def changed_keys(saved: DictConfig, new: DictConfig) -> list[str]:
    """Dotted keys whose value differs between two configs, except those in MAY_CHANGE."""
    old, now = _flat(saved), _flat(new)
    return sorted(key for key in set(old) | set(now)
                  if old.get(key) != now.get(key) and not key.startswith(MAY_CHANGE) and key not in MAY_CHANGE)


def check_relaunch(cfg: DictConfig) -> None:
    """A run with a checkpoint is resumed by a relaunch, so there a config that changes the run is refused
    (``ConfigError`` naming the first key); a run that never saved one takes the new config. Reads only."""
    run_dir = Path(cfg.run.dir)
    saved_path = run_dir / "config.yaml"
    if saved_path.exists() and (run_dir / "checkpoints" / "latest").exists():
        changed = changed_keys(OmegaConf.load(saved_path), cfg)
        if changed:
            raise ConfigError(changed[0], f"differs from the run's saved {saved_path} (changed: {', '.join(changed)});"
                                          " use a new run.dir, or restore the saved values")


def prepare_run_dir(cfg: DictConfig, is_main: bool) -> Path:
    """Create the run directory and save ``config.yaml``, after ``check_relaunch``."""
    run_dir = Path(cfg.run.dir)
    saved_path = run_dir / "config.yaml"
    check_relaunch(cfg)
    if is_main:
        save_config(cfg, saved_path)
    return run_dir
