"""Run under torchrun by test_reshard.py: two ranks prepare a checkpoint's universal copy under a process-group
timeout of TIMEOUT seconds while rank 0's conversion is held back for three times as long (as a large model's
conversion outlasts the timeout), then meet in a collective. Writes ``OUT/rank{r}.json``: what the rank saw."""
import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from pretrain.distributed import close_process_group, init_process_group
from pretrain.train import universal


def main(tag_dir: str, out_dir: str, timeout_s: float) -> None:
    init_process_group(timeout_s)
    real_convert = universal.convert

    def slow_convert(*args, **kwargs):
        time.sleep(3 * timeout_s)
        return real_convert(*args, **kwargs)

    universal.convert = slow_convert
    start = time.monotonic()
    seconds = universal.prepare_on_every_rank(Path(tag_dir))
    waited = time.monotonic() - start
    dist.barrier()  # a collective after the wait still works: the group was never held past its timeout
    (Path(out_dir) / f"rank{dist.get_rank()}.json").write_text(json.dumps({"seconds": seconds, "waited": waited}))
    close_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
