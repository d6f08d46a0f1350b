"""How long a context fits, and how fast it trains, with each row on 1 rank or split over N (sequence parallelism).

    python tools/bench_sequence_parallel.py --sizes 1,2 --seq-lens 16384,32768,65536,131072,262144 \\
        --budget-gb 2 --json benchmarks/sequence_parallel_cpu.json --markdown benchmarks/sequence_parallel_cpu.md
    python tools/bench_sequence_parallel.py --sizes 1 --seq-lens 8192,16384,32768 --budget-gb 4 \\
        --variant today= --variant sliced=model.mini_sequence=4096,deepspeed.activation_checkpointing=true

``--variant NAME=KEY=VALUE,...`` (repeatable) compares settings side by side: each is a list of config overrides
(``model.mini_sequence``, ``deepspeed.activation_checkpointing``, mixer options), run at every N and length in
turn. Beside each measured peak stands the dry run's estimate for the same setting (``pretrain.estimate``:
activations plus the weights and gradients, no optimizer since none steps here), so the estimate is checked
against the measurement. ``--speed-rounds R`` also steps every variant in turn in one process at the first length,
R rounds, and reports each one's median tokens/s against the first's (``--no-memory``: that alone), since
separate processes minutes apart on a shared machine compare nothing.

For every N and length, torchrun starts N gloo ranks (one thread each) that train a small LM — one forward and
backward of the loss per step, no optimizer — on one row of that length, split into N slices. Each rank reports
its peak resident memory above what it held before building the model (the kernel's ``VmHWM``), the median
step time over ``--steps`` timed steps after one warm-up step, and the bytes its sequence-parallel collectives
moved per layer and step (counted at the ``torch.distributed`` calls: an all-gather's whole output, an
all-reduce's tensor). A length whose peak passes ``--budget-gb`` on any rank ends that N's series: the longest
length under the budget is N's longest trainable context. The machine's load is recorded with every figure.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pretrain.cli_help import HelpFormatter


def model_overrides(args, size: int, seq_len: int, variant: str) -> list[str]:
    return ["data.tokenizer=unused", "data.train_shards=unused", f"model.vocab_size={args.vocab}",
            f"model.dim={args.dim}",
            f"model.n_layers={args.layers}", f"model.n_heads={args.heads}", f"model.mixer={args.mixer}",
            f"train.seq_len={seq_len}", f"parallel.sequence_parallel={size}", "train.micro_batch_size=1",
            *[o for o in variant.split(",") if o]]


def parse_variant(text: str) -> tuple[str, str]:
    """``NAME=KEY=VALUE,KEY=VALUE`` (or ``NAME=`` for the defaults) → (name, overrides)."""
    name, sep, overrides = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--variant wants NAME=KEY=VALUE,... (or NAME=); got {text!r}")
    return name, overrides


def worker(args) -> None:
    """One rank: build, split, time; rank 0 prints the record as JSON."""
    import torch
    import torch.distributed as dist

    from pretrain.distributed import (
        apply_activation_checkpointing,
        apply_sequence_parallel,
        close_process_group,
        init_process_group,
        split_sequences,
    )
    from pretrain.parallel import shard_rows
    from pretrain.resident import peak_resident_bytes, resident_bytes
    from pretrain.tasks import build_model
    from pretrain.tasks.config_checks import load_run_config

    moved = {"bytes": 0}
    for name in ("all_gather_single", "all_reduce"):  # count what the collectives carry (the real calls run)
        real = getattr(dist, name)

        def counted(*call, _real=real, _name=name, **kwargs):
            moved["bytes"] += call[0].numel() * call[0].element_size()
            return _real(*call, **kwargs)

        setattr(dist, name, counted)

    torch.set_num_threads(1)
    cfg = load_run_config(None, model_overrides(args, args.size, args.seq_len, args.overrides))
    world = split_sequences(init_process_group(), args.size)
    before = resident_bytes()
    torch.manual_seed(0)
    model = build_model(cfg)
    if cfg.deepspeed.activation_checkpointing:
        apply_activation_checkpointing(model)
    apply_sequence_parallel(model, world.sequence, args.seq_len)
    ids = torch.randint(0, args.vocab, (1, args.seq_len + 1))
    positions = (torch.arange(args.seq_len) % args.doc_len)[None]  # documents straddle the slice boundaries
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "position_ids": positions}
    if world.sequence is not None:
        batch = shard_rows(batch, world.sequence)

    def step() -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model(batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"]).backward()
        return time.perf_counter() - start

    step()
    moved["bytes"] = 0
    times = [step() for _ in range(args.steps)]
    comm = moved["bytes"]
    peak = torch.tensor([peak_resident_bytes() - before], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    step_s = statistics.median(times)
    if world.rank == 0:
        print(json.dumps({"ranks": args.size, "seq_len": args.seq_len, "tokens_per_rank": args.seq_len // args.size,
                          "peak_mem_bytes": int(peak.item()), "step_s": step_s, "tokens_per_s": args.seq_len / step_s,
                          "comm_bytes_per_layer": comm // (args.steps * args.layers), "load": os.getloadavg()[0]}))
    close_process_group()


def speed_worker(args) -> None:
    """Every variant's model in this one process (same weights, one row of ``--seq-len`` on one rank), stepped in
    turn for ``--speed-rounds`` rounds after a warm-up each: a shared machine's load then slows them alike."""
    import torch

    from pretrain.distributed import apply_activation_checkpointing
    from pretrain.tasks import build_model
    from pretrain.tasks.config_checks import load_run_config

    torch.set_num_threads(1)
    models = {}
    for name, overrides in args.variants:
        cfg = load_run_config(None, model_overrides(args, 1, args.seq_len, overrides))
        torch.manual_seed(0)
        models[name] = build_model(cfg)
        if cfg.deepspeed.activation_checkpointing:
            apply_activation_checkpointing(models[name])
    ids = torch.randint(0, args.vocab, (1, args.seq_len + 1))
    positions = (torch.arange(args.seq_len) % args.doc_len)[None]

    def step(model) -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model(ids[:, :-1], position_ids=positions, labels=ids[:, 1:]).backward()
        return time.perf_counter() - start

    for model in models.values():
        step(model)
    times = {name: [] for name in models}
    for _ in range(args.speed_rounds):
        for name, model in models.items():
            times[name].append(step(model))
    print(json.dumps({name: statistics.median(t) for name, t in times.items()}))


