"""The training loop: batches → DeepSpeed engine → metrics, validation and checkpoints; resumes exactly.

The loop knows no mixer and no task: a ``pretrain.tasks`` Task gives it the data, the model, the loss of a batch
and the validation figures; the loop keeps what every task shares (engine, metrics, checkpoints, resume, signals,
non-finite steps).
"""
import contextlib
import math
import os
import time
from dataclasses import asdict, dataclass
from itertools import chain
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from pretrain.config import ConfigError
from pretrain.data import ShardError
from pretrain.distributed import (
    World,
    apply_activation_checkpointing,
    apply_sequence_parallel,
    build_engine,
    close_process_group,
    init_process_group,
    split_sequences,
)
from pretrain.distributed.engine import reapply_lr_schedule, step_with_grad_norm
from pretrain.distributed.process_group import gone_ranks, lost_a_rank
from pretrain.exit_codes import PREEMPTED
from pretrain.host_memory import keep_freed_memory
from pretrain.models.compile import compile_blocks
from pretrain.scopes import BACKWARD, scope
from pretrain.tasks import build_task

from . import checkpoint, run_lock
from .metrics import MetricsWriter, device_peak_flops, peak_memory_bytes
from .preemption import StopRequest, held_from_child_processes
from .rng import rng_state, seed_everything, set_rng_state
from .run_dir import check_relaunch, prepare_run_dir
from .run_tokenizer import pin_tokenizer
from .schedule import Plan


class RankLostError(RuntimeError):
    """Another rank died mid-run; this one stops too, naming it and the checkpoint a relaunch resumes from."""


class NonFiniteLossError(RuntimeError):
    """Too many non-finite losses in a row; the run stops and its last good checkpoint stays the resume point."""


class CorruptShardStop(RuntimeError):
    """A rank met a corrupt training shard: every rank saved the last completed step and stops (exit
    ``CORRUPT_SHARD``). ``met``: this rank is the first that met the shard, and its message names it and how to go
    on."""

    def __init__(self, message: str, met: bool):
        super().__init__(message)
        self.met = met


@dataclass
class Counters:
    step: int = 0               # training iterations done (skipped ones included)
    units_seen: int = 0         # tokens or images (the task's unit), over all ranks
    nonfinite_skipped: int = 0  # steps with a non-finite loss (skipped) or gradient norm, over the run
    nonfinite_in_a_row: int = 0


class StepResult(NamedTuple):
    loss: torch.Tensor | None  # this rank's loss averaged over the step's micro-batches, on the device; None: skipped
    grad_norm: float | None    # the global gradient norm before clipping; None when skipped
    stop: bool                 # a rank got a stop signal: every rank leaves the loop after this step
    unreadable: bool = False   # a rank's data was unreadable (a corrupt shard): nothing trained, every rank stops
    error: ShardError | None = None  # this rank's, when it met the corrupt shard


def train_step(engine, task, batches, world: World, accum: int, stop: StopRequest, fallback=None) -> StepResult:
    """One optimizer step over ``accum`` micro-batches: one collective of its own, nothing read on the host per
    micro-batch.

    The step's micro-batches are drawn first. After the first one's forward and before any backward, a single
    all-reduce of a three-flag tensor asks whether any rank's loss is non-finite, whether any rank got a stop signal
    and whether any rank's data was unreadable. A non-finite loss skips the step (no backward, no update; every
    micro-batch was drawn, so the data stream stays step-aligned). A corrupt shard met by one rank only is known to
    all before any backward: that rank runs its forward on ``fallback`` (its last batch: under ZeRO-3 and sequence
    parallelism a forward is a collective) and every rank skips the step. The losses stay on the device;
    ``Trainer.log`` averages them over ranks when it logs. A non-finite loss in a later micro-batch of an
    accumulated step cannot be withdrawn (DeepSpeed has no API to drop accumulated gradients): its gradients make
    the step's gradient norm non-finite, which counts as a non-finite step.
    """
    micro_batches, error = [], None
    try:
        for _ in range(accum):
            micro_batches.append(next(batches))
    except ShardError as err:
        if not micro_batches and fallback is None:
            raise
        error = err
    loss = _mean_loss(engine, task, micro_batches[0] if micro_batches else fallback, world.device)
    flags = torch.stack([~torch.isfinite(loss.detach()), torch.tensor(stop.requested, device=world.device),
                         torch.tensor(error is not None, device=world.device)]).int()
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    nonfinite, stopping, unreadable = flags.tolist()
    if nonfinite or unreadable:
        return StepResult(None, None, bool(stopping), bool(unreadable), error)
    total, grad_norm = torch.zeros((), device=world.device), None
    for micro, batch in enumerate(micro_batches):
        if micro > 0:
            loss = _mean_loss(engine, task, batch, world.device)
        total += loss.detach()
        with scope(BACKWARD):
            engine.backward(loss)
        grad_norm = step_with_grad_norm(engine)
    return StepResult(total / accum, grad_norm, bool(stopping))


