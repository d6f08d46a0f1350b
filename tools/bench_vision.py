"""Forward and forward+backward time and peak memory of vision backbones against image resolution, side by side.

    python tools/bench_vision.py --resolutions 224,512,1024,2048 --backbones linear,inline,soft,aft_conv,softmax \\
        --json benchmarks/vision_scaling_cpu.json --plot benchmarks/vision_scaling_cpu.png \\
        --markdown benchmarks/vision_scaling_cpu.md

Every backbone has the widths, depths and heads of one preset (``--preset``, PVT-Tiny's by default) and differs
only in its stage mixers (the ``BACKBONES`` table): ``softmax`` is the quadratic twin of the others. Images are
``--batch`` × 3 × R × R; the model is in eval mode (no stochastic depth, so every round does the same work).
Each resolution is measured as ``tools/benchlib.py`` describes: each backbone probed once in a fresh subprocess
(out of memory, failure or ``--probe-timeout`` recorded as a status, not a crash), then the backbones that fit
timed in interleaved rounds (median reported). A backbone whose forward+backward at a smaller resolution,
scaled by its FLOPs, predicts more than ``--probe-timeout`` is not probed: it is recorded as ``too_slow`` with the
prediction, so a long run does not wait for timeouts it can see coming.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pretrain.cli_help import HelpFormatter
from pretrain.ops.precision import DTYPES
from pretrain.tasks import build_model as build_run_model
from pretrain.tasks.config_checks import load_run_config

import benchlib  # tools/, beside this script

ROOT = Path(__file__).resolve().parents[1]
BACKBONES = {  # name: (stage mixers, mixer options over the preset's)
    "linear": (["linear"] * 4, {}),
    "inline": (["inline"] * 4, {}),
    "inline_hybrid": (["inline", "inline", "inline", "softmax"], {}),
    "soft": (["soft", "soft", "soft", "softmax"], {"soft": {"landmark_stride": [8, 4, 2, 1]}}),  # SOFT's published
    "soft_grid": (["soft", "soft", "soft", "softmax"],  # ... with at most 7×7 landmarks per stage at any size
                  {"soft": {"landmark_stride": [8, 4, 2, 1], "landmark_grid": 7}}),
    "aft_conv": (["aft_conv"] * 4, {}),
    "cosine": (["cosine"] * 4, {}),
    "efficient": (["efficient"] * 4, {}),
    "softmax": (["softmax"] * 4, {}),
}


def backbone_config(name: str, args):
    """The preset's run config with ``name``'s stage mixers and options (built directly, not through the loader's
    checks, which take one value per mixer option where the backbone also takes one per stage)."""
    cfg = load_run_config(args.preset, [])
    mixers, options = BACKBONES[name]
    cfg.vision.stage_mixers = mixers
    cfg.model.mixer_options = {**cfg.model.mixer_options, **options}
    return cfg


def build_model(name: str, args):
    return build_run_model(backbone_config(name, args)).eval()


def build_step(name: str, resolution: int, args):
    """The forward of one backbone at one resolution, as a closure over a fresh image batch."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    model = build_model(name, args).to(device, dtype)
    images = torch.randn(args.batch, 3, resolution, resolution, device=device, dtype=dtype)
    return lambda: model(images)


def run_probe(name: str, resolution: int, args) -> dict:
    command = [sys.executable, __file__, "--probe", name, "--probe-resolution", str(resolution), *common_flags(args)]
    return benchlib.run_probe(command, args.device, cpu_mem_limit_gb=args.cpu_mem_limit_gb,
                              timeout_s=args.probe_timeout)


def common_flags(args) -> list[str]:
    return ["--device", args.device, "--threads", str(args.threads), "--batch", str(args.batch),
            "--preset", str(args.preset), "--dtype", args.dtype]


def predicted_seconds(name: str, resolution: int, done: list[dict], flops: dict) -> float | None:
    """Forward+backward seconds at ``resolution`` from the largest smaller one measured, scaled by FLOPs."""
    measured = [r for r in done if r["backbone"] == name and r["status"] == "ok"]
    if not measured:
        return None
    last = max(measured, key=lambda r: r["resolution"])
    return last["fwd_bwd_ms"] / 1e3 * flops[name, resolution] / flops[name, last["resolution"]]


def measure_resolution(resolution: int, args, done: list[dict], flops: dict) -> list[dict]:
    """All backbones at one resolution: probes (unless predicted too slow), then interleaved rounds."""
    def probe_one(name):
        seconds = predicted_seconds(name, resolution, done, flops)
        if seconds is not None and seconds > args.probe_timeout:
            return {"status": "too_slow", "error": f"predicted {seconds:.0f} s from its FLOPs and a smaller size"}
        return run_probe(name, resolution, args)

    found = benchlib.measure_side_by_side(
        args.backbones, probe_one=probe_one, build_step=lambda name: build_step(name, resolution, args),
        device=args.device, repeats=args.repeats, budget_s=args.budget_s, label=f"{resolution}px")
    records = []
    for name in args.backbones:
        records.append({"backbone": name, "resolution": resolution, "stage_mixers": BACKBONES[name][0],
                        "batch": args.batch, "dtype": args.dtype, "fwd_gflops_per_image": flops[name, resolution] / 1e9,
                        "device": benchlib.device_name(args.device), "threads": torch.get_num_threads(), **found[name]})
    return records


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--resolutions", default="224,512,1024,2048", help="comma-separated square image sides (pixels)")
    p.add_argument("--backbones", default="linear,inline,soft,aft_conv,softmax",
                   help=f"comma-separated names from {sorted(BACKBONES)}")
    p.add_argument("--preset", default=str(ROOT / "configs/vision/linear_tiny.yaml"),
                   help="vision config whose widths, depths and heads every backbone takes")
    p.add_argument("--batch", type=int, default=1, help="images per step")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    benchlib.add_measurement_flags(p, budget_s=60.0, probe_timeout_s=300.0, cpu_mem_limit_gb=12.0)
    p.add_argument("--probe", help=argparse.SUPPRESS)
    p.add_argument("--probe-resolution", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.backbones = [b for b in args.backbones.split(",") if b]
    for name in args.backbones:
        if name not in BACKBONES:
            p.error(f"unknown backbone {name!r}; known: {sorted(BACKBONES)}")
    args.resolutions = [int(r) for r in args.resolutions.split(",") if r]
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but CUDA is not available")
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.probe:
        print(json.dumps(benchlib.probe(lambda: build_step(args.probe, args.probe_resolution, args), args.device)))
        return
    with torch.device("meta"):
        models = {name: build_model(name, args) for name in args.backbones}
    try:
        flops = {(name, r): model.flops_per_image(r, r) for name, model in models.items() for r in args.resolutions}
    except ValueError as err:
        sys.exit(f"--resolutions: {err}")
    records = []
    for resolution in tqdm(args.resolutions, desc="resolutions"):
        records += measure_resolution(resolution, args, records, flops)
        for r in records[-len(args.backbones):]:
            tqdm.write(f"{resolution:>5}px  {r['backbone']:<14} {benchlib.summary(r)}")
    cfg = backbone_config(args.backbones[0], args).vision
    title = (f"{records[0]['device']}, {Path(args.preset).stem} widths {list(cfg.stage_dims)} depths "
             f"{list(cfg.stage_depths)}, B={args.batch} {args.dtype}, {torch.get_num_threads()} threads")
    benchlib.write_reports(records, args, title, x="resolution", series="backbone", x_label="image side (pixels)",
                           x_header="resolution", baseline="softmax")


if __name__ == "__main__":
    main()
