"""DeepSpeed checkpoints whose ``latest`` pointer moves only after every rank has written everything.

Layout: ``CKPT_DIR/step00000500/`` holds DeepSpeed's files (model, optimizer, LR scheduler) and one
``client_state_rankNNNNN.pt`` per rank (step, counters, that rank's data-stream and RNG states);
``CKPT_DIR/latest`` names the newest complete tag. A tag is complete once its ``complete`` marker is written,
after every rank finished; ``latest`` moves only then. A save interrupted at any point (a full disk, a kill) leaves
``latest`` on the previous complete tag and a *partial* tag, which never counts as a checkpoint: pruning and the
next run's start remove it, and loading it is refused.

Elastic resume: a checkpoint loads on another number of ranks. Without partitioned optimizer states (ZeRO 0 in
fp32) DeepSpeed's model-states file holds everything and loads as it is. Partitioned ones (ZeRO 1-3, or DeepSpeed's
bf16 optimizer) are converted once by DeepSpeed's ``ds_to_universal`` into ``TAG/universal/`` (one file per parameter
and state, whole; ``universal.py``: no rank waits for it in a collective) and loaded with
``checkpoint.load_universal``, each rank taking its new partition; the converted copy is removed after the load.
The client state (step, counters, data cursor) is the same on every rank, so rank 0's serves any new rank.
"""
import contextlib
import logging
import re
import shutil
import sys
from dataclasses import fields
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from ..atomic import atomic_path
from ..config import Config, ConfigError
from ..distributed.engine import reapply_lr_schedule
from ..distributed.process_group import lost_a_rank
from ..models.pretrained import CONFIG, TOKENIZER, WEIGHTS, is_export, load_pretrained, read_export_config
from ..tasks import build_model
from ..tasks.config_checks import load_run_config
from . import universal
from .run_tokenizer import check_tokenizer

TAG = re.compile(r"step(\d{8})")
COMPLETE = "complete"  # marker file: every rank's files of the tag are on disk


class CheckpointError(OSError):
    """A checkpoint that could not be written, or a tag that cannot be loaded; the message names it (an OSError,
    so the tools report it as they report a missing run)."""


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def tag_step(tag: str | None) -> int | None:
    return int(TAG.fullmatch(tag).group(1)) if tag and TAG.fullmatch(tag) else None


def _client_state_path(ckpt_dir: Path, tag: str, rank: int) -> Path:
    return ckpt_dir / tag / f"client_state_rank{rank:05d}.pt"


def latest_tag(ckpt_dir: Path) -> str | None:
    pointer = Path(ckpt_dir) / "latest"
    return pointer.read_text().strip() if pointer.exists() else None


def _tags(ckpt_dir: Path) -> list[str]:
    return sorted(p.name for p in Path(ckpt_dir).glob("step*") if p.is_dir() and TAG.fullmatch(p.name))


def is_complete(ckpt_dir: Path, tag: str) -> bool:
    """Whether every rank finished writing ``tag``: its marker, or a tag no newer than ``latest`` (``latest`` moved
    past it only after it was complete, also before markers existed)."""
    latest = latest_tag(ckpt_dir)
    return (Path(ckpt_dir) / tag / COMPLETE).exists() or (latest is not None and tag <= latest)


def partial_tags(ckpt_dir: Path) -> list[str]:
    """Tags left by an interrupted save."""
    return [tag for tag in _tags(ckpt_dir) if not is_complete(ckpt_dir, tag)] if Path(ckpt_dir).is_dir() else []


def remove_partial_tags(ckpt_dir: Path) -> list[str]:
    """Delete the tags of interrupted saves (one rank, before the run saves): they hold disk and resume nothing."""
    removed = partial_tags(ckpt_dir)
    for tag in removed:
        shutil.rmtree(Path(ckpt_dir) / tag, ignore_errors=True)
    return removed