class LastDrawn:
    """An iterator that keeps the item it gave last (``last``): a rank whose next batch is unreadable runs its
    step's forward on it."""

    def __init__(self, items):
        self.items, self.last = iter(items), None

    def __iter__(self):
        return self

    def __next__(self):
        self.last = next(self.items)
        return self.last


def _mean_loss(engine, task, batch, device) -> torch.Tensor:
    loss_sum, count = task.loss(engine, batch, device)
    return loss_sum / count


def _mean_over_ranks(value: torch.Tensor, world: World) -> float:
    value = value.detach().float().clone()
    dist.all_reduce(value)
    return value.item() / world.world_size


class Throughput:
    """Units (tokens, images) per second, achieved FLOP/s and MFU over the training steps since the last report
    (pauses are not counted). The FLOPs are the model's (``Task.train_flops_per_unit``: 3× a forward, recomputation
    never counted); MFU divides them by ``peak_flops``, the device's peak (None: not reported)."""

    def __init__(self, unit: str, units_per_step: int, train_flops_per_unit: float, world_size: int,
                 peak_flops: float | None):
        self.unit, self.units_per_step, self.flops_per_unit = unit, units_per_step, train_flops_per_unit
        self.world_size, self.peak_flops = world_size, peak_flops
        self.restart()

    def restart(self) -> None:
        self.start, self.steps = time.perf_counter(), 0

    def report(self) -> dict[str, float]:
        per_s = self.steps * self.units_per_step / (time.perf_counter() - self.start)
        self.restart()
        per_rank = per_s / self.world_size
        values = {f"train/{self.unit}_per_s": per_s, f"train/{self.unit}_per_s_per_rank": per_rank,
                  "train/flops_per_s_per_rank": self.flops_per_unit * per_rank}
        if self.peak_flops:
            values["train/mfu"] = values["train/flops_per_s_per_rank"] / self.peak_flops
        return values


