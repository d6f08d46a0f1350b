#!/usr/bin/env python
"""Train a model: parse → config → run. Works under ``deepspeed``, ``torchrun`` and plain ``python``.

    python launch/pretrain.py --config configs/tiny_lm.yaml train.max_steps=50
    torchrun --nproc_per_node 2 launch/pretrain.py --config configs/tiny_lm.yaml
    deepspeed --num_gpus 8 launch/pretrain.py --config configs/aft_lm_1b.yaml
    python launch/pretrain.py --config configs/aft_lm_1b.yaml --dry-run    # sizes, FLOPs, memory; no training
    torchrun --nproc_per_node 2 launch/pretrain.py --config configs/vision/cifar10_soft.yaml    # task: vision

Relaunching the same command on a run directory with checkpoints resumes it.
"""
import argparse
import atexit
import errno
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from pretrain.cli_help import HelpFormatter
from pretrain.exit_codes import CONFIG_ERROR, CORRUPT_SHARD, FAILED, FINISHED, PREEMPTED


def _where_full(err: Exception, run_dir: str) -> str:
    """Where a write ran out of room, when the error does not say (a failed flush names no file)."""
    if not isinstance(err, OSError) or err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) or err.filename:
        return ""
    from pretrain.train.checkpoint import space_left

    return (f", writing under {run_dir} ({space_left(Path(run_dir))}): make room, then relaunch the same command to "
            "resume")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config (see configs/ and pretrain/config.py)")
    parser.add_argument("--dry-run", action="store_true",
                        help="build the model on the meta device and print parameters, FLOPs per token (per image "
                             "for task vision) and memory per rank as one JSON object on the last line; no training")
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks assumed by --dry-run (default: WORLD_SIZE from the launcher, else 1)")
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # set by `deepspeed`
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    args = parser.parse_args(argv)

    from pretrain.config import ConfigError
    from pretrain.tasks.config_checks import load_run_config

    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = load_run_config(args.config, args.overrides)
        if args.dry_run:
            from pretrain.estimate import estimate

            world_size = args.world_size or world_size
            print(json.dumps(estimate(cfg, world_size)))
            return FINISHED
    except ConfigError as err:
        if rank == 0:  # every rank reads the same config: said once
            print(f"config error: {err}", file=sys.stderr)
        return CONFIG_ERROR

    from pretrain.data import ShardError
    from pretrain.distributed.build_locks import StaleLockError
    from pretrain.train import CheckpointError, NonFiniteLossError, RankLostError, train
    from pretrain.train.loop import CorruptShardStop
    from pretrain.train.run_lock import RunDirLockedError

    on_rank = f" on rank {rank}" if world_size > 1 else ""
    try:
        stopped = train(cfg)
    except (ConfigError, StaleLockError, RunDirLockedError) as err:  # every rank finds the same: said once
        if rank == 0:
            print(f"{'config error' if isinstance(err, ConfigError) else 'error'}: {err}", file=sys.stderr)
        return CONFIG_ERROR if isinstance(err, ConfigError) else FAILED
    except CorruptShardStop as err:  # every rank saved and stops; the rank that met the shard names it
        if err.met:
            print(f"error{on_rank}: {err}", file=sys.stderr)
        return CORRUPT_SHARD
    except (NonFiniteLossError, RankLostError, ShardError, CheckpointError, OSError) as err:  # one line, no traceback
        print(f"error{on_rank}: {err}{_where_full(err, cfg.run.dir)}", file=sys.stderr)
        return FAILED
    return PREEMPTED if stopped else FINISHED  # a stop signal: saved, not finished (a scheduler requeues on it)


def leave_exit_code(code: int) -> None:
    """Leave this rank's exit status where launch/torchrun.py reads it after a signal (its agent's own account of
    the ranks is lost then)."""
    directory = os.environ.get("PRETRAIN_EXIT_CODES_DIR")  # launch/torchrun.py's EXIT_CODES_DIR
    if directory and os.path.isdir(directory):
        Path(directory, os.environ.get("RANK", "0")).write_text(str(code))


def leave(code: int):
    """End a process whose run has finished (its files closed, its process group left) without the interpreter's
    teardown, after Python's exit handlers: gloo's threads can still abort that teardown ("terminate called without
    an active exception", exit -6), and did on 2-rank ZeRO-3 runs that had saved and finished."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    code = main()
    leave_exit_code(code)
    trained = "pretrain.train.loop" in sys.modules  # a run was set up (its process group joined and left)
    if trained and code in (FINISHED, PREEMPTED, CORRUPT_SHARD):  # ended as planned, saved; errors exit as usual
        leave(code)
    sys.exit(code)