def compare_speed(args, seq_len: int) -> list[dict]:
    """Tokens/s of every variant at one length on one rank, interleaved in one process (``speed_worker``)."""
    command = [sys.executable, __file__, "--speed-worker", "--seq-len", str(seq_len),
               "--speed-rounds", str(args.speed_rounds), *shared_flags(args),
               *[f"--variant={name}={overrides}" for name, overrides in args.variants]]
    result = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"the speed comparison failed ({result.returncode}): {result.stderr[-600:]}")
    medians, load = json.loads(lines[-1]), os.getloadavg()[0]
    first = next(iter(medians.values()))
    return [{"variant": name, "seq_len": seq_len, "step_s": s, "tokens_per_s": seq_len / s,
             "relative": first / s, "rounds": args.speed_rounds, "load": load} for name, s in medians.items()]


def speed_markdown(rows: list[dict]) -> str:
    lines = [f"Tokens/s on one rank at {rows[0]['seq_len']:,} tokens, the variants stepped in turn in one process "
             f"(median of {rows[0]['rounds']} rounds; load {rows[0]['load']:.2f} after):", "",
             "| variant | step (fwd+bwd) | tokens/s | against the first |", "|---|---:|---:|---:|"]
    lines += [f"| {r['variant']} | {r['step_s']:.2f} s | {r['tokens_per_s']:,.0f} | {r['relative']:.2f}× |"
              for r in rows]
    return "\n".join(lines) + "\n"


def measure(args, size: int, seq_len: int, variant: tuple[str, str]) -> dict:
    """One (N, length, variant) in fresh processes under an address-space limit; a failure is a record with its
    status. Every record carries the dry run's estimate of the same peak."""
    name, overrides = variant
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={size}", __file__,
               "--worker", "--size", str(size), "--seq-len", str(seq_len), f"--overrides={overrides}",
               *shared_flags(args)]
    base = {"variant": name, "overrides": overrides, "ranks": size, "seq_len": seq_len,
            "estimate_bytes": estimated_peak(args, size, seq_len, overrides)}
    limit = int((args.budget_gb * 2 + 8) * 2**30)  # a net under the budget check, so a runaway size fails cleanly

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, preexec_fn=cap,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
    except subprocess.TimeoutExpired:
        return {**base, "status": f"timeout ({args.timeout} s)"}
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        return {**base, "status": f"failed ({result.returncode})", "stderr": result.stderr[-600:]}
    record = {**base, **json.loads(lines[-1])}
    record["status"] = "ok" if record["peak_mem_bytes"] <= args.budget_gb * 2**30 else "over budget"
    return record