class Trainer:
    """Everything one rank holds for a run, and the loop that steps it."""

    def __init__(self, cfg: DictConfig):
        self.cfg, t = cfg, cfg.train
        self.world = split_sequences(init_process_group(cfg.parallel.collective_timeout_s),
                                     cfg.parallel.sequence_parallel)
        if self.world.device.type == "cpu":  # the step's temporaries reuse freed memory, not fresh pages
            keep_freed_memory()
        lock_note = run_lock.hold(Path(cfg.run.dir), self.world.is_main)  # before anything is written there
        pin_tokenizer(Path(cfg.run.dir), cfg.data.tokenizer, is_main=self.world.is_main,
                      resuming=checkpoint.latest_tag(Path(cfg.run.dir) / "checkpoints") is not None)
        self.run_dir = prepare_run_dir(cfg, self.world.is_main)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.task = build_task(cfg, self.world)

        seed_everything(cfg.run.seed)  # the same initial weights on every rank
        model = self.task.build_model()
        # train.init_from: another run's weights, before DeepSpeed takes the model (ZeRO-3 partitions them then);
        # a run with a checkpoint of its own resumes from it instead (resume below)
        self.initialised_from = None
        if cfg.train.init_from and checkpoint.latest_tag(self.ckpt_dir) is None:
            self.initialised_from = checkpoint.init_weights(model, cfg.train.init_from)
        train_flops_per_unit = self.task.train_flops_per_unit(model)  # before ZeRO-3 partitions the weights
        apply_sequence_parallel(model, self.world.sequence, t.seq_len)
        if t.compile:  # before checkpointing, which wraps the compiled forward (pretrain/models/compile.py)
            compile_blocks(model)
        if cfg.deepspeed.activation_checkpointing:
            apply_activation_checkpointing(model)
        self.schedule = Plan(lr=cfg.optim.lr, min_lr=cfg.optim.min_lr, name=cfg.schedule.name,
                             warmup_steps=cfg.schedule.warmup_steps, decay_steps=cfg.schedule.decay_steps,
                             max_steps=t.max_steps)
        self.engine = build_engine(cfg, model, self.world.world_size, self.schedule,
                                   load_universal=checkpoint.needs_resharding(self.ckpt_dir, self.world.world_size))

        self.writer = MetricsWriter(self.run_dir, self.world.is_main,
                                    resume_step=checkpoint.tag_step(checkpoint.latest_tag(self.ckpt_dir)) or 0)
        for note in (lock_note, self.schedule.warmup_notice()):
            if note:
                self.writer.print(note)
        self.counters = Counters()
        self.units_per_step = self.task.units_per_micro_batch * t.grad_accum_steps * self.world.world_size
        self.throughput = Throughput(self.task.unit, self.units_per_step, train_flops_per_unit, self.world.world_size,
                                     device_peak_flops(self.world.device))

    def resume(self) -> None:
        """Continue from the latest checkpoint if there is one: weights, optimizer, LR, data, RNG, counters. Tags an
        interrupted save left are removed first (rank 0), so they neither hold the disk nor count as checkpoints."""
        if self.world.is_main:
            for tag in checkpoint.remove_partial_tags(self.ckpt_dir):
                self.writer.print(f"removed partial checkpoint {self.ckpt_dir / tag} (its save was interrupted)")
        resumed = checkpoint.load(self.engine, self.ckpt_dir)
        if resumed is None:
            self.writer.text("config", "```\n" + OmegaConf.to_yaml(self.cfg) + "```")
            if self.initialised_from:
                self.writer.print(f"initialised the weights from {self.initialised_from} (train.init_from; a new "
                                  "optimizer, schedule and data position)")
            return
        self.counters = Counters(**resumed["counters"])
        try:
            self.task.load_state_dict(resumed["data"])
        except ValueError as err:  # another data stream (a task's or an older layout's state): one line
            raise checkpoint.CheckpointError(f"cannot resume {self.ckpt_dir / checkpoint.latest_tag(self.ckpt_dir)}"
                                             f": {err}") from None
        set_rng_state(resumed["rng"])
        self.writer.print(f"resumed from {self.ckpt_dir / checkpoint.latest_tag(self.ckpt_dir)} "
                          f"at step {self.counters.step}")
        for line in elastic_resume_lines(resumed, self.layout()):
            self.writer.print(line)
        if self.counters.step >= self.cfg.train.max_steps:
            raise ConfigError("train.max_steps", not_past(self.cfg.train.max_steps, self.counters.step))
        replanned = self.schedule.resume(resumed.get("schedule"), self.counters.step)
        if replanned:
            reapply_lr_schedule(self.engine)
            self.writer.print(replanned)
        if self.cfg.train.init_from:
            self.writer.print(f"train.init_from {self.cfg.train.init_from} is not applied: the run resumes from its "
                              "own checkpoint")

    def layout(self) -> dict:
        """How the run's ranks share a step (saved with a checkpoint, compared on resume)."""
        t = self.cfg.train
        return {"world_size": self.world.world_size, "replicas": self.world.data_size,
                "sequence_parallel": self.cfg.parallel.sequence_parallel,
                "rows_per_step": t.micro_batch_size * t.grad_accum_steps * self.world.data_size}

    def save(self, data: dict | None = None, rng: dict | None = None) -> None:
        """A checkpoint of the step done; ``data`` and ``rng``: the states at that step's end when the stream and
        the generators have moved on since (a step left untrained)."""
        state = {"counters": asdict(self.counters), "data": self.task.state_dict() if data is None else data,
                 "rng": rng_state() if rng is None else rng, "schedule": self.schedule.state(), **self.layout()}
        tag = checkpoint.save(self.engine, self.ckpt_dir, self.counters.step, state,
                              keep_last=self.cfg.checkpoint.keep_last)
        self.writer.print(f"saved checkpoint {self.ckpt_dir / tag}")

    def validate(self) -> None:
        """The task's validation figures (reduced over ranks), with the model in eval mode."""
        self.engine.eval()
        values = self.task.validate(self.engine, self.world.device)
        self.engine.train()
        self.writer.scalars(self.counters.step, values)
        self.writer.print(f"step {self.counters.step} | " + " | ".join(
            f"{key.removeprefix('val/').replace('_', ' ')} {value:.4f}" if isinstance(value, float) else
            f"{key.removeprefix('val/')} {value}" for key, value in values.items()))

    def stop_on_corrupt_shard(self, error: ShardError | None, data: dict, rng: dict) -> None:
        """A rank's next batch was unreadable: every rank saves the last completed step, as a stop does (with the
        data and RNG states of that step's end: the stream has moved on on the ranks that read their batches), unless
        it is saved already or diverging, and stops."""
        latest = checkpoint.latest_tag(self.ckpt_dir)
        saving = self.counters.step > (checkpoint.tag_step(latest) or 0) and self.counters.nonfinite_in_a_row == 0
        if saving:
            self.save(data, rng)
        errors = [None] * self.world.world_size  # the LM's replicas all read every shard: said once, by the first
        dist.all_gather_object(errors, error and str(error))
        if error is None or str(error) in errors[:self.world.rank]:
            raise CorruptShardStop("another rank met a corrupt shard", met=False)
        raise CorruptShardStop(self.corrupt_message(error, saved=saving), met=True)

    def corrupt_message(self, error: ShardError, saved: bool) -> str:
        """The corrupt shard, what was kept, and the key that leaves the shard out."""
        step, latest = self.counters.step, checkpoint.latest_tag(self.ckpt_dir)
        kept = (f"saved step {step} ({self.ckpt_dir / latest})" if saved else
                f"the latest checkpoint is {self.ckpt_dir / latest}" if latest else "no checkpoint was saved yet")
        return (f"{error}, at step {step + 1}; {kept}. Relaunch the same command with data.skip_corrupt=true to "
                f"leave the shard out and go on (counted in train/skipped_shards), or replace the shard")

    def lost_rank_message(self, gone: list[int]) -> str:
        who = (f"rank{'s' if len(gone) > 1 else ''} {', '.join(str(r) for r in gone)} (pid "
               f"{', '.join(str(self.world.processes[r][1]) for r in gone)}) died" if gone else
               "another rank died (on another host, or it closed its connection)")
        latest = checkpoint.latest_tag(self.ckpt_dir)
        resume = (f"relaunch the same command to resume from {self.ckpt_dir / latest}" if latest else
                  "no checkpoint was saved yet: a relaunch starts afresh")
        return f"{who} at step {self.counters.step}; rank {self.world.rank} stops too: {resume}"

    def count_bad_step(self, loss: torch.Tensor | None, grad_norm: float | None) -> None:
        """Count a non-finite step; stop the run after ``train.max_nonfinite_steps`` of them in a row."""
        c, limit = self.counters, self.cfg.train.max_nonfinite_steps
        c.nonfinite_skipped += 1
        c.nonfinite_in_a_row += 1
        what = "loss, step skipped" if loss is None else f"gradient norm ({grad_norm})"
        self.writer.print(f"step {c.step}: non-finite {what} ({c.nonfinite_in_a_row} in a row, "
                          f"{c.nonfinite_skipped} in all)")
        if c.nonfinite_in_a_row >= limit:
            latest = checkpoint.latest_tag(self.ckpt_dir)
            raise NonFiniteLossError(
                f"{c.nonfinite_in_a_row} non-finite steps in a row (train.max_nonfinite_steps={limit}) at step "
                f"{c.step}; stopping. The last good checkpoint is "
                f"{self.ckpt_dir / latest if latest else 'none (no checkpoint was saved yet)'}")

    def log(self, loss: torch.Tensor, grad_norm: float, lr: float) -> None:
        """Every training metric of this step; ``loss`` (this rank's, on the device) is averaged over ranks here,
        the only place a training loss is read on the host."""
        loss = _mean_over_ranks(loss, self.world)
        values = {"train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm, **self.throughput.report(),
                  "train/peak_memory_bytes": peak_memory_bytes(self.world.device), "train/epoch": self.task.epoch,
                  f"train/{self.task.unit}_seen": self.counters.units_seen,
                  "train/nonfinite_skipped": self.counters.nonfinite_skipped, **self.task.train_metrics()}
        mfu = f" | MFU {values['train/mfu']:.1%}" if "train/mfu" in values else ""
        self.writer.scalars(self.counters.step, values)
        self.writer.print(f"step {self.counters.step}/{self.cfg.train.max_steps} | loss {loss:.4f} | lr {lr:.2e} | "
                          f"grad {grad_norm:.3f} | {values[f'train/{self.task.unit}_per_s']:,.0f} {self.task.unit}/s | "
                          f"{values['train/flops_per_s_per_rank'] / 1e12:.3f} TFLOP/s/rank{mfu} | "
                          f"epoch {self.task.epoch}")

    def run(self) -> bool:
        """Train until ``train.max_steps`` or a stop signal; return whether a signal stopped it (after a save)."""
        with self.stepping() as (stop, batches):
            stopped = self._steps(stop, batches)
        self.writer.close()
        return stopped

    @contextlib.contextmanager
    def stepping(self):
        """``(stop, batches)`` to call ``step`` with: the signals that ask for a stop are watched, and the data
        loader's workers are stopped on the way out, error or not (left running, a worker kept a failed run waiting
        on it at exit)."""
        self.writer.print(f"step {self.counters.step}: opening the training shards "
                          f"(data.num_workers={self.cfg.data.num_workers})")
        with StopRequest() as stop:
            with held_from_child_processes():  # the first batch starts the loader's worker processes
                loader = self.task.batches()
                try:
                    first = next(loader)
                except ShardError as err:  # nothing trained since the resumed checkpoint: nothing to save
                    raise CorruptShardStop(self.corrupt_message(err, saved=False), met=True) from None
            with contextlib.closing(loader):
                yield stop, LastDrawn(chain([first], loader))

    def step(self, stop: StopRequest, batches: LastDrawn) -> bool:
        """One training step and its bookkeeping: counters, throughput, a non-finite step counted, the metrics
        logged every ``log.every`` steps; a shard unreadable on any rank saves the step before and stops the run.
        Returns whether a rank asked to stop."""
        cfg, c = self.cfg, self.counters
        lr = self.engine.get_lr()[0]
        step_start = self.task.state_dict(), rng_state()  # saved instead, should this step's data be unreadable
        loss, grad_norm, stopping, unreadable, error = train_step(
            self.engine, self.task, batches, self.world, cfg.train.grad_accum_steps, stop, fallback=batches.last)
        if unreadable:
            self.stop_on_corrupt_shard(error, *step_start)
        c.step += 1
        c.units_seen += self.units_per_step
        self.throughput.steps += 1
        if loss is None or not math.isfinite(grad_norm):
            self.count_bad_step(loss, grad_norm)
        else:
            c.nonfinite_in_a_row = 0
            if c.step % cfg.log.every == 0:
                self.log(loss, grad_norm, lr)
        return stopping

    def _steps(self, stop: StopRequest, batches: LastDrawn) -> bool:
        cfg, c, world = self.cfg, self.counters, self.world
        self.throughput.restart()
        while c.step < cfg.train.max_steps:
            stopping = self.step(stop, batches)
            validating = self.task.has_validation and c.step % cfg.log.val_every == 0
            saving = c.step % cfg.checkpoint.every == 0 or c.step == cfg.train.max_steps or stopping
            if validating:
                self.validate()
            if saving and c.nonfinite_in_a_row == 0:  # never replace a good checkpoint by a diverging state
                self.save()
            if validating or saving:
                self.throughput.restart()
            if stopping:
                self.writer.print(f"stopped by {stop_reason(stop, world)} at step {c.step}; "
                                  f"relaunch the same command to resume (exit code {PREEMPTED})")
                return True
        return False


