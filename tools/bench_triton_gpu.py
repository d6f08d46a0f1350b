"""One GPU session for the linear-attention kernels: correctness on CUDA, the device's ceilings, a launch-config
sweep, and the side-by-side benchmark (ours vs SDPA/flash vs flash-linear-attention vs the PyTorch chunked form).

Run on a CUDA machine from the repository root, e.g.
    python tools/bench_triton_gpu.py --check --ceilings --sweep --bench --out results.json
Prints a short table last; writes every number to --out (JSON). Needs only torch and triton (fla-core optional).
"""
import argparse
import itertools
import json
import platform
import signal
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pretrain.cli_help import HelpFormatter
from pretrain.ops.decayed_linear_attention import decayed_linear_attention
from pretrain.ops.delta_rule import delta_rule
from pretrain.ops.delta_rule import triton as delta_kernels
from pretrain.ops.dplr import dplr_delta_rule, kda_delta_rule
from pretrain.ops.dplr import triton as kda_kernels
from pretrain.ops.linear_attention import linear_attention
from pretrain.ops.linear_attention import triton as kernels
from pretrain.ops.short_conv import short_conv

try:
    from fla.ops.linear_attn import chunk_linear_attn
except ImportError:  # flash-linear-attention (fla-core) is the peer we measure against, when present
    chunk_linear_attn = None


DEV = "cuda"  # --device cpu (with TRITON_INTERPRET=1) only to dry-run --check


def log(*a):
    print(*a, flush=True)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ----------------------------------------------------------------------------------------------- correctness
def check(results):
    """Ours on CUDA against the fp64 naive reference: every normalization, causal/global, packed, state."""
    rows = results.setdefault("check", [])  # filled as it goes: a time limit keeps what was checked
    torch.manual_seed(0)
    cases = []
    for normalize in ("none", "divisive", "subtractive"):
        for causal in (True, False):
            for packed in (False, True):
                for dtype in (torch.float32, torch.bfloat16):
                    cases.append((normalize, causal, packed, dtype))
    for normalize, causal, packed, dtype in cases:
        B, T, H, DK, DV = (1, 300, 3, 40, 72) if packed else (2, 257, 3, 40, 72)
        if DEV == "cpu":  # dry run under the interpreter: smaller
            B, T, H = (1, 300, 1) if packed else (1, 100, 1)
        cu = torch.tensor([0, 7, 64, 190, 300], device=DEV, dtype=torch.int32) if packed else None
        N = 4 if packed else B
        q, k = (torch.rand(B, T, H, DK, device=DEV).to(dtype).requires_grad_() for _ in range(2))
        v = torch.randn(B, T, H, DV, device=DEV).to(dtype).requires_grad_()
        shapes = dict(S=(N, H, DK, DV), z=(N, H, DK), u=(N, H, DV), n=(N, H))
        fields = {"none": "S", "divisive": "Sz", "subtractive": "Szun"}[normalize]
        init = {f: torch.rand(shapes[f], device=DEV) for f in fields}
        if "n" in init:
            init["n"] = torch.randint(1, 9, shapes["n"], device=DEV).float()
        for f in init:
            init[f].requires_grad_(f != "n")
        outs = {}
        for impl in ("triton", "naive"):
            c = (lambda t: t.double()) if impl == "naive" else (lambda t: t)
            st = kernels.LinearAttentionState(**{f: c(t) for f, t in init.items()})
            o, fin = linear_attention(c(q), c(k), c(v), causal=causal, normalize=normalize, cu_seqlens=cu,
                                      initial_state=st, output_final_state=True, impl=impl)
            outs[impl] = (o, fin)
        go = torch.randn_like(outs["triton"][0], dtype=torch.float32)
        gS = torch.randn(shapes["S"], device=DEV)
        leaves = [q, k, v] + [init[f] for f in fields if f != "n"]
        grads = {}
        for impl, (o, fin) in outs.items():
            loss = (o * go.to(o.dtype)).sum() + (fin.S * gS.to(fin.S.dtype)).sum()
            grads[impl] = torch.autograd.grad(loss, leaves)
        errs = [rel(outs["triton"][0], outs["naive"][0]), rel(outs["triton"][1].S, outs["naive"][1].S)]
        errs += [rel(a, b) for a, b in zip(grads["triton"], grads["naive"])]
        finite = all(torch.isfinite(t).all().item() for t in [outs["triton"][0], *grads["triton"]])
        rows.append(dict(normalize=normalize, causal=causal, packed=packed, dtype=str(dtype), errors=errs,
                         finite=finite))
        log(f"check {normalize:11s} causal={causal!s:5s} packed={packed!s:5s} {str(dtype):15s} "
            f"finite={finite} max_err={max(errs):.1e} " + " ".join(f"{e:.1e}" for e in errs))
    if DEV == "cpu":
        return
    # big realistic shape against fp64 naive (D = 128, two value blocks)
    q, k = (torch.rand(2, 2048, 4, 128, device=DEV).bfloat16().requires_grad_() for _ in range(2))
    v = torch.randn(2, 2048, 4, 128, device=DEV).bfloat16().requires_grad_()
    for normalize in ("none", "divisive"):
        o = linear_attention(q, k, v, normalize=normalize, impl="triton")
        ref = linear_attention(q.double(), k.double(), v.double(), normalize=normalize, impl="naive")
        go = torch.randn_like(o)
        g1 = torch.autograd.grad(o, (q, k, v), go)
        g2 = torch.autograd.grad(ref, (q, k, v), go.double())
        errs = [rel(o, ref)] + [rel(a, b) for a, b in zip(g1, g2)]
        rows.append(dict(normalize=normalize, shape="2x2048x4x128 bf16", errors=errs))
        log(f"check big {normalize}: " + " ".join(f"{e:.1e}" for e in errs))
        if chunk_linear_attn is not None:
            o_fla, _ = chunk_linear_attn(q, k, v, scale=1.0, normalize=normalize == "divisive")
            log(f"check big {normalize}: fla-core vs naive {rel(o_fla, ref):.1e}")
    # the decayed op's kernels at the same shape, a gate per token, against its chunked form in fp64: o, dq, dk, dv, dg
    g = (-0.1 * torch.rand(2, 2048, 4, device=DEV)).requires_grad_()
    o = decayed_linear_attention(q, k, v, g, impl="triton")
    ref = decayed_linear_attention(q.double(), k.double(), v.double(), g.double(), impl="chunk")
    go = torch.randn_like(o)
    grads = zip(torch.autograd.grad(o, (q, k, v, g), go), torch.autograd.grad(ref, (q, k, v, g), go.double()))
    errs = [rel(o, ref)] + [rel(a, b) for a, b in grads]
    rows.append(dict(op="decayed", shape="2x2048x4x128 bf16", errors=errs))
    log("check big decayed: " + " ".join(f"{e:.1e}" for e in errs))


