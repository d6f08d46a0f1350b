"""What the benchmark tools share: isolated probes, interleaved timing rounds, peak memory, and their reports.

How a tool measures one size (``measure_side_by_side``):
1. each configuration runs once in a fresh subprocess (a probe, ``run_probe`` → ``probe``): one forward+backward,
   timed, for its peak memory, then one forward, timed. One that runs out of memory, fails, or outlasts the probe
   timeout is recorded with that status, not a crash; the others go on.
2. the configurations that fit are timed in the calling process, interleaved (one forward and one forward+backward
   of each per round), after a warm-up; the median over rounds is reported. One whose probe says the rounds would
   take longer than ``budget_s`` keeps its probe times instead (``repeats`` = 1; its forward+backward then includes
   first-call costs).
Data-path tools (bench_data, bench_images) use ``units_per_second`` instead: a stream's rate, not a step's time.
Each record also keeps the machine's 1-minute load average after it was measured, since a shared machine slows
everything that runs on it.

Peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` during one forward+backward, less what was allocated
before the inputs were made. On CPU, the probe's peak resident set size (``VmHWM``: ``pretrain/resident.py`` says
why not ``ru_maxrss``) less its resident size
before the inputs were made: everything the step touches (inputs, parameters, activations, gradients, and memory
the allocator keeps), measured by the kernel, not by PyTorch. CPU probes run under an address-space limit so that
a size that does not fit fails cleanly instead of pushing the machine into swap.
"""
import json
import os
import resource
import shlex
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from tqdm import tqdm

from pretrain.resident import peak_resident_bytes, resident_bytes

CHECKOUT = Path(__file__).resolve().parent.parent
Step = Callable[[], torch.Tensor]  # one forward over fixed inputs; its output is backpropagated with ones


def forward_only(step: Step) -> None:
    with torch.no_grad():
        step()


def forward_backward(step: Step) -> None:
    out = step()
    out.backward(torch.ones_like(out))


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, step: Step, device) -> float:
    """Seconds for ``fn(step)``, the device drained before and after."""
    sync(device)
    start = time.perf_counter()
    fn(step)
    sync(device)
    return time.perf_counter() - start


def run_logged(command: list[str], log: Path) -> float:
    """Run ``command`` (in the checkout) with its output added to ``log``, after those of earlier tries (a run
    stopped and started again keeps both); its wall time in seconds. A failure ends the tool naming the command and
    the log: a sweep's training or scoring step."""
    start = time.perf_counter()
    with log.open("a") as out:
        out.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(command)}\n")
        out.flush()
        code = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, cwd=CHECKOUT)
    if code != 0:
        raise SystemExit(f"exit {code}: {' '.join(command)}\n(see {log})")
    return time.perf_counter() - start


