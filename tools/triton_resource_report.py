"""Compile the linear-attention kernels (or the decayed op's: ``--op decayed``; the gated delta rule's: ``--op
delta_rule``; KDA's: ``--op kda``; the general diagonal-plus-low-rank rule's: ``--op dplr``) for a GPU that is not
here, and print what the compiler gives each one.

    python tools/triton_resource_report.py --configs 64,8,2 128,8,2 --chunks 64 128
    python tools/triton_resource_report.py --op delta_rule   # at the module's CONFIG and UT_CONFIG
    python tools/triton_resource_report.py --op delta_rule --configs 16,4,1 --ut-configs 32,4,1
    python tools/triton_resource_report.py --op kda --products-configs 4,1 8,1   # and its PRODUCTS_CONFIG
    python tools/triton_resource_report.py --op dplr   # KDA's kernels with ADDS, and its own products' kernels

For sm_90 (H100/H200) by default: registers per thread, stack bytes (spills), local loads/stores and HGMMA
(wgmma) instructions in the SASS, shared memory, and how many blocks an SM holds at once by them, per (channel
block, warps, pipeline stages, chunk). Needs no GPU: Triton compiles to a cubin with its own ptxas, and its
cuobjdump reads it back. Spills, and blocks per SM, are the questions about a launch setting that can be answered
without the device; which is faster is not (the linear kernel at 4 warps spills, holds 2 blocks per SM, and ran
2× the spill-free 8-warp setting's speed: benchmarks/gpu_h200_round4.md).
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pretrain.cli_help import HelpFormatter
from pretrain.ops.decayed_linear_attention import triton as decayed_kernels
from pretrain.ops.delta_rule import triton as delta_kernels
from pretrain.ops.dplr import triton as kda_kernels
from pretrain.ops.dplr import triton_general as dplr_kernels
from pretrain.ops.linear_attention import triton as kernels

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def signature(fn, dtype, constexprs, in_dtype):
    """Argument types by the kernels' naming: ``in_dtype`` names in ``dtype``, states and per-token values fp32."""
    types = {}
    for name in fn.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in ("T", "H", "WIDTH"):
            types[name] = "i32"
        elif name in ("block_stride", "later_stride", "documents_heads"):
            types[name] = "i64"
        elif name == "eps":
            types[name] = "fp32"
        elif name in ("cu_seqlens", "table", "spans"):
            types[name] = "*i32"
        elif name == "first_chunk":
            types[name] = "*i64"
        elif name in in_dtype:
            types[name] = f"*{dtype}"
        else:
            types[name] = "*fp32"
    return types


# The tensors in the input dtype: the undecayed kernels call dO "g"; the decayed ones call the log-decay g (fp32)
# (the delta rule's kernels take fp32 chunk tensors only)
IN_DTYPE = {"linear": ("q", "k", "v", "o", "g", "dq", "dk", "dv"),
            "decayed": ("q", "k", "v", "o", "do", "dq", "dk", "dv"),
            "delta_rule": (), "kda": (), "dplr": ()}


# An SM's limits by compute capability ×10 (CUDA's programming guide, "compute capabilities"): shared memory per
# block and per SM (each block also takes 1 KiB there), warps per SM; every one has 64 K registers, given out per
# warp in units of 256
SM_LIMITS = {80: (163 * 1024, 164 * 1024, 64), 86: (99 * 1024, 100 * 1024, 48), 89: (99 * 1024, 100 * 1024, 48),
             90: (227 * 1024, 228 * 1024, 64)}


