"""One training step on a real DeepSpeed engine (one gloo rank, in a spawned process so the test process keeps no
process group): one collective per step whatever the accumulation, a non-finite first loss skips the update, the
stop flag rides along, and the returned loss is the micro-batches' mean."""
import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.dist


class SquaredOutput:
    """The smallest task the step needs: ``loss`` sums the model's squared outputs over a batch of rows."""

    def loss(self, model, batch, device):
        return model(batch.to(device)).square().sum(), batch.shape[0]


def counting(collective, calls: list):
    """``collective``, noting each call in ``calls``."""
    def counted(*args, **kwargs):
        calls.append(args)
        return collective(*args, **kwargs)

    return counted


def _check_steps(out) -> None:
    import torch.distributed as dist

    from pretrain.config import load_config
    from pretrain.distributed import build_engine, close_process_group, init_process_group
    from pretrain.train.loop import train_step
    from pretrain.train.preemption import StopRequest

    world = init_process_group()
    try:
        results = {}
        for accum in (1, 3):
            cfg = load_config(None, ["data.tokenizer=x", "data.train_shards=x", f"train.grad_accum_steps={accum}",
                                     "train.micro_batch_size=2", "schedule.warmup_steps=0", "optim.weight_decay=0"])
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 3)
            engine = build_engine(cfg, model, 1, lambda step: 1e-2)
            rows = [torch.randn(2, 4) for _ in range(accum)]
            expected = sum(model(r).square().sum() / 2 for r in rows).item() / accum

            calls, real = [], dist.all_reduce
            dist.all_reduce = counting(real, calls)
            try:
                stop = StopRequest()
                step = train_step(engine, SquaredOutput(), iter(rows), world, accum, stop)
                collectives = len(calls)
                before = model.weight.detach().clone()
                poisoned = iter([torch.full((2, 4), float("inf"))] + [torch.randn(2, 4) for _ in range(accum)])
                stop.requested = True
                skipped = train_step(engine, SquaredOutput(), poisoned, world, accum, stop)
                left = len(list(poisoned))
            finally:
                dist.all_reduce = real
            results[accum] = dict(loss=step.loss.item(), expected=expected, grad_norm=step.grad_norm,
                                  stop=step.stop, collectives=collectives, skipped=skipped.loss is None,
                                  skipped_norm=skipped.grad_norm, skipped_stop=skipped.stop, left=left,
                                  unchanged=bool(torch.equal(before, model.weight.detach())))
        out.put(results)
    finally:
        close_process_group()


def test_one_collective_per_step_and_a_nonfinite_first_loss_skips_the_update():
    context = mp.get_context("spawn")
    out = context.Queue()
    process = context.Process(target=_check_steps, args=(out,))
    process.start()
    results = out.get(timeout=300)
    process.join(timeout=60)
    assert process.exitcode == 0
    one, three = results[1], results[3]
    assert one["collectives"] == three["collectives"]  # accumulating 3 micro-batches adds no collective
    for accum, r in results.items():
        assert r["loss"] == pytest.approx(r["expected"], rel=1e-6), accum
        assert r["grad_norm"] is not None and r["grad_norm"] > 0 and not r["stop"]
        assert r["skipped"] and r["skipped_norm"] is None and r["skipped_stop"]  # the stop flag came along
        assert r["unchanged"]  # no update from the skipped step
        assert r["left"] == 1  # the skipped step drew all its accum micro-batches, no more


def _one_rank_poisoned(rank: int, port: int, out) -> None:
    """Rank 1 alone sees a non-finite loss and alone got a stop signal; rank 0 must skip and stop with it."""
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from pretrain.config import load_config
    from pretrain.distributed import build_engine, close_process_group, init_process_group
    from pretrain.train.loop import train_step
    from pretrain.train.preemption import StopRequest

    world = init_process_group()
    try:
        cfg = load_config(None, ["data.tokenizer=x", "data.train_shards=x", "train.micro_batch_size=2",
                                 "schedule.warmup_steps=0", "optim.weight_decay=0"])
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        engine = build_engine(cfg, model, 2, lambda step: 1e-2)
        before = model.weight.detach().clone()
        stop = StopRequest()
        stop.requested = rank == 1
        batch = torch.full((2, 4), float("nan")) if rank == 1 else torch.randn(2, 4)
        step = train_step(engine, SquaredOutput(), iter([batch]), world, 1, stop)
        out.put((rank, step.loss is None, step.stop, bool(torch.equal(before, model.weight.detach()))))
    finally:
        close_process_group()


def on_two_ranks(target, *args) -> list:
    """``target(rank, port, *args, out)`` in two spawned gloo ranks; what they put in ``out``, sorted."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    out = context.Queue()
    processes = [context.Process(target=target, args=(rank, port, *args, out)) for rank in range(2)]
    for process in processes:
        process.start()
    results = sorted(out.get(timeout=300) for _ in processes)
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    return results


def test_any_ranks_nonfinite_loss_or_stop_signal_holds_for_every_rank():
    results = on_two_ranks(_one_rank_poisoned)
    assert results == [(0, True, True, True), (1, True, True, True)]  # both skipped, both stop, neither updated


class Unreadable:
    """A rank's stream whose next batch is in a corrupt shard."""

    def __next__(self):
        from pretrain.data import ShardError

        raise ShardError("shard s.tar is truncated")


def _one_rank_meets_a_corrupt_shard(rank: int, port: int, stage: int, out) -> None:
    """Rank 1 alone cannot read its next batch; under ZeRO-3 its forward (on its last batch) is a collective that
    rank 0's forward waits on. Both must skip the step, untrained, in the step's one collective."""
    import os

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from pretrain.config import load_config
    from pretrain.distributed import build_engine, close_process_group, init_process_group
    from pretrain.train.loop import train_step
    from pretrain.train.preemption import StopRequest

    world = init_process_group()
    try:
        cfg = load_config(None, ["data.tokenizer=x", "data.train_shards=x", "train.micro_batch_size=2",
                                 "schedule.warmup_steps=0", "optim.weight_decay=0", f"deepspeed.zero_stage={stage}"])
        torch.manual_seed(0)
        engine = build_engine(cfg, torch.nn.Linear(4, 3), 2, lambda step: 1e-2)
        before = [p.detach().clone() for p in engine.module.parameters()]
        batches = Unreadable() if rank == 1 else iter([torch.randn(2, 4)])
        calls, real = [], dist.all_reduce
        dist.all_reduce = counting(real, calls)
        try:
            step = train_step(engine, SquaredOutput(), batches, world, 1, StopRequest(), fallback=torch.randn(2, 4))
        finally:
            dist.all_reduce = real
        unchanged = all(torch.equal(a, b.detach()) for a, b in zip(before, engine.module.parameters()))
        out.put((rank, step.loss is None, step.unreadable, step.error is not None and "s.tar" in str(step.error),
                 unchanged, len(calls)))
    finally:
        close_process_group()


def test_a_corrupt_shard_met_by_one_rank_skips_the_step_on_every_rank():
    results = on_two_ranks(_one_rank_meets_a_corrupt_shard, 3)
    # both skipped, both know, only rank 1 names the shard, neither trained, one all-reduce each
    assert results == [(0, True, True, False, True, 1), (1, True, True, True, True, 1)]
