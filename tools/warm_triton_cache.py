"""Triton's compile cache for a device session, filled on CPU: the kernels that benchmarks/gpu_session.sh's kernel
tests, op benchmarks, eager training steps and launch-settings stages (segments, sweeps) launch, compiled here for
an H200 (sm_90), so that the device runs them instead of compiling them (the first two sessions spent their minutes
compiling, not running).

Triton keys a compiled kernel by its own build (``triton_key``: version, sources, libtriton's bytes), the kernel's
source and dependencies, the arguments' types and specialization (16-byte alignment, divisibility by 16), the
constexprs and launch options, and the target. This reproduces all of it: it runs under the device image's Python
and packages (3.12, torch 2.11.0, PyPI's triton 3.6.0: the plan's env stage prints the device's ``triton_key``,
which must be this one's), tells Triton it is on an H200 (a driver that names the target and launches nothing),
hands our ops CPU tensors as if they were on the device (``auto`` takes the Triton forms, ``PRECISION`` is the
device's), and makes every launch compile and return. Nothing runs, so outputs are garbage and the kernel tests
run with their checks off (``-O``); what they still stop before (a test that expects an error or a warning) is left
to the device, and so is anything compiled by ``torch.compile`` (inductor needs the device).

    WARM_CACHE=1 bash benchmarks/gpu_prepare.sh   # makes the venv .py312 of those versions, then runs this:
    .py312/bin/python -O tools/warm_triton_cache.py  # into .tritoncache, packed as .gpucache/triton.tgz.a

Prints how many kernels each workload compiled and the archive's size. A group file of Triton's cache names its
kernel's files by absolute path, which Triton checks, so the archive names them where the plan unpacks it
(``DEVICE_CACHE_DIR``). Run it again after a kernel changes: entries whose key is unchanged are kept, and a changed
kernel gets a new entry (clear .tritoncache now and then).
"""
import argparse
import contextlib
import io
import json
import os
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))
os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be Triton's JIT functions, as on the device

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.driver import DriverBase  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from pretrain.atomic import atomic_path  # noqa: E402
from pretrain.cli_help import HelpFormatter  # noqa: E402

DEVICE_TRITON = "3.6.0"  # the H200 image's (torch 2.11.0+cu130)
DEVICE_CACHE_DIR = "/tmp/triton_cache"  # benchmarks/gpu_session.sh's TRITON_CACHE_DIR
PLAN_TESTS = ["tests/ops/test_delta_rule_triton.py", "tests/ops/test_linear_attention_triton.py",
              "tests/ops/test_kda_triton.py", "tests/ops/test_dplr_triton.py",
              "tests/ops/test_decayed_linear_attention_triton.py", "tests/ops/test_short_conv_triton.py"]
BENCH_OPS = ["linear_triton", "decay_triton", "gated_delta_triton", "kda_triton", "dplr_triton", "short_conv_triton"]
# the plan's eager steps (its LM: dim 1024, 8 heads, 4 x 4,096 tokens, bf16), one period of each layer pattern
MODELS = {"configs/lm/linear_1b.yaml": 1, "configs/lm/gdn_hybrid_1b.yaml": 4}


class H200(DriverBase):
    """Triton's view of the device that is not here: the target to compile for, device 0, its stream 0."""

    @classmethod
    def is_active(cls):
        return False

    def map_python_to_cpp_type(self, ty):
        raise NotImplementedError("nothing launches here")

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_benchmarker(self):
        raise NotImplementedError("nothing is timed here")

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def compile_only():
    """Every launch compiles its kernel (into Triton's cache, as the device's first launch would) and returns
    without running it."""
    run = JITFunction.run

    def compile_and_return(kernel, *args, grid, warmup, **kwargs):
        return run(kernel, *args, grid=grid, warmup=True, **kwargs)
    JITFunction.run = compile_and_return


