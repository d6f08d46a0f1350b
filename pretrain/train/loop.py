"""The training loop: batches → DeepSpeed engine → metrics, validation and checkpoints; resumes exactly.

The loop knows no mixer: it sees a model that maps token ids to logits, and an engine that steps it.
"""
import functools
import math
import time
from dataclasses import asdict, dataclass
from itertools import chain

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from pretrain.config import ConfigError
from pretrain.data import TokenLoader, Tokenizer
from pretrain.data.shards import expand_shards
from pretrain.data.text_shards import iter_shard_documents
from pretrain.distributed import World, apply_activation_checkpointing, build_engine, init_process_group
from pretrain.distributed.engine import step_with_grad_norm
from pretrain.models import build_lm

from . import checkpoint
from .evaluate import batch_nll, score_documents
from .metrics import MetricsWriter, device_peak_flops, peak_memory_bytes
from .preemption import StopRequest
from .rng import rng_state, seed_everything, set_rng_state
from .run_dir import prepare_run_dir
from .schedule import lr_at


class NonFiniteLossError(RuntimeError):
    """Too many non-finite losses in a row; the run stops and its last good checkpoint stays the resume point."""


@dataclass
class Counters:
    step: int = 0               # training iterations done (skipped ones included)
    tokens_seen: int = 0        # over all ranks
    nonfinite_skipped: int = 0  # steps with a non-finite loss (skipped) or gradient norm, over the run
    nonfinite_in_a_row: int = 0


def _all_ranks_mean(value: torch.Tensor, world: World) -> torch.Tensor:
    value = value.detach().float().clone()
    dist.all_reduce(value)
    return value / world.world_size


def train_step(engine, batches, world: World, accum: int) -> tuple[float | None, float | None]:
    """One optimizer step over ``accum`` micro-batches: (loss averaged over ranks and micro-batches, grad norm).

    A non-finite loss on any rank skips the step (no backward, no update, remaining micro-batches drawn unused so
    the data stream stays step-aligned) and returns ``(None, None)``. Gradients already accumulated by earlier
    micro-batches of the step cannot be dropped through DeepSpeed's API, so a non-finite loss there stops the run.
    """
    total, grad_norm = 0.0, None
    for micro in range(accum):
        batch = next(batches)
        nll, count = batch_nll(engine, batch, world.device)
        loss = nll / count
        mean_loss = _all_ranks_mean(loss, world).item()
        if not math.isfinite(mean_loss):
            if micro > 0:
                raise NonFiniteLossError(f"non-finite loss in micro-batch {micro} of an accumulated step; its earlier"
                                         " micro-batches' gradients cannot be dropped")
            for _ in range(accum - 1):
                next(batches)
            return None, None
        engine.backward(loss)
        grad_norm = step_with_grad_norm(engine)
        total += mean_loss
    return total / accum, grad_norm


def _stop_requested(stop: StopRequest, world: World) -> bool:
    """Whether any rank got a signal: all ranks must agree to leave the loop at the same step."""
    flag = torch.tensor(int(stop.requested), device=world.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag)


def _client_state(counters: Counters, loader: TokenLoader, world: World) -> dict:
    return {"counters": asdict(counters), "data": loader.state_dict(), "rng": rng_state(),
            "world_size": world.world_size}