def space_left(path: Path) -> str:
    """Free space on ``path``'s filesystem, and the file size limit when one is set (``ulimit -f``)."""
    import resource

    text = f"{shutil.disk_usage(path).free / 2**20:,.1f} MiB free there"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return text if limit == resource.RLIM_INFINITY else f"{text}, file size limit (ulimit -f) {limit:,} bytes"


@contextlib.contextmanager
def _writing(ckpt_dir: Path, tag: str):
    """A failed write ends in one ``CheckpointError`` naming the tag, the cause and the space left, after the
    half-written tag is removed. (torch.save on a full disk says only ``basic_ios::clear: iostream error``.)"""
    try:
        yield
    except (OSError, RuntimeError) as err:
        if lost_a_rank(err):  # a collective inside the save failed: not a write failure
            raise
        shutil.rmtree(ckpt_dir / tag, ignore_errors=True)
        cause = (str(err).strip().splitlines() or [type(err).__name__])[0]
        latest = latest_tag(ckpt_dir)
        raise CheckpointError(
            f"could not write checkpoint {ckpt_dir / tag}: {cause} ({space_left(ckpt_dir)}); the partial tag is "
            f"removed and `latest` still names {latest or 'no checkpoint'}: make room, then relaunch to resume"
        ) from err


def save(engine, ckpt_dir: Path, step: int, client_state: dict, *, keep_last: int) -> str:
    """Save on all ranks (a collective call); then mark the tag complete, move ``latest`` and keep only the newest
    ``keep_last`` complete tags."""
    ckpt_dir, tag, rank = Path(ckpt_dir), tag_for(step), dist.get_rank()
    with _writing(ckpt_dir, tag):
        if rank == 0:  # a tag written again (a relaunch from an earlier one) is partial until this save completes
            (ckpt_dir / tag / COMPLETE).unlink(missing_ok=True)
        engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"step": step}, save_latest=False)
        path = _client_state_path(ckpt_dir, tag, rank)
        with atomic_path(path) as tmp:
            torch.save(client_state, tmp)
    dist.barrier()  # every rank's files of this tag are on disk
    if rank == 0:
        with _writing(ckpt_dir, tag):
            (ckpt_dir / tag / COMPLETE).touch()
            with atomic_path(ckpt_dir / "latest") as tmp:
                tmp.write_text(tag)
        _prune(ckpt_dir, keep_last, keep=tag)
    dist.barrier()
    return tag


def _prune(ckpt_dir: Path, keep_last: int, keep: str) -> None:
    """Keep the newest ``keep_last`` (>= 1) complete tags and never the one ``latest`` names; partial tags (other
    saves' leftovers: this one is complete) go too, and never count."""
    complete = [tag for tag in _tags(ckpt_dir) if is_complete(ckpt_dir, tag)]
    for tag in complete[:-keep_last] + partial_tags(ckpt_dir):
        if tag != keep:
            shutil.rmtree(ckpt_dir / tag, ignore_errors=True)


def ranks_that_wrote(ckpt_dir: Path, tag: str) -> int:
    return len(list((Path(ckpt_dir) / tag).glob("client_state_rank*.pt")))


def needs_resharding(ckpt_dir: Path, world_size: int) -> bool:
    """Whether the latest checkpoint holds optimizer states partitioned over another number of ranks than
    ``world_size``: the engine must then be built to load a universal checkpoint (``load_universal``)."""
    tag = latest_tag(ckpt_dir)
    return (tag is not None and ranks_that_wrote(ckpt_dir, tag) != world_size
            and any((Path(ckpt_dir) / tag).glob("*optim_states.pt")))


def _repair_universal_load(engine, settings: list[dict]) -> None:
    """Undo two slips of DeepSpeed's ZeRO-3 universal load (0.19.8): every param group gets the first group's
    settings (weight decay on norms and biases too), and every group's state the same ``step`` tensor, which Adam
    then increments once per group (its bias correction runs ahead). ``settings`` are each group's, taken before."""
    for group, own in zip(engine.optimizer.param_groups, settings, strict=True):
        group.update(own)
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)  # the torch optimizer under ZeRO's
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