@contextlib.contextmanager
def claiming_cuda():
    """Inside: every tensor says it is on CUDA, for the checks that decide whether a Triton form may run."""
    base = torch._C.TensorBase.is_cuda
    torch.Tensor.is_cuda = property(lambda tensor: True)
    try:
        yield
    finally:
        torch.Tensor.is_cuda = base


def as_on_the_device():
    """Our ops, on CPU tensors, choose and launch what they would on the device: ``auto`` may take a Triton form and
    trusts it (its first-use check launches the check's kernels, as the device's does, then passes), ``PRECISION``
    is the device's, and the wrappers take CPU tensors (``TRITON_INTERPRET=1``, read by them only: the kernels are
    already JIT functions)."""
    import pretrain.ops  # noqa: F401  (every op package, so the loop below finds them)
    from pretrain.ops import first_use
    from pretrain.ops.precision import gpu_dot_precision

    def may_run(original):
        def check(*args, **kwargs):
            with claiming_cuda():
                return original(*args, **kwargs)
        return check

    checked = set()

    def trusted(key, kernel, reference, inputs, **names):
        if key not in checked:  # the device's check, once per key: its kernels launch on its inputs
            checked.add(key)
            first_use._compare(kernel, reference, inputs() if callable(inputs) else inputs)
        return True

    for name, module in list(sys.modules.items()):
        if not name.startswith("pretrain."):
            continue
        if hasattr(module, "dot_precision"):
            module.dot_precision = gpu_dot_precision
        if hasattr(module, "_triton_may_run"):
            module._triton_may_run = may_run(module._triton_may_run)
        if hasattr(module, "first_use_ok"):
            module.first_use_ok = trusted
    os.environ["TRITON_INTERPRET"] = "1"


def kernel_tests(paths):
    """The plan's kernel tests, launching as on the device. Nothing ran, so their checks would stop them before
    their later launches: under ``python -O`` with plain asserts, and ``assert_close`` a no-op, they go on."""
    import pytest
    if not sys.flags.optimize:
        print("(run under python -O: the tests' checks stop them before some of their launches)", flush=True)
    torch.testing.assert_close = lambda *args, **kwargs: None
    pytest.main(["-q", "-p", "no:cacheprovider", "--tb=no", "--no-header", "-rN", "--assert=plain", "-o", "addopts=",
                 *paths])


def bench_ops(names, T=4096, B=8, H=32, D=128):
    """The op table's and op profile's kernels (B=8, H=32, D=128, bf16; every T of the table specializes alike)."""
    import bench_triton_gpu
    bench_triton_gpu.DEV = "cpu"
    ops = bench_triton_gpu.make_ops(B, T, H, D)
    for name in names:
        fwd, fwdbwd = ops[name]()
        fwd()
        fwdbwd()


def launch_sweeps():
    """The plan's launch-settings stages: the segmented linear kernels (one sequence of 16 heads at 32k, cut by the
    rule; 8 of 32 heads forced into segments, at 4k here: a kernel's key holds the heads, not T, so 8 × 32 × 32k
    need not be in memory; the packed rows, linear and decayed), then the sweeps (linear and decayed kernels, the
    delta rule's scans and per-chunk kernels at T=8k): every setting compiles its kernels (one the compiler refused
    would stop this with its error)."""
    import bench_triton_gpu
    bench_triton_gpu.DEV = "cpu"
    results = {}
    bench_triton_gpu.segments(results, shapes=((1, 16, 0),))
    bench_triton_gpu.segments(results, T=4096, shapes=((8, 32, 32),))
    bench_triton_gpu.packed_segments(results)
    bench_triton_gpu.sweep(results)
    bench_triton_gpu.sweep_delta(results)