def stop_reason(stop: StopRequest, world: World) -> str:
    """Why the run stops, as the first rank that was asked says it (one gather of strings, once a run): rank 0 may
    learn of a stop only through the step's flag, a launcher's end being seen first by another rank's watcher."""
    reasons = [None] * world.world_size
    dist.all_gather_object(reasons, stop.reason)
    rank, reason = next(((r, why) for r, why in enumerate(reasons) if why), (None, "a request on no rank"))
    return reason if rank in (None, world.rank) else f"{reason} (on rank {rank})"


def elastic_resume_lines(resumed: dict, now: dict) -> list[str]:
    """What a resume on another layout of ranks changed, one line each: the resharding, the global batch."""
    lines, written_by, sp_before = [], resumed["written_by"], resumed.get("sequence_parallel", 1)
    if written_by != now["world_size"] or sp_before != now["sequence_parallel"]:
        if resumed["resharded"] is not None:
            how = f"optimizer states resharded through DeepSpeed's universal checkpoint ({resumed['resharded']})"
        elif written_by != now["world_size"]:
            how = "the checkpoint holds whole states (no ZeRO partitions), loaded as they are"
        else:
            how = "the ranks' partitions are unchanged"
        lines.append(f"elastic resume: written by {written_by} rank(s) (sequence_parallel {sp_before}), now "
                     f"{now['world_size']} (sequence_parallel {now['sequence_parallel']}); {how}")
    before = resumed.get("rows_per_step")
    if before is not None and before != now["rows_per_step"]:
        lines.append(f"the global batch changes from {before} to {now['rows_per_step']} rows a step "
                     f"(micro_batch_size × grad_accum_steps × {now['replicas']} data-parallel replicas): the data "
                     "stream continues where it stopped, and the losses are no longer an uninterrupted run's")
    return lines