# DeepSpeed's universal load says this on every rank when no model-parallel unit is given: this trainer has no
# tensor parallelism, so a tensor-parallel size of 1 is right and the warning only noise.
NO_MPU_WARNING = "MPU is not provided, setting tp size to 1 in checkpoint loading."


class _DropMessage(logging.Filter):
    def __init__(self, message: str):
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != self.message


@contextlib.contextmanager
def _without_deepspeed_warning(message: str):
    """DeepSpeed's logger drops exactly ``message`` inside the block; anything else it says still shows."""
    from deepspeed.utils import logger

    dropping = _DropMessage(message)
    logger.addFilter(dropping)
    try:
        yield
    finally:
        logger.removeFilter(dropping)


def load(engine, ckpt_dir: Path, *, tag: str | None = None) -> dict | None:
    """Restore model, optimizer and LR scheduler from ``tag`` (default: ``latest``), on the number of ranks that
    wrote it or another (``resharded`` in the returned state: how the universal copy was made, or None); return
    this rank's client state (rank 0's for a rank the checkpoint did not have), or None when there is nothing to
    resume."""
    ckpt_dir, rank = Path(ckpt_dir), dist.get_rank()
    tag = tag or latest_tag(ckpt_dir)
    if tag is None:
        return None
    written_by = ranks_that_wrote(ckpt_dir, tag)
    path = _client_state_path(ckpt_dir, tag, rank if rank < written_by else 0)
    if not path.exists():
        raise CheckpointError(f"{path} is missing: checkpoint {ckpt_dir / tag} is incomplete")
    client_state = torch.load(path, weights_only=False)
    load_dir, load_tag, resharded = ckpt_dir, tag, None
    settings = [{key: value for key, value in group.items() if key not in ("params", "lr", "initial_lr")}
                for group in engine.optimizer.param_groups]  # this run's; the LR is the schedule's
    if engine.load_universal_checkpoint():  # built so by needs_resharding
        try:
            seconds = universal.prepare_on_every_rank(ckpt_dir / tag)
        except universal.ConversionError as err:
            raise CheckpointError(f"{err}; resume with the number of ranks that wrote it ({written_by})") from None
        resharded = (f"converted in {seconds:.1f} s" if seconds is not None
                     else "converted ahead of the launch by tools/reshard.py")
        load_dir, load_tag = ckpt_dir / tag, universal.UNIVERSAL
    with _without_deepspeed_warning(NO_MPU_WARNING):
        loaded, _ = engine.load_checkpoint(str(load_dir), tag=load_tag)
    if loaded is None:
        raise CheckpointError(f"DeepSpeed could not load checkpoint {ckpt_dir / tag}")
    if load_tag == universal.UNIVERSAL:
        _repair_universal_load(engine, settings)
        dist.barrier()
        if rank == 0:
            universal.remove(ckpt_dir / tag)
    reapply_lr_schedule(engine)  # a relaunch may have changed train.max_steps, so the schedule
    return {**client_state, "written_by": written_by, "resharded": resharded}


