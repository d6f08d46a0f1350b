#!/usr/bin/env python
"""Where a training step's time goes: a real run's steps under ``torch.profiler``, by category.

    python tools/profile_step.py --config configs/tiny_lm.yaml --steps 5
    torchrun --standalone --nproc_per_node 1 tools/profile_step.py --config configs/lm/linear_1b.yaml \\
        --steps 5 data.tokenizer=... data.train_shards=...

The steps are the trainer's own: the config loaded as launch/pretrain.py loads it, and the task, model, DeepSpeed
engine and ``step`` of ``pretrain.train.loop.Trainer``. First --warmup steps (compilation, autotuning, the
allocator's growth), then --steps timed without the profiler: tokens/s, model FLOP/s and MFU as the trainer logs
them. Then --steps under the profiler, their time sorted into categories (tools/step_categories.py says what each
holds): device time on CUDA, the main thread's on CPU. On several ranks rank 0 profiles; every rank steps.

Everything goes to --out (default RUN_DIR/profile, which also takes the run's own files: config, metrics):
``trace.json``, the Chrome trace (chrome://tracing or ui.perfetto.dev), and ``profile.json`` (--json), the table and
figures printed. No checkpoint is read or written: the weights are a fresh run's.
"""
import argparse
import contextlib
import inspect
import json
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
from pretrain.cli_help import HelpFormatter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--config", required=True, help="the run's YAML config")
    parser.add_argument("--steps", type=int, default=5, help="steps timed, then as many profiled")
    parser.add_argument("--warmup", type=int, default=3, help="steps run first, counted nowhere")
    parser.add_argument("--out", help="directory for trace.json, profile.json and the run's files "
                                      "(default: RUN_DIR/profile)")
    parser.add_argument("--json", help="where profile.json goes (default: in --out)")
    parser.add_argument("--top", type=int, default=3,
                        help="print the ops (CPU) or kernels (CUDA) that take most of each category's time; the JSON "
                             "keeps 10")
    parser.add_argument("--peak-tflops", type=float,
                        help="the device's peak, for MFU where the trainer does not know it (a CPU)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the config and its overrides, print the run's estimate as launch/pretrain.py "
                             "--dry-run does (parameters, FLOPs per token, memory per rank: the model on the meta "
                             "device) and stop: no device touched, nothing profiled")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1 (the profiler takes one warm-up step of its own)")

    from pretrain.config import ConfigError
    from pretrain.tasks.config_checks import load_run_config

    try:
        cfg = load_run_config(args.config, args.overrides)
        if args.dry_run:
            from pretrain.estimate import estimate

            print(json.dumps(estimate(cfg, int(os.environ.get("WORLD_SIZE", "1")))))
            return 0
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out or Path(cfg.run.dir) / "profile")
    cfg.run.dir = str(out)
    cfg.log.every = args.warmup + 2 * args.steps + 2  # the trainer logs nothing meanwhile: this tool reports

    from pretrain.distributed import close_process_group
    from pretrain.train.loop import Trainer

    try:
        trainer = Trainer(cfg)
        report = profile(trainer, args, out)
        trainer.writer.close()
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    finally:
        close_process_group()
    if report is not None:
        print(table(report, args.top))
        path = Path(args.json or out / "profile.json")
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {path} and {report['trace']}")
    return 0


def profile(trainer, args, out: Path) -> dict | None:
    """Warm up, time, then profile the trainer's steps; on rank 0 the report (None elsewhere). The Chrome trace is
    written where the profiler stops, after the last profiled step's clock is read."""
    from torch.profiler import ProfilerActivity, schedule
    from torch.profiler import profile as torch_profile

    from benchlib import sync

    device, main = trainer.world.device, trainer.world.is_main
    warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")  # we export then
    if args.peak_tflops:
        trainer.throughput.peak_flops = args.peak_tflops * 1e12
    trace = out / "trace.json"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    profiler = (torch_profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=args.steps),
                              on_trace_ready=lambda done: done.export_chrome_trace(str(trace)))
                if main else contextlib.nullcontext(_NoProfiler()))
    with trainer.stepping() as (stop, batches):
        def step():
            if trainer.step(stop, batches):
                raise SystemExit(f"stopped by {stop.reason or 'a stop request'}")

        for _ in range(args.warmup):
            step()
        sync(device)
        trainer.throughput.restart()
        for _ in range(args.steps):
            step()
        sync(device)
        figures = trainer.throughput.report()  # the trainer's own figures, over the timed steps
        with profiler as prof:
            step()  # the profiler's warm-up
            sync(device)
            prof.step()
            start = time.perf_counter()
            for i in range(args.steps):
                step()
                if i == args.steps - 1:
                    sync(device)
                    profiled_s = time.perf_counter() - start
                prof.step()
    if not main:
        return None
    return build_report(trainer, args, trace, figures, profiled_s)


class _NoProfiler:
    """What ranks other than 0 step instead of a profiler."""

    def step(self):
        pass