def finished_step(cfg: DictConfig) -> int | None:
    """The step of the run's latest checkpoint when ``train.max_steps`` is that step: the run is finished and a
    relaunch has nothing to do (None otherwise). Decided from the ``latest`` tag alone, before any process group,
    engine or load, writing nothing; a config that changes the run is refused first, as a resume refuses it, and a
    ``max_steps`` below the step raises the ``ConfigError`` a resume would raise after loading."""
    run_dir = Path(cfg.run.dir)
    step = checkpoint.tag_step(checkpoint.latest_tag(run_dir / "checkpoints"))
    if step is None or step < cfg.train.max_steps:
        return None
    check_relaunch(cfg)
    if step > cfg.train.max_steps:
        raise ConfigError("train.max_steps", not_past(cfg.train.max_steps, step))
    return step


def not_past(max_steps: int, step: int) -> str:
    return f"{max_steps} is not past the resumed step {step}: nothing to train; raise it to continue"


def train(cfg: DictConfig) -> bool:
    """Train the run ``cfg`` describes, resuming from ``RUN_DIR/checkpoints`` when it holds a checkpoint; return
    whether a stop signal ended it early (saved: ``launch/pretrain.py`` exits with ``PREEMPTED``). A run already at
    ``train.max_steps`` is left untouched (rank 0 says so in one line; False: finished)."""
    finished = finished_step(cfg)
    if finished is not None:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"run.dir {cfg.run.dir} already finished at step {finished} (train.max_steps "
                  f"{cfg.train.max_steps}); nothing to do", flush=True)
        return False
    trainer = None
    try:
        trainer = Trainer(cfg)
        trainer.resume()
        return trainer.run()
    except CorruptShardStop:
        raise  # every rank saved and stops: a rank gone by now has just stopped first
    except Exception as err:
        # A dead rank shows here as a failed collective (the launcher's SIGTERM to this rank and its loader workers
        # is a stop request, and ignored by the workers): its death is the news.
        if trainer is None or trainer.world.world_size == 1:
            raise
        gone = gone_ranks(trainer.world, wait_s=3.0 if lost_a_rank(err) else 0.0)
        if not (gone or lost_a_rank(err)):
            raise
        raise RankLostError(trainer.lost_rank_message(gone)) from err
    finally:
        close_process_group()
