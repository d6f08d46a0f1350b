"""Forward and forward+backward time and peak memory of token mixers against sequence length, side by side.

    python tools/bench_attention.py --device cpu --seq-lens 1024,4096,16384,65536 --mixers softmax,linear \\
        --json benchmarks/attention_cpu.json --plot benchmarks/attention_cpu.png --markdown benchmarks/attention_cpu.md

Mixers are op-level kernels on ``[B, T, H, D]`` (the ``OPS`` table: q and k positive, as feature maps leave them)
or any mixer module registered in ``pretrain.attention`` (built with ``build_mixer(name, H*D, H, causal=True)``
and run on ``[B, T, H*D]``); a name in both means the op, ``module:NAME`` the module.

How it measures, per length:
1. each mixer runs once in a fresh subprocess (a probe): one forward+backward, timed, for its peak memory,
   then one forward, timed. A mixer that runs out of memory, fails, or outlasts
   ``--probe-timeout`` is recorded with that status, not a crash; the other mixers go on.
2. the mixers that fit are timed in this process, interleaved (one forward and one forward+backward of each
   mixer per round), after a warm-up; the median over rounds is reported. A mixer whose probe says the rounds
   would take longer than ``--budget-s`` keeps its probe times instead (``repeats`` = 1 in the record; its
   forward+backward then includes first-call costs, which are small at such lengths).
Each record also keeps the machine's 1-minute load average after it was measured, since a shared machine slows
everything that runs on it.

Peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` during one forward+backward, less what was allocated
before the inputs were made. On CPU, the probe's peak resident set size (``ru_maxrss``) less its resident size
before the inputs were made: everything the step touches (inputs, parameters, activations, gradients, and memory
the allocator keeps), measured by the kernel, not by PyTorch. CPU probes run under an address-space limit
(``--cpu-mem-limit-gb``) so that a length that does not fit fails cleanly instead of pushing the machine into swap.
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

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.attention import REGISTRY, build_mixer  # noqa: E402
from pretrain.ops import linear_attention, softmax_attention  # noqa: E402

OPS = {  # op-level kernels, (q, k, v) [B, T, H, D] -> [B, T, H, D]
    "softmax": lambda q, k, v: softmax_attention(q, k, v, causal=True),
    "linear": lambda q, k, v: linear_attention(q, k, v, impl="auto"),
    "linear_chunk": lambda q, k, v: linear_attention(q, k, v, impl="chunk"),
    "linear_naive": lambda q, k, v: linear_attention(q, k, v, impl="naive"),
    "linear_triton": lambda q, k, v: linear_attention(q, k, v, impl="triton"),
    "fla_chunk": lambda q, k, v: fla_chunk_linear_attn(q, k, v),
}


def fla_chunk_linear_attn(q, k, v):
    """The peer: flash-linear-attention's chunked kernel (the ``fla-core`` package), imported only when asked for."""
    from fla.ops.linear_attn import chunk_linear_attn

    return chunk_linear_attn(q, k, v, scale=1.0)[0]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_step(name: str, seq_len: int, args):
    """The forward of one mixer at one length, as a closure over fresh inputs that require grad."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    shape = (args.batch, seq_len, args.heads, args.head_dim)
    if name in OPS:
        q, k = (torch.rand(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
        v = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
        op = OPS[name]
        return lambda: op(q, k, v)
    module_name = name.removeprefix("module:")
    mixer = build_mixer(module_name, args.heads * args.head_dim, args.heads, causal=True).to(device, dtype)
    x = torch.randn(args.batch, seq_len, args.heads * args.head_dim, device=device, dtype=dtype, requires_grad=True)
    return lambda: mixer(x)


def forward_only(step):
    with torch.no_grad():
        step()


def forward_backward(step):
    out = step()
    out.backward(torch.ones_like(out))


def timed(fn, step, device) -> float:
    """Seconds for ``fn(step)``, the device drained before and after."""
    sync(device)
    start = time.perf_counter()
    fn(step)
    sync(device)
    return time.perf_counter() - start


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def probe(args) -> dict:
    """Runs in the fresh subprocess: one forward+backward, timed, for the peak memory; then a timed forward."""
    cuda = torch.device(args.device).type == "cuda"
    if cuda:
        torch.cuda.init()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        before = resident_bytes()
    step = build_step(args.probe, args.probe_len, args)
    fwd_bwd_s = timed(forward_backward, step, args.device)
    if cuda:
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"peak_mem_bytes": peak, "fwd_bwd_s": fwd_bwd_s, "fwd_s": timed(forward_only, step, args.device)}


def run_probe(name: str, seq_len: int, args) -> dict:
    """``probe`` in a fresh process; a failure becomes a status (oom, timeout, error), never an exception."""
    command = [sys.executable, __file__, "--probe", name, "--probe-len", str(seq_len), *common_flags(args)]
    limit = None
    if torch.device(args.device).type == "cpu":
        cap = int(args.cpu_mem_limit_gb * 2**30)
        limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (cap, cap))  # noqa: E731
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.probe_timeout, preexec_fn=limit)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "error": f"probe ran past {args.probe_timeout} s"}
    if done.returncode == 0:
        return {"status": "ok", **json.loads(done.stdout.strip().splitlines()[-1])}
    tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
    out_of_memory = ("out of memory" in done.stderr.lower() or "can't allocate" in done.stderr
                     or "cannot allocate" in done.stderr.lower() or done.returncode == -9)
    return {"status": "oom" if out_of_memory else "error", "error": tail[-300:]}


def common_flags(args) -> list[str]:
    return ["--device", args.device, "--threads", str(args.threads), "--batch", str(args.batch),
            "--heads", str(args.heads), "--head-dim", str(args.head_dim), "--dtype", args.dtype]


def measure_length(seq_len: int, args) -> list[dict]:
    """All mixers at one length: probes first, then interleaved timing rounds of those that fit."""
    base = {"seq_len": seq_len, "batch": args.batch, "heads": args.heads, "head_dim": args.head_dim,
            "dtype": args.dtype, "device": device_name(args.device), "threads": torch.get_num_threads()}
    records, steps, samples = {}, {}, {}
    load = {}
    for name in tqdm(args.mixers, desc=f"T={seq_len} probes", leave=False):
        found = run_probe(name, seq_len, args)
        record = {"mixer": name, **base, "status": found["status"], "fwd_ms": None, "fwd_bwd_ms": None,
                  "peak_mem_bytes": found.get("peak_mem_bytes"), "repeats": 0}
        if found["status"] != "ok":
            record["error"] = found["error"]
        elif found["fwd_bwd_s"] * (args.repeats + 1) > args.budget_s:  # too slow for rounds: keep the probe's
            record.update(fwd_ms=found["fwd_s"] * 1e3, fwd_bwd_ms=found["fwd_bwd_s"] * 1e3, repeats=1)
        else:
            steps[name] = build_step(name, seq_len, args)
            forward_backward(steps[name])  # warm-up
            samples[name] = ([], [])
        records[name] = record
        load[name] = os.getloadavg()[0]
    for _ in tqdm(range(args.repeats), desc=f"T={seq_len} rounds", leave=False):
        for name, step in steps.items():
            samples[name][0].append(timed(forward_only, step, args.device))
            samples[name][1].append(timed(forward_backward, step, args.device))
    for name, (fwd, fwd_bwd) in samples.items():
        records[name].update(fwd_ms=statistics.median(fwd) * 1e3, fwd_bwd_ms=statistics.median(fwd_bwd) * 1e3,
                             repeats=len(fwd))
        load[name] = os.getloadavg()[0]
    for name, record in records.items():
        record["load_avg"] = round(load[name], 2)
    steps.clear()
    return [records[name] for name in args.mixers]


def device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name()
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "cpu")
    return f"{model} ({os.cpu_count()} cores)"


def plot(records: list[dict], path: str, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(12, 4.8))
    for i, mixer in enumerate(dict.fromkeys(r["mixer"] for r in records)):
        ok = [r for r in records if r["mixer"] == mixer and r["status"] == "ok"]
        color = f"C{i}"
        lens = [r["seq_len"] for r in ok]
        ax_time.plot(lens, [r["fwd_bwd_ms"] for r in ok], "o-", color=color, label=f"{mixer} fwd+bwd")
        ax_time.plot(lens, [r["fwd_ms"] for r in ok], "s:", color=color, label=f"{mixer} fwd")
        ax_mem.plot(lens, [r["peak_mem_bytes"] / 2**20 for r in ok], "o-", color=color, label=mixer)
        for r in records:
            if r["mixer"] == mixer and r["status"] != "ok":
                ax_mem.annotate(r["status"], (r["seq_len"], ax_mem.get_ylim()[1]), color=color, fontsize=8)
    for ax, label in ((ax_time, "time (ms)"), (ax_mem, "peak memory (MiB)")):
        ax.set(xscale="log", yscale="log", xlabel="sequence length T", ylabel=label)
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def markdown(records: list[dict], title: str) -> str:
    """One row per (length, mixer), with the ratio to softmax where softmax ran at that length."""
    lines = [f"# {title}", "", "| T | mixer | fwd ms | fwd+bwd ms | peak MiB | softmax fwd+bwd / this | repeats |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    softmax = {r["seq_len"]: r["fwd_bwd_ms"] for r in records if r["mixer"] == "softmax" and r["status"] == "ok"}
    for r in records:
        if r["status"] != "ok":
            lines.append(f"| {r['seq_len']} | {r['mixer']} | {r['status']} | | | | |")
            continue
        ratio = f"{softmax[r['seq_len']] / r['fwd_bwd_ms']:.2f}×" if r["seq_len"] in softmax else ""
        lines.append(f"| {r['seq_len']} | {r['mixer']} | {r['fwd_ms']:.1f} | {r['fwd_bwd_ms']:.1f} | "
                     f"{r['peak_mem_bytes'] / 2**20:.0f} | {ratio} | {r['repeats']} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--seq-lens", default="1024,4096,16384,65536", help="comma-separated sequence lengths")
    p.add_argument("--mixers", default="softmax,linear",
                   help=f"comma-separated: ops {sorted(OPS)}, or registered modules {sorted(REGISTRY)} "
                        "(module:NAME where an op has the same name)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="CPU threads for every mixer (PyTorch's default here: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timing rounds per length (median reported)")
    p.add_argument("--budget-s", type=float, default=60.0,
                   help="a mixer whose probe says its rounds would take longer keeps its single probe timing")
    p.add_argument("--probe-timeout", type=float, default=600.0, help="seconds before a probe counts as too slow")
    p.add_argument("--cpu-mem-limit-gb", type=float, default=16.0, help="address-space limit of CPU probes")
    p.add_argument("--json", help="write the records here (a JSON list)")
    p.add_argument("--plot", help="write the log-log plot of time and memory against length here (PNG)")
    p.add_argument("--markdown", help="write the table here")
    p.add_argument("--probe", help=argparse.SUPPRESS)
    p.add_argument("--probe-len", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.mixers = [m for m in args.mixers.split(",") if m]
    for name in args.mixers:
        if name not in OPS and name.removeprefix("module:") not in REGISTRY:
            p.error(f"unknown mixer {name!r}; ops: {sorted(OPS)}; modules: {sorted(REGISTRY)}")
    args.seq_lens = [int(t) for t in args.seq_lens.split(",") if t]
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but CUDA is not available")
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.probe:
        print(json.dumps(probe(args)))
        return
    records = []
    for seq_len in tqdm(args.seq_lens, desc="lengths"):
        records += measure_length(seq_len, args)
        for r in records[-len(args.mixers):]:
            shown = r["status"] if r["status"] != "ok" else (f"fwd {r['fwd_ms']:.1f} ms  fwd+bwd {r['fwd_bwd_ms']:.1f} ms  "
                                                             f"peak {r['peak_mem_bytes'] / 2**20:.0f} MiB")
            tqdm.write(f"T={seq_len:>6}  {r['mixer']:<14} {shown}")
    title = (f"{records[0]['device']}, B={args.batch} H={args.heads} D={args.head_dim} {args.dtype}, "
             f"{torch.get_num_threads()} threads")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
    if args.plot:
        plot(records, args.plot, title)
    if args.markdown:
        Path(args.markdown).write_text(markdown(records, title))


if __name__ == "__main__":
    main()