def blocks_per_sm(arch, regs, smem, warps):
    """How many blocks of a kernel one SM holds at once (its registers, shared memory and warps), 0 if one block's
    shared memory is over the limit; None for an arch not in ``SM_LIMITS``."""
    if arch not in SM_LIMITS:
        return None
    block_smem, sm_smem, sm_warps = SM_LIMITS[arch]
    if smem > block_smem:
        return 0
    warp_regs = -(-regs * 32 // 256) * 256
    return min(sm_warps // warps, 65536 // warp_regs // warps, sm_smem // (smem + 1024))


def report(fn, constexprs, warps, stages, arch, dtype, op):
    src = ASTSource(fn=fn, signature=signature(fn, dtype, constexprs, IN_DTYPE[op]), constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps, num_stages=stages))
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        usage = subprocess.run([TOOLS / "cuobjdump", "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([TOOLS / "cuobjdump", "--dump-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    local = len(re.findall(r"\b(?:LDL|STL)\b", sass))
    smem = compiled.metadata.shared
    fit = blocks_per_sm(arch, int(regs.group(1)), smem, warps) if regs else None
    held = "" if fit is None else "  over the block's shared memory" if fit == 0 else f"  {fit} per SM"
    return (f"regs {regs.group(1) if regs else '?':>3}  stack {stack.group(1) if stack else '?':>5} B  "
            f"local ld/st {local:5d}  HGMMA {sass.count('HGMMA'):3d}  smem {smem:6d} B{held}")


def linear_kernels(a, block, chunk):
    """(name, kernel, constexprs) of the linear or decayed op at one channel block and chunk."""
    d = a.head_dim
    scaled = a.normalize != "none"
    full = triton.next_power_of_2(d)
    common = dict(H=a.heads, DK=d, DV=d, BT=chunk, VARLEN=False, PRECISION="tf32")
    if a.op == "linear":
        common["SEGMENTED"] = a.segments  # programs read their segment from the table
    split_k = dict(common, BK=min(block, full), BV=full)  # dq, dk: a block of key channels
    split_v = dict(common, BK=full, BV=min(block, full))  # forward, dv: a block of value channels
    forward = dict(split_v, NORMALIZE=kernels.NORMALIZE_CODES[a.normalize], INTRA=True, UPDATE=True,
                   STORE_O=True, HAS_INITIAL=False, HAS_STARTS=a.segments, OUT=0)
    flags = dict(HAS_SCALE=scaled, HAS_CENTER=scaled)
    dq = dict(split_k, INTRA=True, HAS_INITIAL=False, HAS_STARTS=a.segments,
              NORMALIZE=kernels.NORMALIZE_CODES[a.normalize], **flags)
    sweep = dict(INTRA=True, UPDATE=True, STORE=True, HAS_FINAL_GRAD=False, HAS_STARTS=a.segments, OUT=0, **flags)
    dk = dict(split_k, FOR_DK=True, HAS_DU=False, **sweep)
    dv = dict(split_v, FOR_DK=False, HAS_DU=a.normalize == "subtractive", **sweep)
    if a.op == "decayed":
        source = decayed_kernels
        segmented = dict(HAS_STARTS=a.segments, SEGMENTED=a.segments)
        forward = dict(split_v, HAS_INITIAL=False, STORE_O=True, OUT=0, **segmented)
        dq = dict(split_k, HAS_INITIAL=False, HAS_FINAL_GRAD=False, **segmented)
        dk = dict(split_k, FOR_DK=True, SUMS=False, HAS_FINAL_GRAD=False, OUT=0, **segmented)
        dv = dict(split_v, FOR_DK=False, SUMS=False, HAS_FINAL_GRAD=False, OUT=0, **segmented)
    else:
        source = kernels
    return (("forward", source._forward_kernel, forward), ("dq", source._backward_dq_kernel, dq),
            ("dk", source._backward_dk_dv_kernel, dk), ("dv", source._backward_dk_dv_kernel, dv))


def delta_rule_kernels(a, chunk, scan=None, per_chunk=None):
    """(name, kernel, constexprs with num_warps and num_stages) of every kernel of the delta rule's Triton form, at
    the shapes and launch settings its launchers use (``_geometry``, ``_ut_geometry``, ``_ut_backward_geometry``);
    ``scan`` (value block, warps, stages) replaces ``CONFIG`` and ``per_chunk`` (the UT backward's channel block,
    warps, stages) ``UT_CONFIG`` where given."""
    scans, per_tile, whole, ut_backward = geometries(a, chunk, delta_kernels, scan, per_chunk)
    return (("ut fwd", delta_kernels._ut_forward_kernel, whole),
            ("scan+output", delta_kernels._scan_output_kernel, scans),
            ("scan fwd", delta_kernels._scan_forward_kernel, scans),
            ("output adj", delta_kernels._output_backward_kernel, per_tile),
            ("scan bwd", delta_kernels._scan_backward_kernel, dict(scans, HAS_FINAL_GRAD=False)),
            ("state grads", delta_kernels._state_grads_kernel, per_tile),
            ("ut bwd", delta_kernels._ut_backward_kernel, ut_backward))


def kda_rule_kernels(a, chunk, scan=None, per_chunk=None, products=None):
    """The same for KDA's Triton form (its own ``CONFIG`` and ``UT_CONFIG``), and its products' kernels (one program
    per sub-chunk) at ``PRODUCTS_CONFIG`` or ``products`` (warps, stages); with ``--op dplr`` the general rule's:
    KDA's kernels with the scan's ``ADDS``, and its own products' kernels."""
    scans, per_tile, whole, ut_backward = geometries(a, chunk, kda_kernels, scan, per_chunk)
    sub_chunks = kda_kernels._products_geometry(chunk, a.head_dim, "tf32")
    if products:
        sub_chunks.update(num_warps=products[0], num_stages=products[1])
    general = a.op == "dplr"
    if general:  # one launch per row operand: q's, then b's a row down
        products_forward = [(f"products {x}", dplr_kernels._products_kernel, dict(sub_chunks, SHIFT=shift))
                            for shift, x in enumerate("qb")]
        rows = sub_chunks if products else dict(sub_chunks, **dplr_kernels.ROWS_BACKWARD_CONFIG)
        products_backward = [(f"rows bwd {x}", dplr_kernels._rows_backward_kernel, dict(rows, SHIFT=shift))
                             for shift, x in enumerate("qb")]
        products_backward.append(("columns bwd", dplr_kernels._columns_backward_kernel, sub_chunks))
    else:
        products_forward = [("products", kda_kernels._products_kernel, sub_chunks)]
        products_backward = [("products bwd", kda_kernels._products_backward_kernel, sub_chunks)]
    return (*products_forward,
            ("ut fwd", kda_kernels._ut_forward_kernel, whole),
            ("scan+output", kda_kernels._scan_kernel, dict(scans, OUTPUT=True, ADDS=general)),
            ("scan fwd", kda_kernels._scan_kernel, dict(scans, OUTPUT=False, ADDS=general)),
            ("output adj", kda_kernels._output_backward_kernel, per_tile),
            ("scan bwd", kda_kernels._scan_backward_kernel, scans),
            ("state grads", kda_kernels._state_grads_kernel, per_tile),
            ("ut bwd", kda_kernels._ut_backward_kernel, ut_backward),
            *products_backward)


def geometries(a, chunk, module, scan, per_chunk):
    """The scans', the per-chunk kernels', the UT forward's and the UT backward's constexprs and launch settings in
    ``module`` (the delta rule's Triton form or KDA's, with its ``CONFIG`` and ``UT_CONFIG``), ``scan`` and
    ``per_chunk`` replacing those where given."""
    shapes = (chunk, a.head_dim, a.head_dim, "tf32")
    config, ut_config = module.CONFIG, module.UT_CONFIG
    scans = dict(delta_kernels._geometry(*shapes, config), H=a.heads)
    per_tile = delta_kernels._per_chunk_geometry(*shapes, config, ut_config)  # the output adjoint, state gradients
    whole = delta_kernels._ut_geometry(*shapes, ut_config)  # the UT forward: every channel in one program
    ut_backward = delta_kernels._ut_backward_geometry(*shapes, ut_config)
    if scan:
        scans.update(BV=scan[0], num_warps=scan[1], num_stages=scan[2])
        per_tile.update(BV=scan[0])
    if per_chunk:
        launch = dict(num_warps=per_chunk[1], num_stages=per_chunk[2])
        for geometry in (per_tile, whole, ut_backward):
            geometry.update(launch)
        ut_backward.update(BW=per_chunk[0])
    return scans, per_tile, whole, ut_backward


def settings(text, count):
    """'64,8,2' → (64, 8, 2), ``count`` integers."""
    values = tuple(int(x) for x in text.split(","))
    if len(values) != count:
        raise SystemExit(f"expected {count} comma-separated integers, got {text!r}")
    return values


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--configs", nargs="+",
                   help="channel block (value channels in forward/dv, key channels in dq/dk; the delta rule's: value "
                        "channels, also of its output adjoint and state gradients), warps, stages (default: 64,8,2 "
                        "128,8,2 64,4,2 32,8,2; the delta rule: its CONFIG)")
    p.add_argument("--ut-configs", nargs="+",
                   help="delta_rule, kda, dplr: the UT backward's channel block, and warps, stages of every kernel "
                        "with one program per chunk and head (default: its UT_CONFIG)")
    p.add_argument("--products-configs", nargs="+",
                   help="kda, dplr: warps, stages of the products' kernels (default: KDA's PRODUCTS_CONFIG; dplr's "
                        "rows' gradient: its ROWS_BACKWARD_CONFIG)")
    p.add_argument("--chunks", nargs="+", type=int, default=[64])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--normalize", default="divisive", choices=sorted(kernels.NORMALIZE_CODES))
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--arch", type=int, default=90, help="compute capability ×10 (90: H100/H200)")
    p.add_argument("--segments", action="store_true",
                   help="the kernels as segmented launches compile them (each program reads its segment from "
                        "the table)")
    p.add_argument("--op", default="linear", choices=sorted(IN_DTYPE),
                   help="linear attention's kernels, decayed linear attention's, the gated delta rule's, KDA's or "
                        "the general diagonal-plus-low-rank rule's (--normalize applies to linear only; the delta "
                        "rule's, KDA's and DPLR's kernels take fp32, TF32 products)")
    a = p.parse_args()
    for chunk in a.chunks:
        if a.op in ("delta_rule", "kda", "dplr"):
            for scan in [settings(c, 3) for c in a.configs] if a.configs else [None]:
                for per_chunk in [settings(c, 3) for c in a.ut_configs] if a.ut_configs else [None]:
                    for products in [settings(c, 2) for c in a.products_configs or []] or [None]:
                        print(f"chunk={chunk} ({a.op}, TF32, sm_{a.arch}, Dk=Dv={a.head_dim}; scans at "
                              f"{scan or 'CONFIG'}, per chunk at {per_chunk or 'UT_CONFIG'}"
                              + (f", products at {products or 'PRODUCTS_CONFIG'})" if a.op != "delta_rule" else ")"),
                              flush=True)
                        show(a, kda_rule_kernels(a, chunk, scan, per_chunk, products) if a.op != "delta_rule"
                             else delta_rule_kernels(a, chunk, scan, per_chunk))
            continue
        for cfg in a.configs or ["64,8,2", "128,8,2", "64,4,2", "32,8,2"]:
            block, warps, stages = settings(cfg, 3)
            print(f"block={block} warps={warps} stages={stages} chunk={chunk} ({a.op}, {'segmented, ' * a.segments}"
                  f"{'' if a.op == 'decayed' else a.normalize + ', '}{a.dtype}, sm_{a.arch}, D={a.head_dim})",
                  flush=True)
            show(a, ((name, fn, dict(c, num_warps=warps, num_stages=stages))
                     for name, fn, c in linear_kernels(a, block, chunk)))


def show(a, found):
    """One line per (name, kernel, constexprs with num_warps and num_stages), with its launch settings (and the
    delta rule's channel blocks)."""
    for name, fn, constexprs in found:
        constexprs = dict(constexprs)
        warps, stages = constexprs.pop("num_warps"), constexprs.pop("num_stages")
        blocks = "".join(f", {label} {constexprs[key]}" for key, label in (("BV", "value block"),
                                                                           ("BW", "channel block"))
                         if a.op in ("delta_rule", "kda", "dplr") and key in constexprs)
        print(f"  {name:12s} {report(fn, constexprs, warps, stages, a.arch, a.dtype, a.op)}  "
              f"({warps} warps, {stages} stages{blocks})", flush=True)


if __name__ == "__main__":
    main()
