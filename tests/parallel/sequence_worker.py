"""Run under torchrun by the sequence-parallel tests: every case's mixer (or model) on this rank's slice, fp64.

Writes ``OUT/rank{r}.pt``: per mixer case, the slice's output, the gradient of its input slice and every
parameter's gradient (this rank's share: the test sums them over ranks); under ``model``, the same for an LM of every
mixer. The cases and their single-process reference are in ``sequence_cases.py``.
"""
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pretrain.distributed import close_process_group, init_process_group
from pretrain.parallel import SequenceShard

from sequence_cases import CASES, run_case, run_model


def main(out_dir: str, names: list[str]) -> None:
    # the trainer's own join (Ulysses talks through deepspeed.comm): it finds DeepSpeed's CPU comm op where `make
    # setup` built it; deepspeed.init_distributed alone looked in torch's default place and built it again (100 s)
    init_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    shard = SequenceShard(group=dist.group.WORLD, rank=rank, size=size)
    results = {name: run_case(CASES[name], shard) for name in names}
    results["model"] = run_model(shard)
    results["model_sliced"] = run_model(shard, mini_sequence=5, checkpointing=True)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    close_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], sys.argv[2].split(","))