def eager_steps(configs: dict[str, int], gpudata: Path):
    """One forward and backward of each profiled LM as its eager step runs it (bf16, documents packed as the loader
    packs them), with one period of its layer pattern: the layers repeat the same launches."""
    from omegaconf import OmegaConf

    from pretrain.models import build_lm
    from pretrain.tasks.config_checks import load_run_config

    for path, layers in configs.items():
        cfg = load_run_config(path, ["model.vocab_size=4096", "model.dim=1024", f"model.n_layers={layers}",
                                     "model.n_heads=8", f"data.tokenizer={gpudata}/tok/stdlib.model"])
        model = build_lm(OmegaConf.to_object(cfg.model)).to(torch.bfloat16)
        batch, length = 4, 4096
        ids = torch.randint(0, 4096, (batch, length))
        starts = torch.zeros(batch, length, dtype=torch.bool)
        starts[:, ::997] = True  # documents of 997 tokens, one running across each row's end
        position_ids = torch.arange(length).expand(batch, length) - torch.cummax(
            torch.where(starts, torch.arange(length), 0), dim=1).values
        model(ids, position_ids=position_ids, labels=ids).backward()


def prepare(cache: Path) -> None:
    """This process, from here on: Triton on an H200 compiling into ``cache``, launches that only compile, our ops
    as on the device."""
    cache.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(cache.resolve())
    driver.set_active(H200())
    compile_only()
    as_on_the_device()


def cached(cache: Path) -> int:
    return sum(1 for _ in cache.rglob("__grp__*"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--cache", type=Path, default=REPO / ".tritoncache",
                        help="Triton's cache folder to fill here (TRITON_CACHE_DIR)")
    parser.add_argument("--pack", type=Path, default=REPO / ".gpucache" / "triton.tgz.a",
                        help="the archive the plan carries and restores (benchmarks/gpu_session.sh)")
    parser.add_argument("--gpudata", type=Path, default=REPO / ".gpudata", help="benchmarks/gpu_prepare.sh's data")
    parser.add_argument("--skip", nargs="*", default=[], choices=["tests", "bench", "steps", "sweeps"],
                        help="workloads left out")
    args = parser.parse_args(argv)
    if triton.__version__ != DEVICE_TRITON:
        parser.error(f"the device compiles with triton {DEVICE_TRITON}; this is {triton.__version__}, whose cache it "
                     "would not read (run this under the device image's versions, as the docstring says)")
    prepare(args.cache)
    workloads = {"tests": lambda: kernel_tests(PLAN_TESTS), "bench": lambda: bench_ops(BENCH_OPS),
                 "steps": lambda: eager_steps(MODELS, args.gpudata), "sweeps": launch_sweeps}
    for name, workload in workloads.items():
        if name not in args.skip:
            before, start = cached(args.cache), time.perf_counter()
            workload()
            print(f"{name}: {cached(args.cache) - before} kernels compiled in {time.perf_counter() - start:.0f} s",
                  flush=True)
    pack(args.cache, args.pack)
    print(f"{cached(args.cache)} kernels in {args.cache}; packed into {args.pack} "
          f"({args.pack.stat().st_size / 2**20:.1f} MiB)")
    return 0


def pack(cache: Path, archive: Path) -> None:
    """``cache`` as the archive the plan unpacks into the device's cache folder: a group file names its kernel's
    files by absolute path, which Triton checks, so those paths become the device's (``DEVICE_CACHE_DIR``; a
    kernel's files sit beside its group file, wherever the cache was built or copied). Written whole or not at all,
    so a failure leaves the last archive as it was."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(archive) as partial:
        with tarfile.open(partial, "w:gz") as tar:
            for path in sorted(cache.rglob("*")):
                name = "./" + str(path.relative_to(cache))
                if not (path.is_file() and path.name.startswith("__grp__")):
                    tar.add(path, arcname=name, recursive=False)
                    continue
                group = json.loads(path.read_text())
                folder = f"{DEVICE_CACHE_DIR}/{path.parent.relative_to(cache)}"
                group["child_paths"] = {child: f"{folder}/{Path(at).name}"
                                        for child, at in group["child_paths"].items()}
                data = json.dumps(group).encode()
                info = tar.gettarinfo(path, arcname=name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        for stale in archive.parent.glob("triton.tgz.*"):  # parts of an earlier archive would be read after this one
            if stale not in (archive, partial):
                stale.unlink()


if __name__ == "__main__":
    sys.exit(main())