def estimated_peak(args, size: int, seq_len: int, overrides: str) -> int:
    """The dry run's memory of one rank for this setting, less the optimizer states (nothing steps here)."""
    from pretrain.estimate import estimate
    from pretrain.tasks.config_checks import load_run_config

    result = estimate(load_run_config(None, model_overrides(args, size, seq_len, overrides)), size)
    parts = result["memory_breakdown_bytes"]
    return parts["weights"] + parts["gradients"] + parts["activations"]


def shared_flags(args) -> list[str]:
    return ["--mixer", args.mixer, "--dim", str(args.dim), "--layers", str(args.layers), "--heads", str(args.heads),
            "--vocab", str(args.vocab), "--doc-len", str(args.doc_len), "--steps", str(args.steps)]


def markdown(records: list[dict], args) -> str:
    rows = ["| variant | N | seq_len | tokens/rank | peak memory/rank | per token | dry-run estimate | "
            "step (fwd+bwd) | tokens/s | sent+received/layer | load | status |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in records:
        estimate = r["estimate_bytes"]
        if "step_s" in r:
            peak, off = r["peak_mem_bytes"], estimate / r["peak_mem_bytes"] - 1
            rows.append(f"| {r['variant']} | {r['ranks']} | {r['seq_len']:,} | {r['tokens_per_rank']:,} | "
                        f"{peak / 2**30:.2f} GiB | {peak / r['tokens_per_rank'] / 1e3:.1f} KB | "
                        f"{estimate / 2**30:.2f} GiB ({off:+.0%}) | {r['step_s']:.2f} s | {r['tokens_per_s']:,.0f} | "
                        f"{r['comm_bytes_per_layer'] / 2**10:,.1f} KiB | {r['load']:.2f} | {r['status']} |")
        else:
            rows.append(f"| {r['variant']} | {r['ranks']} | {r['seq_len']:,} | | | | {estimate / 2**30:.2f} GiB "
                        f"| | | | | {r['status']} |")
    longest = {}
    for r in records:
        if r["status"] == "ok":
            key = (r["variant"], r["ranks"])
            longest[key] = max(longest.get(key, 0), r["seq_len"])
    summary = ", ".join(f"{name} N={n}: {t:,} tokens" for (name, n), t in longest.items())
    variants = "".join(f"\n- {r['variant']}: " + (f"`{r['overrides']}`" if r["overrides"] else "no overrides") for r in
                       {r["variant"]: r for r in records}.values())
    return (f"Longest trainable row within {args.budget_gb} GiB per rank: {summary}.\n\nVariants:{variants}\n\n"
            + "\n".join(rows) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--sizes", default="1,2", help="sequence-parallel sizes N to compare")
    parser.add_argument("--seq-lens", default="16384,32768,65536,131072,262144", help="row lengths, ascending")
    parser.add_argument("--budget-gb", type=float, default=2.0, help="peak resident memory per rank allowed")
    parser.add_argument("--mixer", default="linear")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--doc-len", type=int, default=10000, help="tokens per document in the row")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per (N, length)")
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--variant", action="append", type=parse_variant, dest="variants",
                        help="NAME=KEY=VALUE,... config overrides compared side by side (repeatable; default: one "
                             "variant, the defaults)")
    parser.add_argument("--speed-rounds", type=int, default=0,
                        help="also time the variants interleaved in one process at the first length, this many "
                             "rounds (0: not)")
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                        help="the peak-memory series (--no-memory: the speed comparison alone)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--speed-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--overrides", default="", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.speed_worker:
        speed_worker(args)
        return
    args.variants = args.variants or [("defaults", "")]
    records, speed = [], []
    for size in (int(s) for s in args.sizes.split(",")) if args.memory else ():
        for variant in args.variants:
            for seq_len in (int(t) for t in args.seq_lens.split(",")):
                record = measure(args, size, seq_len, variant)
                records.append(record)
                print(json.dumps({k: v for k, v in record.items() if k != "stderr"}), file=sys.stderr, flush=True)
                if record["status"] != "ok":
                    break
    if args.speed_rounds:
        speed = compare_speed(args, int(args.seq_lens.split(",")[0]))
    if args.json:
        Path(args.json).write_text(json.dumps({"memory": records, "speed": speed} if speed else records, indent=1)
                                   + "\n")
    table = (markdown(records, args) if records else "") + ("\n" + speed_markdown(speed) if speed else "")
    if args.markdown:
        Path(args.markdown).write_text(table)
    print(table)


if __name__ == "__main__":
    main()