def probe(build_step: Callable[[], Step], device) -> dict:
    """Runs in the fresh subprocess: one forward+backward, timed, for the peak memory; then a timed forward."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.init()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        before = resident_bytes()
    step = build_step()
    fwd_bwd_s = timed(forward_backward, step, device)
    if cuda:
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = peak_resident_bytes() - before
    return {"peak_mem_bytes": peak, "fwd_bwd_s": fwd_bwd_s, "fwd_s": timed(forward_only, step, device)}


def run_probe(command: list[str], device, *, cpu_mem_limit_gb: float, timeout_s: float) -> dict:
    """``command`` (a tool's own probe mode, printing ``probe``'s JSON last) in a fresh process; a failure becomes
    a status (oom, timeout, error), never an exception."""
    limit = None
    if torch.device(device).type == "cpu":
        cap = int(cpu_mem_limit_gb * 2**30)
        limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, preexec_fn=limit)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "error": f"probe ran past {timeout_s} s"}
    if done.returncode == 0:
        return {"status": "ok", **json.loads(done.stdout.strip().splitlines()[-1])}
    tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
    out_of_memory = ("out of memory" in done.stderr.lower() or "can't allocate" in done.stderr
                     or "cannot allocate" in done.stderr.lower() or done.returncode == -9)
    return {"status": "oom" if out_of_memory else "error", "error": tail[-300:]}


def measure_side_by_side(names: list[str], *, probe_one: Callable[[str], dict], build_step: Callable[[str], Step],
                         device, repeats: int, budget_s: float, label: str) -> dict[str, dict]:
    """Every configuration at one size: probes first (``probe_one(name)`` → ``run_probe``'s dict, or a status of
    the tool's own, e.g. skipped), then interleaved timing rounds of those that fit. Returns, per name, ``status``,
    ``fwd_ms``, ``fwd_bwd_ms``, ``peak_mem_bytes``, ``repeats``, ``load_avg`` (and ``error`` when not ok)."""
    records, steps, samples, load = {}, {}, {}, {}
    for name in tqdm(names, desc=f"{label} probes", leave=False):
        found = probe_one(name)
        record = {"status": found["status"], "fwd_ms": None, "fwd_bwd_ms": None,
                  "peak_mem_bytes": found.get("peak_mem_bytes"), "repeats": 0}
        if found["status"] != "ok":
            record["error"] = found["error"]
        elif found["fwd_bwd_s"] * (repeats + 1) > budget_s:  # too slow for rounds: keep the probe's
            record.update(fwd_ms=found["fwd_s"] * 1e3, fwd_bwd_ms=found["fwd_bwd_s"] * 1e3, repeats=1)
        else:
            steps[name] = build_step(name)
            forward_backward(steps[name])  # warm-up
            samples[name] = ([], [])
        records[name] = record
        load[name] = os.getloadavg()[0]
    for _ in tqdm(range(repeats), desc=f"{label} rounds", leave=False):
        for name, step in steps.items():
            samples[name][0].append(timed(forward_only, step, device))
            samples[name][1].append(timed(forward_backward, step, device))
    for name, (fwd, fwd_bwd) in samples.items():
        records[name].update(fwd_ms=statistics.median(fwd) * 1e3, fwd_bwd_ms=statistics.median(fwd_bwd) * 1e3,
                             repeats=len(fwd))
        load[name] = os.getloadavg()[0]
    for name, record in records.items():
        record["load_avg"] = round(load[name], 2)
    steps.clear()
    return records


def device_name(device) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name()
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "cpu")
    return f"{model} ({os.cpu_count()} cores)"


def summary(record: dict) -> str:
    """One line for the progress log: the status, or the times and peak memory."""
    if record["status"] != "ok":
        return record["status"]
    return (f"fwd {record['fwd_ms']:.1f} ms  fwd+bwd {record['fwd_bwd_ms']:.1f} ms  "
            f"peak {record['peak_mem_bytes'] / 2**20:.0f} MiB")


def plot(records: list[dict], path: str, title: str, *, x: str, series: str, x_label: str) -> None:
    """Log-log time (forward and forward+backward) and peak memory against ``record[x]``, one colour per
    ``record[series]``; a configuration that did not fit is marked with its status on the memory panel."""
    plt = pyplot()
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(12, 4.8))
    for i, name in enumerate(dict.fromkeys(r[series] for r in records)):
        ok = [r for r in records if r[series] == name and r["status"] == "ok"]
        color = f"C{i}"
        xs = [r[x] for r in ok]
        ax_time.plot(xs, [r["fwd_bwd_ms"] for r in ok], "o-", color=color, label=f"{name} fwd+bwd")
        ax_time.plot(xs, [r["fwd_ms"] for r in ok], "s:", color=color, label=f"{name} fwd")
        ax_mem.plot(xs, [r["peak_mem_bytes"] / 2**20 for r in ok], "o-", color=color, label=name)
        for r in records:
            if r[series] == name and r["status"] != "ok":
                ax_mem.annotate(r["status"], (r[x], ax_mem.get_ylim()[1]), color=color, fontsize=8)
    for ax, label in ((ax_time, "time (ms)"), (ax_mem, "peak memory (MiB)")):
        ax.set(xscale="log", yscale="log", xlabel=x_label, ylabel=label)
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)


def pyplot():
    """matplotlib's pyplot on the Agg backend: figures go to files (a cluster node has no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path) -> None:
    """``fig`` laid out and written to ``path``, its directory made."""
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def markdown(records: list[dict], title: str, *, x: str, series: str, x_header: str, baseline: str) -> str:
    """One row per (size, configuration), with the baseline's forward+backward time over this one's where the
    baseline ran at that size."""
    lines = [f"# {title}", "",
             f"| {x_header} | {series} | fwd ms | fwd+bwd ms | peak MiB | {baseline} fwd+bwd / this | repeats |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    base = {r[x]: r["fwd_bwd_ms"] for r in records if r[series] == baseline and r["status"] == "ok"}
    for r in records:
        if r["status"] != "ok":
            lines.append(f"| {r[x]} | {r[series]} | {r['status']} | | | | |")
            continue
        ratio = f"{base[r[x]] / r['fwd_bwd_ms']:.2f}×" if r[x] in base else ""
        lines.append(f"| {r[x]} | {r[series]} | {r['fwd_ms']:.1f} | {r['fwd_bwd_ms']:.1f} | "
                     f"{r['peak_mem_bytes'] / 2**20:.0f} | {ratio} | {r['repeats']} |")
    return "\n".join(lines) + "\n"


def write_reports(records: list[dict], args, title: str, **layout) -> None:
    """``--json``, ``--plot`` and ``--markdown`` where asked for; ``layout`` as ``plot`` and ``markdown`` take it."""
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
    if args.plot:
        plot(records, args.plot, title, x=layout["x"], series=layout["series"], x_label=layout["x_label"])
    if args.markdown:
        Path(args.markdown).write_text(markdown(records, title, x=layout["x"], series=layout["series"],
                                                x_header=layout["x_header"], baseline=layout["baseline"]))


def add_measurement_flags(p, *, budget_s: float, probe_timeout_s: float, cpu_mem_limit_gb: float) -> None:
    """The flags every benchmark takes: device, threads, rounds, limits, and where the reports go."""
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="CPU threads for every configuration (PyTorch's default here: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timing rounds per size (median reported)")
    p.add_argument("--budget-s", type=float, default=budget_s,
                   help="a configuration whose probe says its rounds would take longer keeps its single probe timing")
    p.add_argument("--probe-timeout", type=float, default=probe_timeout_s,
                   help="seconds before a probe counts as too slow")
    p.add_argument("--cpu-mem-limit-gb", type=float, default=cpu_mem_limit_gb,
                   help="address-space limit of CPU probes")
    p.add_argument("--json", help="write the records here (a JSON list)")
    p.add_argument("--plot", help="write the log-log plot of time and memory against size here (PNG)")
    p.add_argument("--markdown", help="write the table here")


def units_per_second(items: Iterable, limit: int, desc: str, count: Callable, unit: str) -> float:
    """Rate of a stream over ``limit`` units (``count(item)`` each), timed from the first item on: start-up, such as
    starting worker processes, is not throughput, so the first item is neither timed nor counted."""
    seen, start = 0, None
    with tqdm(total=limit, unit=unit, unit_scale=True, desc=desc) as bar:
        for item in items:
            if start is None:
                start = time.perf_counter()
                continue
            n = count(item)
            seen += n
            bar.update(n)
            if seen >= limit:
                break
    return seen / (time.perf_counter() - start)
