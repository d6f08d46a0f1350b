#!/usr/bin/env python
"""torchrun, with the project's exit codes and no failure report: the same arguments, the same elastic agent (run
here, in this process), and when the ranks end, this command exits as they did.

    python launch/torchrun.py --nproc_per_node 2 launch/pretrain.py --config configs/tiny_lm.yaml
    pretrain-torchrun --nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST:29400 --nproc_per_node 8 \
        launch/pretrain.py --config configs/aft_lm_1b.yaml

Plain ``torchrun`` exits 1 whenever a rank exits non-zero, and prints a 35-42-line ``ChildFailedError`` report
(a 30-line ``SignalException`` traceback when it is stopped by a signal) under the rank's own one line. Here the
ranks' own lines stand alone, and the exit status is theirs (``pretrain.exit_codes``: 2 a config error, 65 a
corrupt shard, 75 stopped and saved, 1 anything else); a rank killed by a signal is named in one line and the exit
status is 128 + the signal's number, as a shell gives it. Each node's command reports its own ranks.
"""
import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

EXIT_CODES_DIR = "PRETRAIN_EXIT_CODES_DIR"  # where launch/pretrain.py's ranks leave their exit status, one file each


def left_codes(directory: str) -> dict[int, int]:
    """The exit status each rank of launch/pretrain.py left in ``directory`` (by global rank)."""
    return {int(path.name): int(path.read_text()) for path in Path(directory).iterdir() if path.name.isdigit()}


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    for name in list(logging.Logger.manager.loggerDict):  # the agent's reports of the ranks' ends: they say it
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="pretrain-exit-codes-") as codes_dir:
        os.environ[EXIT_CODES_DIR] = codes_dir  # the ranks inherit it
        try:
            run(args)
            return 0
        except ChildFailedError as err:  # the first rank to fail, and its status (the others then stopped)
            rank, failure = err.get_first_failure()
            if failure.exitcode >= 0:
                return failure.exitcode
            print(f"rank {rank} (pid {failure.pid}) was killed by {failure.signal_name()}", file=sys.stderr)
            return 128 - failure.exitcode
        except SignalException as err:  # the agent passed the signal on to every rank (a stop: they saved first)
            codes = set(left_codes(codes_dir).values())
            return codes.pop() if len(codes) == 1 else 128 + signal.Signals(err.sigval).value


if __name__ == "__main__":
    sys.exit(main())
