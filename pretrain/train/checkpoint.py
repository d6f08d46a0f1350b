"""DeepSpeed checkpoints whose ``latest`` pointer moves only after every rank has written everything.

Layout: ``CKPT_DIR/step00000500/`` holds DeepSpeed's files (model, optimizer, LR scheduler) and one
``client_state_rankNNNNN.pt`` per rank (step, counters, that rank's data-stream and RNG states);
``CKPT_DIR/latest`` names the newest complete tag. A save interrupted at any point leaves ``latest`` on the
previous complete tag, so the run still resumes.
"""
import contextlib
import os
import re
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed.engine import reapply_lr_schedule

TAG = re.compile(r"step(\d{8})")


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def _client_state_path(ckpt_dir: Path, tag: str, rank: int) -> Path:
    return ckpt_dir / tag / f"client_state_rank{rank:05d}.pt"


def latest_tag(ckpt_dir: Path) -> str | None:
    pointer = Path(ckpt_dir) / "latest"
    return pointer.read_text().strip() if pointer.exists() else None


def save(engine, ckpt_dir: Path, step: int, client_state: dict, *, keep_last: int) -> str:
    """Save on all ranks (a collective call); then move ``latest`` and keep only the newest ``keep_last`` tags."""
    ckpt_dir, tag, rank = Path(ckpt_dir), tag_for(step), dist.get_rank()
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"step": step}, save_latest=False)
    path = _client_state_path(ckpt_dir, tag, rank)
    torch.save(client_state, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)
    dist.barrier()  # every rank's files of this tag are on disk
    if rank == 0:
        pointer = ckpt_dir / "latest"
        pointer.with_suffix(".tmp").write_text(tag)
        os.replace(pointer.with_suffix(".tmp"), pointer)
        _prune(ckpt_dir, keep_last, keep=tag)
    dist.barrier()
    return tag


def _prune(ckpt_dir: Path, keep_last: int, keep: str) -> None:
    """Remove all but the newest ``keep_last`` (>= 1) tags, never the one ``latest`` names."""
    tags = sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir() and TAG.fullmatch(p.name))
    for tag in tags[:-keep_last]:
        if tag != keep:
            shutil.rmtree(ckpt_dir / tag, ignore_errors=True)


def load(engine, ckpt_dir: Path, *, tag: str | None = None) -> dict | None:
    """Restore model, optimizer and LR scheduler from ``tag`` (default: ``latest``); return this rank's client state,
    or None when there is nothing to resume."""
    ckpt_dir, rank, world_size = Path(ckpt_dir), dist.get_rank(), dist.get_world_size()
    tag = tag or latest_tag(ckpt_dir)
    if tag is None:
        return None
    path = _client_state_path(ckpt_dir, tag, rank)
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: checkpoint {ckpt_dir / tag} was not written by a world of "
                                f"{world_size} ranks; resume with the world size that wrote it")
    client_state = torch.load(path, weights_only=False)
    if client_state["world_size"] != world_size:
        raise ValueError(f"checkpoint {ckpt_dir / tag} was written by {client_state['world_size']} ranks, "
                         f"this run has {world_size}; resume with the same world size")
    loaded, _ = engine.load_checkpoint(str(ckpt_dir), tag=tag)
    if loaded is None:
        raise FileNotFoundError(f"DeepSpeed could not load checkpoint {ckpt_dir / tag}")
    reapply_lr_schedule(engine)  # a relaunch may have changed train.max_steps, so the schedule
    return client_state


def load_model_weights(ckpt_dir: Path, tag: str, *, zero_stage: int) -> dict[str, torch.Tensor]:
    """The full model state dict of a checkpoint, on CPU, in one process, whatever ZeRO stage wrote it.

    Without ZeRO the model states file holds the whole module; under ZeRO the fp32 master weights are partitioned
    over the ranks' optimizer files, and DeepSpeed's ``zero_to_fp32`` reassembles them.
    """
    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / tag).is_dir():
        raise FileNotFoundError(f"checkpoint {ckpt_dir / tag} does not exist")
    if zero_stage == 0:
        states = torch.load(ckpt_dir / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        return {name: tensor.float() for name, tensor in states["module"].items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)


def load_trained_model(run: Path, tag: str = "latest"):
    """``(model, cfg, checkpoint_dir)`` of a run directory: its ``config.yaml`` and the weights of ``tag``.

    The model comes back in fp32 on CPU, in eval mode; ``tag="latest"`` follows the run's ``latest`` pointer.
    DeepSpeed's ``zero_to_fp32`` reports on stdout; that goes to stderr so a tool's stdout stays its results.
    """
    from ..config import load_config
    from ..tasks import build_model

    run = Path(run)
    cfg = load_config(run / "config.yaml")
    ckpt_dir = run / "checkpoints"
    resolved = latest_tag(ckpt_dir) if tag == "latest" else tag
    if resolved is None:
        raise FileNotFoundError(f"{ckpt_dir} has no 'latest' checkpoint; pass --tag")
    model = build_model(cfg)  # the run's task decides: a causal LM or a vision backbone
    with contextlib.redirect_stdout(sys.stderr):
        weights = load_model_weights(ckpt_dir, resolved, zero_stage=cfg.deepspeed.zero_stage)
    model.load_state_dict(weights)
    return model.eval(), cfg, ckpt_dir / resolved