def load_model_weights(ckpt_dir: Path, tag: str, *, zero_stage: int) -> dict[str, torch.Tensor]:
    """The full model state dict of a checkpoint, on CPU, in one process, whatever ZeRO stage wrote it.

    Without ZeRO the model states file holds the whole module; under ZeRO the fp32 master weights are partitioned
    over the ranks' optimizer files, and DeepSpeed's ``zero_to_fp32`` reassembles them.
    """
    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / tag).is_dir():
        raise FileNotFoundError(f"checkpoint {ckpt_dir / tag} does not exist")
    if not is_complete(ckpt_dir, tag):
        complete = [t for t in _tags(ckpt_dir) if is_complete(ckpt_dir, t)]
        raise CheckpointError(f"checkpoint {ckpt_dir / tag} is partial (its save was interrupted, no {COMPLETE!r} "
                              f"marker); pass a complete tag: {', '.join(complete) or 'there is none'}")
    if zero_stage == 0:
        states = torch.load(ckpt_dir / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        return {name: tensor.float() for name, tensor in states["module"].items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)


def trained_config(path: Path):
    """The checked config of a run directory (``config.yaml``) or of an exported model directory (``config.json``,
    with ``data.tokenizer`` pointing at the tokenizer copy beside it), without reading any weights."""
    path = Path(path)
    if is_export(path):
        overrides, exported = [], read_export_config(path)
        if exported.get("data", {}).get("tokenizer"):  # the run had a tokenizer: the copy
            tokenizer = path / TOKENIZER
            if not tokenizer.is_file():
                raise FileNotFoundError(f"{tokenizer} is missing: export the run again")
            check_tokenizer(path, str(tokenizer))
            overrides = [f"data.tokenizer={tokenizer}"]
        # beside the run's sections, the keys transformers reads and its save_pretrained writes (pretrain.hf)
        return load_run_config(path / CONFIG, overrides, foreign_keys=set(exported) - {f.name for f in fields(Config)})
    if not (path / "config.yaml").is_file():
        raise FileNotFoundError(f"{path} is neither a run directory (no {path / 'config.yaml'}) nor an exported "
                                f"model (no {path / WEIGHTS})")
    tokenizer = OmegaConf.load(path / "config.yaml").get("data", {}).get("tokenizer")
    if tokenizer:  # before the config's checks read it
        check_tokenizer(path, tokenizer)
    return load_run_config(path / "config.yaml")


def load_trained_model(run: Path, tag: str = "latest"):
    """``(model, cfg, source)`` of a run directory (its config and the weights of checkpoint ``tag``) or of an
    exported model directory (``tools/export.py``; the source is the directory).

    The model comes back in fp32 on CPU, in eval mode; ``tag="latest"`` follows the run's ``latest`` pointer.
    DeepSpeed's ``zero_to_fp32`` reports on stdout; that goes to stderr so a tool's stdout stays its results.
    """
    run = Path(run)
    cfg = trained_config(run)
    if is_export(run):
        if tag != "latest":
            raise ValueError(f"{run} is an exported model, which has no checkpoint tags; drop --tag {tag}")
        return load_pretrained(run), cfg, run
    ckpt_dir = run / "checkpoints"
    resolved = latest_tag(ckpt_dir) if tag == "latest" else tag
    if resolved is None:
        raise FileNotFoundError(f"{ckpt_dir} has no 'latest' checkpoint; pass --tag")
    model = build_model(cfg)  # the run's task decides: a causal LM or a vision backbone
    with contextlib.redirect_stdout(sys.stderr):
        weights = load_model_weights(ckpt_dir, resolved, zero_stage=cfg.deepspeed.zero_stage)
    model.load_state_dict(weights)
    return model.eval(), cfg, ckpt_dir / resolved


def init_weights(model: torch.nn.Module, source: str) -> Path:
    """Copy into ``model`` the weights of ``source`` (``train.init_from``: a run directory's latest checkpoint or an
    exported model), weights only; another architecture is refused naming the parameter and both shapes. Returns
    the checkpoint or directory read."""
    try:
        trained, _, where = load_trained_model(Path(source))
    except (OSError, ValueError) as err:  # a missing or broken source; its config (ConfigError is a ValueError)
        raise ConfigError("train.init_from", f"cannot load {source}: {err}") from None
    theirs, ours = trained.state_dict(), model.state_dict()
    for name in [*ours, *(name for name in theirs if name not in ours)]:
        mine, found = ours.get(name), theirs.get(name)
        if mine is None or found is None or mine.shape != found.shape:
            in_source = "is absent" if found is None else f"has shape {list(found.shape)}"
            in_run = "is absent" if mine is None else f"{'has ' if found is None else ''}shape {list(mine.shape)}"
            raise ConfigError("train.init_from", f"parameter {name} {in_source} in {where} but {in_run} in this "
                                                 "run's model: the architectures differ; make model.* (and the "
                                                 "vocabulary) match the source's")
    model.load_state_dict(theirs)
    return where