def train(cfg: DictConfig) -> None:
    """Train the run ``cfg`` describes, resuming from ``RUN_DIR/checkpoints`` when it holds a checkpoint."""
    world = init_process_group()
    run_dir = prepare_run_dir(cfg, world.is_main)
    ckpt_dir = run_dir / "checkpoints"
    t = cfg.train

    seed_everything(cfg.run.seed)  # the same initial weights on every rank
    model = build_lm(cfg.model)
    flops_per_token = model.flops_per_token(t.seq_len)  # before ZeRO-3 partitions the weights
    if cfg.deepspeed.activation_checkpointing:
        apply_activation_checkpointing(model)
    schedule = functools.partial(lr_at, lr=cfg.optim.lr, min_lr=cfg.optim.min_lr, name=cfg.schedule.name,
                                 warmup_steps=cfg.schedule.warmup_steps, decay_steps=cfg.schedule.decay_steps,
                                 max_steps=t.max_steps)
    engine = build_engine(cfg, model, world.world_size, schedule)

    try:
        tokenizer = Tokenizer(cfg.data.tokenizer)
    except (OSError, ValueError) as err:
        raise ConfigError("data.tokenizer", str(err)) from None
    try:  # a missing, foreign or too small set of shards (ShardError is a ValueError)
        loader = TokenLoader(cfg.data.train_shards, seq_len=t.seq_len, batch_size=t.micro_batch_size,
                             rank=world.rank, world_size=world.world_size, seed=cfg.run.seed,
                             num_workers=cfg.data.num_workers, shuffle_buffer=cfg.data.shuffle_buffer,
                             allow_pipe=cfg.data.allow_pipe, skip_corrupt=cfg.data.skip_corrupt,
                             tokenizer_sha256=tokenizer.sha256)
    except (OSError, ValueError) as err:
        raise ConfigError("data.train_shards", str(err)) from None
    counters = Counters()
    writer = MetricsWriter(run_dir, world.is_main)
    resumed = checkpoint.load(engine, ckpt_dir)
    if resumed is None:
        writer.text("config", "```\n" + OmegaConf.to_yaml(cfg) + "```")
    else:
        counters = Counters(**resumed["counters"])
        loader.load_state_dict(resumed["data"])
        set_rng_state(resumed["rng"])
        writer.print(f"resumed from {ckpt_dir / checkpoint.latest_tag(ckpt_dir)} at step {counters.step}")

    def save() -> None:
        tag = checkpoint.save(engine, ckpt_dir, counters.step, _client_state(counters, loader, world),
                              keep_last=cfg.checkpoint.keep_last)
        writer.print(f"saved checkpoint {ckpt_dir / tag}")

    try:
        val_urls = expand_shards(cfg.data.val_shards, allow_pipe=cfg.data.allow_pipe) if cfg.data.val_shards else []
    except (OSError, ValueError) as err:
        raise ConfigError("data.val_shards", str(err)) from None

    def validate() -> None:
        documents = (doc.tokens for i, doc in enumerate(chain.from_iterable(map(iter_shard_documents, val_urls)))
                     if i % world.world_size == world.rank)
        engine.eval()
        nll, tokens = score_documents(engine, documents, seq_len=t.seq_len, stride=t.seq_len,
                                      batch_size=t.micro_batch_size, eos_id=tokenizer.eos_id, device=world.device,
                                      max_batches=cfg.log.val_batches)
        engine.train()
        loss = nll / tokens
        writer.scalars(counters.step, {"val/loss": loss, "val/ppl": math.exp(loss), "val/tokens": tokens})
        writer.print(f"step {counters.step} | val loss {loss:.4f} | val ppl {math.exp(loss):.2f}")

    stop = StopRequest()
    with stop.held_from_child_processes():  # the first batch starts the loader's worker processes
        batches = iter(loader)
        first = next(batches)
    batches = chain([first], batches)
    tokens_per_step = t.micro_batch_size * t.seq_len * t.grad_accum_steps * world.world_size
    peak_flops = device_peak_flops(world.device)
    interval_start, interval_steps = time.perf_counter(), 0
    while counters.step < t.max_steps:
        lr = engine.get_lr()[0]
        loss, grad_norm = train_step(engine, batches, world, t.grad_accum_steps)
        counters.step += 1
        counters.tokens_seen += tokens_per_step
        interval_steps += 1
        if loss is None or not math.isfinite(grad_norm):
            counters.nonfinite_skipped += 1
            counters.nonfinite_in_a_row += 1
            what = "loss, step skipped" if loss is None else f"gradient norm ({grad_norm})"
            writer.print(f"step {counters.step}: non-finite {what} ({counters.nonfinite_in_a_row} in a row, "
                         f"{counters.nonfinite_skipped} in all)")
            if counters.nonfinite_in_a_row >= t.max_nonfinite_steps:
                latest = checkpoint.latest_tag(ckpt_dir)
                raise NonFiniteLossError(
                    f"{counters.nonfinite_in_a_row} non-finite steps in a row (train.max_nonfinite_steps="
                    f"{t.max_nonfinite_steps}) at step {counters.step}; stopping. The last good checkpoint is "
                    f"{ckpt_dir / latest if latest else 'none (no checkpoint was saved yet)'}")
        else:
            counters.nonfinite_in_a_row = 0

        if counters.nonfinite_in_a_row == 0 and counters.step % cfg.log.every == 0:
            elapsed = time.perf_counter() - interval_start
            tokens_per_s = interval_steps * tokens_per_step / elapsed
            flops_per_s = 3 * flops_per_token * tokens_per_s / world.world_size  # training ≈ 3× forward
            values = {"train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm,
                      "train/tokens_per_s": tokens_per_s, "train/tokens_per_s_per_rank": tokens_per_s / world.world_size,
                      "train/flops_per_s_per_rank": flops_per_s, "train/peak_memory_bytes": peak_memory_bytes(world.device),
                      "train/epoch": loader.epoch, "train/tokens_seen": counters.tokens_seen,
                      "train/nonfinite_skipped": counters.nonfinite_skipped}
            if peak_flops:
                values["train/mfu"] = flops_per_s / peak_flops
            writer.scalars(counters.step, values)
            writer.print(f"step {counters.step}/{t.max_steps} | loss {loss:.4f} | lr {lr:.2e} | grad {grad_norm:.3f} | "
                         f"{tokens_per_s:,.0f} tok/s | {flops_per_s / 1e12:.3f} TFLOP/s/rank"
                         + (f" | MFU {values['train/mfu']:.1%}" if peak_flops else "")
                         + f" | epoch {loader.epoch}")
            interval_start, interval_steps = time.perf_counter(), 0

        if cfg.data.val_shards and counters.step % cfg.log.val_every == 0:
            validate()
        stopping = _stop_requested(stop, world)
        due = counters.step % cfg.checkpoint.every == 0 or counters.step == t.max_steps or stopping
        if due and counters.nonfinite_in_a_row == 0:  # never replace a good checkpoint by a diverging state
            save()
        if counters.step % cfg.log.val_every == 0 or due:  # throughput counts training steps only
            interval_start, interval_steps = time.perf_counter(), 0
        if stopping:
            writer.print(f"stopped by {stop.signal_name or 'a signal on another rank'} at step {counters.step}; "
                         "relaunch the same command to resume")
            break
    writer.close()