# ------------------------------------------------------------------------------------------------ ceilings
def ceilings(results):
    x = torch.randn(2 * 1024**3 // 4, device=DEV)  # 2 GiB, far past the L2
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")  # noqa: F821
    bw = 2 * x.numel() * 4 / ms / 1e9  # TB/s, read + write
    del x, y
    a, b = (torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    ms_mm = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    tflops = 2 * 8192**3 / ms_mm / 1e9
    results["ceilings"] = dict(copy_TBps=bw, bf16_matmul_TFLOPs=tflops)
    log(f"ceilings: copy {bw:.2f} TB/s (read+write), bf16 8192^3 matmul {tflops:.0f} TFLOP/s")


# --------------------------------------------------------------------------------------------- benchmarks
def flops_per_token_head(dk, dv, chunk, fwd_only):
    """The kernels' own FLOP count (multiply-add = 2): C×C tiles counted whole, states dk×dv."""
    fwd = 2 * chunk * (dk + dv) + 4 * dk * dv  # q kᵀ, A v, q S, kᵀ v
    bwd = 3 * (2 * chunk * (dk + dv) + 4 * dk * dv)  # three sweeps, each two C×C products and two with a state
    return fwd if fwd_only else fwd + bwd


FLA_OPS = ("fla_chunk", "fla_chunk_div", "decay_fla", "gated_delta_fla")  # rows where fla-core is installed


def make_ops(B, T, H, D, chunk=64):
    """name -> (setup() -> (fn_fwd, fn_fwdbwd)); inputs made inside so each op owns its memory."""
    def linear(impl, normalize):
        def setup():
            q, k = (torch.rand(B, T, H, D, device=DEV, dtype=torch.bfloat16).requires_grad_() for _ in range(2))
            v = torch.randn(B, T, H, D, device=DEV, dtype=torch.bfloat16).requires_grad_()
            do = torch.randn_like(v)
            f = lambda: linear_attention(q, k, v, normalize=normalize, impl=impl, chunk_size=chunk)
            return f, lambda: torch.autograd.grad(f(), (q, k, v), do)
        return setup

    def fla(normalize):
        def setup():
            q, k = (torch.rand(B, T, H, D, device=DEV, dtype=torch.bfloat16).requires_grad_() for _ in range(2))
            v = torch.randn(B, T, H, D, device=DEV, dtype=torch.bfloat16).requires_grad_()
            do = torch.randn_like(v)
            f = lambda: chunk_linear_attn(q, k, v, scale=1.0, normalize=normalize)[0]
            return f, lambda: torch.autograd.grad(f(), (q, k, v), do)
        return setup

    def sdpa():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def setup():
            q, k, v = (torch.randn(B, H, T, D, device=DEV, dtype=torch.bfloat16).requires_grad_()
                       for _ in range(3))
            do = torch.randn_like(v)

            def f():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return f, lambda: torch.autograd.grad(f(), (q, k, v), do)
        return setup

    def gated(op, impl):
        """Decayed linear attention (per-token log-decay), the gated delta rule, KDA (a log-decay per key channel)
        or the general diagonal-plus-low-rank rule (RWKV-7's transition: a = −η ⊙ κ̂, b = κ̂, η per channel), ours
        (`chunk`, PyTorch; `triton`, our kernels) or fla's kernels through our adapter (`fla`): the mixers of the
        decay and delta-rule issues."""
        def setup():
            q, k = (torch.rand(B, T, H, D, device=DEV, dtype=torch.bfloat16) for _ in range(2))
            if op != "decay":
                k = torch.nn.functional.normalize(k.float(), dim=-1).bfloat16()
            q, k = q.requires_grad_(), k.requires_grad_()
            v = torch.randn(B, T, H, D, device=DEV, dtype=torch.bfloat16).requires_grad_()
            g = (-torch.rand(B, T, H, *[D] * (op in ("kda", "dplr")), device=DEV) * 0.1).requires_grad_()
            beta = torch.rand(B, T, H, *[D] * (op == "dplr"), device=DEV, dtype=torch.bfloat16).requires_grad_()
            do = torch.randn_like(v)
            if op == "decay":
                f = lambda: decayed_linear_attention(q, k, v, g, impl=impl, chunk_size=chunk)
            elif op == "kda":
                f = lambda: kda_delta_rule(q, k, v, beta, g, impl=impl, chunk_size=chunk)
            elif op == "dplr":
                f = lambda: dplr_delta_rule(q, k, v, -beta * k, k, g, impl=impl, chunk_size=chunk)
            else:
                f = lambda: delta_rule(q, k, v, beta, g, impl=impl, chunk_size=chunk)
            leaves = (q, k, v, g) if op == "decay" else (q, k, v, g, beta)
            return f, lambda: torch.autograd.grad(f(), leaves, do)
        return setup

    def conv(impl, channels=2048, K=4):
        """The short convolution of one of Gated DeltaNet's q, k, v (K = 4, SiLU) on rows packed with documents of
        997 tokens: the tap loop (~16 launches forward, ~40 backward) against the Triton form (1; 1 and a sum)."""
        def setup():
            x = torch.randn(B, T, channels, device=DEV, dtype=torch.bfloat16).requires_grad_()
            weight = (torch.rand(channels, K, device=DEV, dtype=torch.bfloat16) - 0.5).requires_grad_()
            positions = (torch.arange(T, device=DEV) % 997).expand(B, T)
            dy = torch.randn_like(x)
            f = lambda: short_conv(x, weight, positions=positions, impl=impl)
            return f, lambda: torch.autograd.grad(f(), (x, weight), dy)
        return setup

    ops = {"sdpa_flash": sdpa(), "linear_triton": linear("triton", "none"),
           "linear_triton_div": linear("triton", "divisive"), "linear_chunk": linear("chunk", "none")}
    if chunk_linear_attn is not None:
        ops.update(zip(FLA_OPS, (fla(False), fla(True), gated("decay", "fla"), gated("delta", "fla"))))
    ops["decay_triton"] = gated("decay", "triton")
    ops["decay_chunk"], ops["gated_delta_chunk"] = gated("decay", "chunk"), gated("delta", "chunk")
    ops["gated_delta_triton"] = gated("delta", "triton")  # issue 45's goal: ≤ 1.5× linear_triton at 16k
    ops["kda_chunk"], ops["kda_triton"] = gated("kda", "chunk"), gated("kda", "triton")  # beside gated_delta_triton
    ops["dplr_chunk"], ops["dplr_triton"] = gated("dplr", "chunk"), gated("dplr", "triton")  # RWKV-7's, beside KDA's
    ops["short_conv_naive"], ops["short_conv_triton"] = conv("naive"), conv("triton")  # C = 2048, whatever H, D
    return ops


# The PyTorch chunked forms are the slow reference points: past these lengths they cost minutes.
PYTORCH_FORM_LONGEST_T = {"linear_chunk": 16384, "decay_chunk": 4096, "gated_delta_chunk": 4096, "kda_chunk": 4096,
                          "dplr_chunk": 4096}


def measure(setup, fwd_only):
    if DEV == "cpu":  # a dry run under the interpreter: one timed call, no memory figures
        fn = setup()[0 if fwd_only else 1]
        fn()
        start = time.perf_counter()
        fn()
        return dict(ms=(time.perf_counter() - start) * 1e3)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    try:
        fwd, fwdbwd = setup()
        fn = fwd if fwd_only else fwdbwd
        torch.cuda.synchronize()
        inputs = torch.cuda.memory_allocated() - base
        fn()  # compile / warm
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start
        ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        ms2 = triton.testing.do_bench(fn, warmup=5, rep=100, return_mode="median")
        return dict(ms=ms, ms_repeat=ms2, peak_extra_GB=peak / 1e9, inputs_GB=inputs / 1e9)
    except torch.cuda.OutOfMemoryError:
        return dict(ms=None, error="out of memory")
    except Exception as e:  # one op failing (a compiler refusal, a signature fla changed) must not end the run
        return dict(ms=None, error=repr(e)[:300])
    finally:
        torch.cuda.empty_cache()


def bench(results, lengths, only=None, B=8, H=32, D=128):
    rows = results.setdefault("bench", [])
    for T in lengths:
        ops = make_ops(B, T, H, D)
        for name, setup in ops.items():
            if only and name not in only:
                continue
            for fwd_only in (True, False):
                if T > PYTORCH_FORM_LONGEST_T.get(name, T):
                    continue
                t0 = time.time()
                m = measure(setup, fwd_only)
                m.update(op=name, T=T, B=B, H=H, D=D, pass_="fwd" if fwd_only else "fwd+bwd",
                         wall_s=time.time() - t0)  # compiling and autotuning included: what a device call pays
                if m.get("ms") and name.startswith("linear_triton"):
                    flops = flops_per_token_head(D, D, 64, fwd_only) * B * T * H
                    m["TFLOPs"] = flops / m["ms"] / 1e9
                rows.append(m)
                said = m.get("error", "")
                if m.get("ms"):
                    said = f"{m['ms']:9.3f} ms"
                    if "ms_repeat" in m:  # (a dry run on CPU times one call and measures no memory)
                        said += f" (again {m['ms_repeat']:.3f}) peak+{m['peak_extra_GB']:.2f} GB"
                log(f"bench T={T:6d} {name:18s} {m['pass_']:8s} {said}  [{time.time() - t0:.0f}s]")


def sweep(results, T=8192, B=8, H=32, D=128):
    """Launch settings of the linear and decayed kernels (they share ``CONFIG``) at one length: forward and
    forward+backward time."""
    configs = [dict(block=64, num_warps=8, num_stages=2), dict(block=64, num_warps=8, num_stages=3),
               dict(block=32, num_warps=8, num_stages=2), dict(block=32, num_warps=4, num_stages=2),
               dict(block=64, num_warps=4, num_stages=2), dict(block=128, num_warps=8, num_stages=2)]
    rows = results.setdefault("sweep", dict(T=T, rows=[]))["rows"]
    for op in ("linear_triton", "decay_triton"):
        timed_settings(rows, op, kernels.CONFIG, configs, (64, 128), B, T, H, D)


def sweep_delta(results, T=8192, B=8, H=32, D=128):
    """Launch settings of the gated delta rule's kernels at one length, the scans' (``CONFIG``) with the others at
    theirs, then the per-chunk kernels' (``UT_CONFIG``): none of these spills on sm_90 by the resource report, which
    cannot rank them (benchmarks/notes_triton.md)."""
    rows = results.setdefault("sweep", dict(T=T, rows=[]))["rows"]
    scans = [dict(value_block=32, num_warps=4, num_stages=1), dict(value_block=16, num_warps=4, num_stages=1),
             dict(value_block=64, num_warps=4, num_stages=1)]  # (2 stages: over the fused scan's shared memory)
    per_chunk = [dict(channel_block=32, num_warps=8, num_stages=2), dict(channel_block=64, num_warps=8, num_stages=1),
                 dict(channel_block=16, num_warps=8, num_stages=1)]
    timed_settings(rows, "gated_delta_triton", delta_kernels.CONFIG, scans, (64,), B, T, H, D)
    timed_settings(rows, "gated_delta_triton", delta_kernels.UT_CONFIG, per_chunk, (64,), B, T, H, D)


def timed_settings(rows, op, config, settings, chunks, B, T, H, D):
    """Forward and forward+backward time of ``op`` with the settings dict ``config`` (a kernel module's, read at
    each launch) updated to each of ``settings`` in turn, at each chunk size; a row each; ``config`` restored."""
    default = dict(config)
    try:
        for cfg in settings:
            for chunk in chunks:
                config.update(cfg)
                setup = make_ops(B, T, H, D, chunk)[op]
                r = {p: measure(setup, p == "fwd") for p in ("fwd", "fwd+bwd")}  # one the compiler refuses: error
                error = r["fwd"].get("error") or r["fwd+bwd"].get("error")
                rows.append({"op": op, **cfg, "chunk": chunk, "fwd": r["fwd"]["ms"], "fwd+bwd": r["fwd+bwd"]["ms"],
                             "error": error})
                log(f"sweep {op} {cfg} chunk={chunk}: " + (error or f"fwd {r['fwd']['ms']:.3f} ms, "
                                                                  f"fwd+bwd {r['fwd+bwd']['ms']:.3f} ms"))
    finally:
        config.update(default)


def segments(results, T=32768, D=128, shapes=((1, 16, 0), (8, 32, 32))):
    """Segmented kernels (issue 45) at long T: B=1, H=16 (32 programs per kernel: the rule cuts 16 segments of 32
    chunks) by the rule and kept whole; B=8, H=32 (512 programs: left whole) by the rule and forced into segments of
    32 chunks. Forward and forward+backward, and how far the segmented results are from the whole ones."""
    rows = results.setdefault("segments", [])
    default = kernels.SEGMENT_CHUNKS
    try:
        for B, H, other in shapes:
            kernels.SEGMENT_CHUNKS = None  # the rule's choice (not the last shape's forced one)
            shape = torch.empty(1, device=DEV).expand(B, T, H, D)  # the geometry reads only shape and device
            chosen = kernels._Launch(shape, shape, None, 64)
            chosen.segment(True)
            log(f"segments B={B} H={H} T={T}: the rule runs {chosen.rows} rows (sequences or segments × heads), "
                f"{chosen.slots if chosen.pairs is not None else 0} segments")
            outs = {}
            for forced in (None, other):
                kernels.SEGMENT_CHUNKS = forced
                setup = make_ops(B, T, H, D)["linear_triton"]
                r = {p: measure(setup, p == "fwd") for p in ("fwd", "fwd+bwd")}
                rows.append(dict(B=B, H=H, T=T, D=D, segment_chunks=forced, rule_rows=chosen.rows,
                                 fwd=r["fwd"].get("ms"), fwdbwd=r["fwd+bwd"].get("ms"),
                                 error=r["fwd"].get("error") or r["fwd+bwd"].get("error")))
                log(f"segments B={B} H={H} SEGMENT_CHUNKS={forced}: fwd {r['fwd'].get('ms')} ms, "
                    f"fwd+bwd {r['fwd+bwd'].get('ms')} ms {rows[-1]['error'] or ''}")
                torch.manual_seed(0)
                q, k = (torch.rand(B, T, H, D, device=DEV, dtype=torch.bfloat16).requires_grad_() for _ in range(2))
                v = torch.randn(B, T, H, D, device=DEV, dtype=torch.bfloat16).requires_grad_()
                o = linear_attention(q, k, v, normalize="none", impl="triton")
                outs[forced] = (o, *torch.autograd.grad(o, (q, k, v), torch.ones_like(o)))
            errs = [rel(a, b) for a, b in zip(outs[other], outs[None])]
            rows.append(dict(B=B, H=H, T=T, D=D, differences=errs))
            log(f"segments B={B} H={H}: SEGMENT_CHUNKS={other} against the rule, o dq dk dv: "
                + " ".join(f"{e:.1e}" for e in errs))
            del outs
    finally:
        kernels.SEGMENT_CHUNKS = default


# B=1 rows of packed documents (benchmarks/notes_triton.md, "Segments"): the usual pretraining row, 20 documents of
# which one is 8k; and one 30k document among 100 of 20 tokens
PACKED_ROWS = {"20 documents, one of 8k": [1293] * 2 + [8192] + [1293] * 16 + [1302],
               "30k among 100 of 20": [20] * 50 + [30000] + [20] * 50}


def packed_op(cu_seqlens, H, D, op):
    """setup() -> (fn_fwd, fn_fwdbwd) on one packed row (B=1), the same inputs at every call: linear attention
    (divisive) or the decayed op (a log-decay per token, its gradient too)."""
    T = int(cu_seqlens[-1])

    def setup():
        gen = torch.Generator(device=DEV).manual_seed(0)
        q, k = (torch.rand(1, T, H, D, device=DEV, generator=gen).bfloat16().requires_grad_() for _ in range(2))
        v, do = (torch.randn(1, T, H, D, device=DEV, generator=gen).bfloat16() for _ in range(2))
        g = (-0.1 * torch.rand(1, T, H, device=DEV, generator=gen)).requires_grad_()
        leaves = (q, k, v.requires_grad_()) + ((g,) if op == "decayed" else ())
        if op == "decayed":
            f = lambda: decayed_linear_attention(q, k, v, g, cu_seqlens=cu_seqlens, impl="triton")
        else:
            f = lambda: linear_attention(q, k, v, normalize="divisive", cu_seqlens=cu_seqlens, impl="triton")
        return f, lambda: torch.autograd.grad(f(), leaves, do)
    return setup


def packed_segments(results, H=16, D=128, rows=PACKED_ROWS, ops=("linear", "decayed")):
    """Packed rows whole (SEGMENT_CHUNKS=0) and as the rule cuts them (the table: only the long documents cut), for
    linear attention (divisive) and the decayed op: forward and forward+backward, and the largest differences of o
    and the gradients (q, k, v; and g) between the two (bf16: summation order only)."""
    out = results.setdefault("segments_packed", [])
    default = kernels.SEGMENT_CHUNKS
    try:
        for name, lengths in rows.items():
            cu = torch.tensor([0, *itertools.accumulate(lengths)], device=DEV, dtype=torch.int32)
            T = sum(lengths)
            kernels.SEGMENT_CHUNKS = None
            shape = torch.empty(1, device=DEV).expand(1, T, H, D)
            chosen = kernels._Launch(shape, shape, cu, 64)
            chosen.segment(True)
            cut = 0 if chosen.pairs is None else chosen.cut
            log(f"segments packed ({name}) H={H} T={T}: the rule runs {chosen.rows} rows (documents or segments × "
                f"heads; whole: {len(lengths) * H}), {cut} of {len(lengths)} documents cut into "
                f"{chosen.slots if cut else 0} segments")
            for op in ops:
                setup = packed_op(cu, H, D, op)
                outs = {}
                for forced in (0, None):
                    kernels.SEGMENT_CHUNKS = forced
                    r = {p: measure(setup, p == "fwd") for p in ("fwd", "fwd+bwd")}
                    error = r["fwd"].get("error") or r["fwd+bwd"].get("error")
                    out.append(dict(row=name, op=op, H=H, T=T, D=D, segment_chunks=forced,
                                    rows=len(lengths) * H if forced == 0 else chosen.rows, fwd=r["fwd"].get("ms"),
                                    fwdbwd=r["fwd+bwd"].get("ms"), error=error))
                    log(f"segments packed ({name}) {op} {'whole' if forced == 0 else 'the rule'}: fwd "
                        f"{r['fwd'].get('ms')} ms, fwd+bwd {r['fwd+bwd'].get('ms')} ms {error or ''}")
                    fwd, fwdbwd = setup()
                    outs[forced] = (fwd(), *fwdbwd())
                diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(outs[None], outs[0])]
                scales = [b.float().abs().max().item() for b in outs[0]]
                out.append(dict(row=name, op=op, H=H, T=T, D=D, max_differences=diffs, max_values=scales))
                log(f"segments packed ({name}) {op}: the rule against whole, max |difference| of o and the gradients: "
                    + " ".join(f"{d:.1e} (of {m:.1e})" for d, m in zip(diffs, scales)))
                del outs
    finally:
        kernels.SEGMENT_CHUNKS = default


def kernel_profile(results, names, T, B=8, H=32, D=128, repeats=3):
    """Where each op's forward+backward spends its time at one T: the profiler's kernels (and other device ops) by
    name, the most expensive first, and how busy the device was over the wall time of the repeats (the rest is
    the host: launches, Python, synchronisation)."""
    from torch.profiler import ProfilerActivity, profile
    rows = results.setdefault("kernel_profile", [])
    ops = make_ops(B, T, H, D)
    missing = sorted(set(names) - set(ops))  # the names are checked at parse time: these are fla's
    if missing:
        raise SystemExit(f"--profile: {', '.join(missing)} need fla-core, which is not installed here")
    on_device = DEV == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    field = "self_device_time_total" if on_device else "self_cpu_time_total"
    sync = torch.cuda.synchronize if on_device else (lambda: None)
    for name in names:
        _, fwdbwd = ops[name]()
        fwdbwd()  # compile and warm outside the profile
        sync()
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(repeats):
                fwdbwd()
            sync()
            wall_ms = (time.perf_counter() - start) * 1e3 / repeats
        events = [e for e in prof.key_averages() if getattr(e, field) > 0]
        busy_ms = sum(getattr(e, field) for e in events) / repeats / 1e3
        top = sorted(events, key=lambda e: -getattr(e, field))[:20]
        kernels = [dict(name=e.key[:160], ms=getattr(e, field) / repeats / 1e3, calls=e.count // repeats)
                   for e in top]
        rows.append(dict(op=name, T=T, B=B, H=H, D=D, wall_ms=wall_ms, busy_ms=busy_ms, kernels=kernels))
        log(f"profile {name} T={T} B={B} H={H} D={D}: {wall_ms:.2f} ms a fwd+bwd, "
            f"{'device' if on_device else 'host'} busy {busy_ms:.2f} ms")
        for k in kernels:
            log(f"  {k['ms']:9.3f} ms {k['calls']:5d}x  {k['name']}")


def ints(text: str) -> list[int]:
    """``"1024,2048"`` → ``[1024, 2048]``: a bad number is a usage error at the start, not a stage's crash later."""
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated integers; got {text!r}") from None


def op_names(text: str) -> list[str]:
    """``"linear_triton,sdpa_flash"`` → the names, each an op of the table (fla's whether or not fla-core is here): a
    misspelt name would otherwise bench or profile nothing, and a device session's stage would be spent on it."""
    names = [x for x in text.split(",") if x]
    known = set(make_ops(1, 64, 1, 16)) | set(FLA_OPS)  # setups only: nothing is allocated
    unknown = sorted(set(names) - known)
    if unknown:
        raise argparse.ArgumentTypeError(f"no op named {', '.join(unknown)}; the ops: {', '.join(sorted(known))}")
    return names


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--check", action="store_true", help="correctness of ours on CUDA against fp64 naive")
    p.add_argument("--ceilings", action="store_true", help="copy bandwidth and bf16 matmul rate")
    p.add_argument("--sweep", action="store_true", help="launch settings of our kernels at T=8k")
    p.add_argument("--sweep-delta", action="store_true", help="launch settings of the gated delta rule's at T=8k")
    p.add_argument("--segments", action="store_true",
                   help="segmented kernels against whole ones at T=32k, and packed rows (B=1, H=16) whole and cut "
                        "(linear and decayed)")
    p.add_argument("--bench", type=ints, default=[], help="comma-separated T, e.g. 1024,2048,...,65536")
    p.add_argument("--only", type=op_names, default=[], help="comma-separated op names to bench (default: all)")
    p.add_argument("--profile", type=op_names, default=[],
                   help="comma-separated op names: each fwd+bwd's kernels by time")
    p.add_argument("--profile-t", type=int, default=16384, help="T for --profile")
    p.add_argument("--profile-shape", type=ints, default=[8, 32, 128], help="B,H,D for --profile")
    p.add_argument("--out", default="gpu_results.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dry-run", action="store_true",
                   help="check the arguments (op names included) and stop, touching no device: a GPU plan rehearsed "
                        "on CPU (benchmarks/gpu_session.sh with REHEARSE=1)")
    a = p.parse_args(argv)
    if len(a.profile_shape) != 3:
        p.error(f"--profile-shape wants B,H,D; got {a.profile_shape}")
    if a.dry_run:
        log(f"dry run: arguments checked ({' '.join(argv if argv is not None else sys.argv[1:])})")
        return
    # A device call's time limit ends this process with SIGTERM: exit through the `finally` below, which writes
    # what was measured so far (the first GPU session lost its check and benchmark JSON to a timeout).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    global DEV
    DEV = a.device
    results = dict(device=torch.cuda.get_device_name() if DEV == "cuda" else DEV, torch=torch.__version__,
                   triton=triton.__version__,
                   python=platform.python_version(), cuda=torch.version.cuda, config=dict(kernels.CONFIG),
                   delta_config=dict(scans=dict(delta_kernels.CONFIG), per_chunk=dict(delta_kernels.UT_CONFIG)),
                   kda_config=dict(scans=dict(kda_kernels.CONFIG), per_chunk=dict(kda_kernels.UT_CONFIG),
                                   products=dict(kda_kernels.PRODUCTS_CONFIG)))
    try:
        import fla
        results["fla_core"] = getattr(fla, "__version__", "?")
    except ImportError:
        results["fla_core"] = None
    log(results)
    try:
        if a.check:
            check(results)
        if a.ceilings:
            ceilings(results)
        if a.sweep:
            sweep(results)
        if a.sweep_delta:
            sweep_delta(results)
        if a.segments:
            if DEV == "cpu":  # a dry run under the interpreter: toy sizes, short segments allowed so that the rule cuts
                kernels.DEFAULT_MULTIPROCESSORS, kernels.MIN_SEGMENT_CHUNKS = 16, 2
                segments(results, T=256, D=16, shapes=((1, 2, 0), (2, 2, 1)))
                packed_segments(results, H=2, D=16, rows={"toy": [10, 10, 300, 10, 1]})
            else:
                segments(results)
                packed_segments(results)
        if a.profile:
            kernel_profile(results, a.profile, a.profile_t, *a.profile_shape)
        if a.bench:
            bench(results, a.bench, only=set(a.only))
    finally:
        Path(a.out).write_text(json.dumps(results, indent=1))
    table(results)


def table(results):
    log("\n== summary ==")
    for row in results.get("segments", []) + results.get("segments_packed", []):
        log(f"segments {row}")
    for row in results.get("sweep", {}).get("rows", []):
        settings = " ".join(f"{k}={v}" for k, v in row.items() if k not in ("op", "chunk", "fwd", "fwd+bwd", "error"))
        log(f"sweep {row.get('op', 'linear_triton')} {settings} C={row['chunk']}: "
            f"fwd {row['fwd']} fwd+bwd {row['fwd+bwd']} {row['error'] or ''}")
    by = {}
    for r in results.get("bench", []):
        by.setdefault((r["T"], r["pass_"]), {})[r["op"]] = r.get("ms")
    for (T, pas), ops in sorted(by.items()):
        log(f"T={T:6d} {pas:8s} " + " ".join(f"{k}={v:.2f}" if v else f"{k}=-" for k, v in ops.items()))


if __name__ == "__main__":
    main()