def build_report(trainer, args, trace: Path, figures: dict, profiled_s: float) -> dict:
    """The figures of ``profile.json``: the setting, step times, categories, throughput, FLOPs and MFU."""
    import torch
    from step_categories import CATEGORIES, HOST_LABEL, step_time

    from benchlib import device_name

    cfg, unit = trainer.cfg, trainer.task.unit
    counted = step_time(json.loads(trace.read_text()))
    per_step, kernels = counted.ms_per_step(), counted.kernels_per_step()
    traced_ms = sum(per_step.values())
    labels = {**CATEGORIES, "host": HOST_LABEL[counted.device]}
    return {
        "config": args.config, "overrides": args.overrides, "device": device_name(trainer.world.device),
        "world_size": trainer.world.world_size, "zero_stage": cfg.deepspeed.zero_stage,
        "precision": cfg.deepspeed.precision, "activation_checkpointing": cfg.deepspeed.activation_checkpointing,
        "seq_len": cfg.train.seq_len, "micro_batch_size": cfg.train.micro_batch_size,
        "grad_accum_steps": cfg.train.grad_accum_steps, f"{unit}_per_step": trainer.units_per_step,
        "warmup": args.warmup, "steps": args.steps,
        "step_ms": trainer.units_per_step / figures[f"train/{unit}_per_s"] * 1e3,  # without the profiler
        "profiled_step_ms": profiled_s / args.steps * 1e3,  # with it, by this tool's clock
        "counted": "device time (kernels)" if counted.device == "cuda" else "main thread's time (self CPU time)",
        "categories": {key: {"label": labels[key], "ms_per_step": ms, "share": ms / traced_ms,
                             "kernels_per_step": None if kernels is None else kernels[key],
                             "top": counted.top(key, 10)} for key, ms in per_step.items()},
        "traced_step_ms": traced_ms,  # the categories' sum: the profiled steps by the trace's clock
        "host_categories": ({key: {"label": labels[key] if key != "host" else HOST_LABEL["cpu"], "ms_per_step": ms,
                                   "top": counted.top(key, 10, host=True)}
                             for key, ms in counted.ms_per_step(host=True).items()}
                            if counted.device == "cuda" else None),  # what the host does while the device waits
        "throughput": figures,  # Throughput.report() over the timed steps: the trainer's own figures
        f"train_flops_per_{unit[:-1]}": trainer.throughput.flops_per_unit,
        "peak_flops": trainer.throughput.peak_flops,
        "mfu": figures.get("train/mfu"),
        "forward_flops": forward_flops(cfg, torch),
        "trace": str(trace),
        "load_avg": round(os.getloadavg()[0], 2),
    }


def forward_flops(cfg, torch) -> dict:
    """The model's forward FLOPs per token by part, and what each mixer counts (its ``flops_per_token`` doc);
    the trainer's training FLOPs are 3× their sum. Built on the meta device: no memory, ZeRO-3 or not."""
    from pretrain.tasks import build_model

    with torch.device("meta"):
        model = build_model(cfg)
    if not hasattr(model, "flops_by_part"):
        return {}
    mixers = {type(block.mixer).__name__: block.mixer for block in model.layers}
    return {name: {"per_token": flops,
                   "counts": inspect.getdoc(type(mixers[name]).flops_per_token) if name in mixers else None}
            for name, flops in model.flops_by_part(cfg.train.seq_len).items()}


def table(report: dict, top: int) -> str:
    """The report as the lines printed, with the ``top`` names of each category."""
    unit = next(key for key in report if key.endswith("_per_step")).removesuffix("_per_step")
    on_device = report["categories"]["host"].get("kernels_per_step") is not None  # CUDA: kernels per step too
    lines = [f"{report['config']} on {report['device']}, {report['world_size']} rank(s), ZeRO "
             f"{report['zero_stage']}, {report['precision']}: {report[f'{unit}_per_step']:,} {unit} a step; "
             f"{report['steps']} steps timed and {report['steps']} profiled after {report['warmup']} warm-up",
             f"step time {report['step_ms']:.1f} ms; profiled {report['profiled_step_ms']:.1f} ms by the clock, "
             f"{report['traced_step_ms']:.1f} ms by the trace; counted: {report['counted']}",
             "", f"{'category':<48}{'ms/step':>10}{'share':>9}" + (f"{'kernels':>9}" if on_device else "")]
    for key, row in report["categories"].items():
        launched = f"{row['kernels_per_step']:>9,.0f}" if on_device and key != "host" else ""
        lines.append(f"{row['label']:<48}{row['ms_per_step']:>10.2f}{row['share']:>9.1%}{launched}")
        if key != "host":  # its one name says what the label does
            lines += [f"    {name[:70]:<70}{ms:>10.3f}" for name, ms in row["top"][:top] if ms > 0]
    launched = f"{sum(row['kernels_per_step'] for row in report['categories'].values()):>9,.0f}" if on_device else ""
    lines.append(f"{'total':<48}{report['traced_step_ms']:>10.2f}{1:>9.1%}{launched}")
    if report["host_categories"]:  # a step the device waits on is as fast as the host issues it: what the host does
        lines += ["", f"{'the host (main thread) meanwhile':<48}{'ms/step':>10}"]
        for row in report["host_categories"].values():
            lines.append(f"{row['label']:<48}{row['ms_per_step']:>10.2f}")
            lines += [f"    {name[:70]:<70}{ms:>10.3f}" for name, ms in row["top"][:top]
                      if ms > 0 and name != "between ops"]
    figures = report["throughput"]
    flops = report[f"train_flops_per_{unit[:-1]}"]
    mfu = (f"MFU {report['mfu']:.1%} of {report['peak_flops'] / 1e12:.0f} TFLOP/s" if report["mfu"] is not None
           else "MFU: the device's peak is unknown (give --peak-tflops)")
    lines += ["", f"{figures[f'train/{unit}_per_s']:,.0f} {unit}/s | {flops / 1e9:.3f} GFLOP per {unit[:-1]} "
                  f"(training, 3× forward) | {figures['train/flops_per_s_per_rank'] / 1e12:.3f} TFLOP/s per rank | "
                  f"{mfu}"]
    if report["forward_flops"]:
        lines.append(f"forward FLOPs per {unit[:-1]} by part (MFU counts these, never a recomputation):")
        for name, part in report["forward_flops"].items():
            counts = f"  {' '.join(part['counts'].split()).split('. ')[0]}" if part["counts"] else ""
            lines.append(f"  {name:<20}{part['per_token'] / 1e6:>12.2f} MFLOP{counts}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
