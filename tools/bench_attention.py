"""Forward and forward+backward time and peak memory of token mixers against sequence length, side by side.

    python tools/bench_attention.py --device cpu --seq-lens 1024,4096,16384,65536 --mixers softmax,linear \\
        --json benchmarks/attention_cpu.json --plot benchmarks/attention_cpu.png --markdown benchmarks/attention_cpu.md

Mixers are op-level kernels on ``[B, T, H, D]`` (the ``OPS`` table: q and k positive, as feature maps leave them)
or any mixer module registered in ``pretrain.attention`` (built with ``build_mixer(name, H*D, H, causal=True)``
and run on ``[B, T, H*D]``); a name in both means the op, ``module:NAME`` the module.

Each length is measured as ``tools/benchlib.py`` describes: every mixer probed once in a fresh subprocess (so one
that runs out of memory, fails or outlasts ``--probe-timeout`` is recorded with that status, not a crash), then the
mixers that fit timed in interleaved rounds (median reported). CPU peak memory is the probe's peak resident set
less its resident size before the inputs were made; CPU probes run under ``--cpu-mem-limit-gb`` of address space.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pretrain.attention import REGISTRY, build_mixer
from pretrain.cli_help import HelpFormatter
from pretrain.ops import decayed_linear_attention, delta_rule, dplr_delta_rule, linear_attention, softmax_attention
from pretrain.ops.dplr import kda_delta_rule
from pretrain.ops.precision import DTYPES

import benchlib  # tools/, beside this script

OPS = {  # op-level kernels, (q, k, v) [B, T, H, D] -> [B, T, H, D]
    "softmax": lambda q, k, v: softmax_attention(q, k, v, causal=True),
    "linear": lambda q, k, v: linear_attention(q, k, v, impl="auto"),
    "linear_chunk": lambda q, k, v: linear_attention(q, k, v, impl="chunk"),
    "linear_naive": lambda q, k, v: linear_attention(q, k, v, impl="naive"),
    "linear_triton": lambda q, k, v: linear_attention(q, k, v, impl="triton"),
    # a gate per token and head from the values (Mamba-2's kind of decay), divisive like linear_chunk
    "decayed_chunk": lambda q, k, v: decayed_linear_attention(q, k, v, F.logsigmoid(v[..., 0]), normalize="divisive",
                                                              impl="chunk"),
    "fla_chunk": lambda q, k, v: fla_chunk_linear_attn(q, k, v),
    "delta_rule": lambda q, k, v: delta_rule(q, F.normalize(k, dim=-1), v, torch.sigmoid(v[..., 0])),
    "gated_delta_rule": lambda q, k, v: delta_rule(q, F.normalize(k, dim=-1), v, torch.sigmoid(v[..., 0]),
                                                   F.logsigmoid(v[..., 1])),
    "kda_dplr": lambda q, k, v: kda_dplr(q, F.normalize(k, dim=-1), v, torch.sigmoid(v[..., :1]), F.logsigmoid(v)),
    "kda": lambda q, k, v: kda_delta_rule(q, F.normalize(k, dim=-1), v, torch.sigmoid(v[..., 0]), F.logsigmoid(v)),
    "kda_fast_decay": lambda q, k, v: kda_delta_rule(q, F.normalize(k, dim=-1), v, torch.sigmoid(v[..., 0]),
                                                     -3 * (1.5 * v).exp()),
}
# The delta rule's β and log-gate are read off two channels of v (differentiable, so backward reaches them; the
# values do not change the work), its keys L2-normalized as the mixers do; KDA's per-channel gate is all of v's
# (kda_dplr: through the general diagonal-plus-low-rank op; kda: its own entry, two products a chunk instead of four).
# kda_fast_decay: log-decays of 3 a token in the median channel, past 20 in a tenth, as trained KDA layers have them
# (the MQAR hybrid's fall by 49 over 16 tokens in the median channel): too steep to factor through any sub-chunk, so
# the products' tree (ops/dplr/chunk.py) runs from single-token leaves.


def kda_dplr(q, k, v, beta, g):
    """Kimi Delta Attention's transition ``(I − β k kᵀ) Diag(e^g)`` on the diagonal-plus-low-rank op."""
    return dplr_delta_rule(q, beta * k, v, -beta * k, g.exp() * k, g)


def fla_chunk_linear_attn(q, k, v):
    """The peer: flash-linear-attention's chunked kernel (the ``fla-core`` package), imported only when asked for."""
    from fla.ops.linear_attn import chunk_linear_attn

    return chunk_linear_attn(q, k, v, scale=1.0)[0]


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


def run_probe(name: str, seq_len: int, args) -> dict:
    """``benchlib.probe`` of one mixer at one length, in a fresh process."""
    command = [sys.executable, __file__, "--probe", name, "--probe-len", str(seq_len), *common_flags(args)]
    return benchlib.run_probe(command, args.device, cpu_mem_limit_gb=args.cpu_mem_limit_gb,
                              timeout_s=args.probe_timeout)


def common_flags(args) -> list[str]:
    return ["--device", args.device, "--threads", str(args.threads), "--batch", str(args.batch),
            "--heads", str(args.heads), "--head-dim", str(args.head_dim), "--dtype", args.dtype]


def measure_length(seq_len: int, args) -> list[dict]:
    """All mixers at one length: probes first, then interleaved timing rounds of those that fit."""
    base = {"seq_len": seq_len, "batch": args.batch, "heads": args.heads, "head_dim": args.head_dim,
            "dtype": args.dtype, "device": benchlib.device_name(args.device), "threads": torch.get_num_threads()}
    found = benchlib.measure_side_by_side(
        args.mixers, probe_one=lambda name: run_probe(name, seq_len, args),
        build_step=lambda name: build_step(name, seq_len, args), device=args.device, repeats=args.repeats,
        budget_s=args.budget_s, label=f"T={seq_len}")
    return [{"mixer": name, **base, **found[name]} for name in args.mixers]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--seq-lens", default="1024,4096,16384,65536", help="comma-separated sequence lengths")
    p.add_argument("--mixers", default="softmax,linear",
                   help=f"comma-separated: ops {sorted(OPS)}, or registered modules {sorted(REGISTRY)} "
                        "(module:NAME where an op has the same name)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    benchlib.add_measurement_flags(p, budget_s=60.0, probe_timeout_s=600.0, cpu_mem_limit_gb=16.0)
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
        print(json.dumps(benchlib.probe(lambda: build_step(args.probe, args.probe_len, args), args.device)))
        return
    records = []
    for seq_len in tqdm(args.seq_lens, desc="lengths"):
        records += measure_length(seq_len, args)
        for r in records[-len(args.mixers):]:
            tqdm.write(f"T={seq_len:>6}  {r['mixer']:<14} {benchlib.summary(r)}")
    title = (f"{records[0]['device']}, B={args.batch} H={args.heads} D={args.head_dim} {args.dtype}, "
             f"{torch.get_num_threads()} threads")
    # ratios against the softmax op, or against the softmax module when only that one was measured
    baseline = "module:softmax" if "module:softmax" in args.mixers and "softmax" not in args.mixers else "softmax"
    benchlib.write_reports(records, args, title, x="seq_len", series="mixer", x_label="sequence length T",
                           x_header="T", baseline=baseline)


if __name__ == "__main__":
    main()
