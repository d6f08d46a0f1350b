"""Ranks with different amounts of evaluation data stay in lockstep until every one is done (2 real gloo ranks)."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pretrain.distributed.lockstep import until_every_rank_is_done


def test_without_a_process_group_it_is_the_batches():
    assert list(until_every_rank_is_done(iter("abc"), torch.device("cpu"))) == ["a", "b", "c"]
    assert list(until_every_rank_is_done([], torch.device("cpu"))) == []


def _rank(rank: int, port: int, counts: list[int], out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=len(counts))
    try:
        seen = list(until_every_rank_is_done(range(counts[rank]), torch.device("cpu")))
        out.put((rank, seen))
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_a_rank_out_of_batches_gets_none_until_the_others_are_done():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    out = context.Queue()
    counts = [3, 1]
    processes = [context.Process(target=_rank, args=(rank, port, counts, out)) for rank in range(2)]
    for process in processes:
        process.start()
    results = dict(out.get(timeout=120) for _ in processes)
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert results == {0: [0, 1, 2], 1: [0, None, None]}
