"""tools/warm_triton_cache.py: our ops on CPU launch as on an H200, every launch compiles for sm_90 into the cache
and runs nothing, and the cache is packed for the device's cache folder. Here with this venv's Triton (the tool
itself insists on the device's version, whose cache keys are the device's; whether they are is for the plan's env
stage to show)."""
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCH = """
import sys
from pathlib import Path
sys.path.insert(0, "tools")
import warm_triton_cache as warm
import torch
warm.prepare(Path(sys.argv[1]))
from pretrain.ops.linear_attention import linear_attention
q, k, v = (torch.rand(1, 100, 2, 32, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
o = linear_attention(q, k, v, cu_seqlens=torch.tensor([0, 37, 100]))  # impl "auto", on CPU tensors
o.float().sum().backward()
# the short convolution with a slice's halo: its backward's branch for the halo's gradient compiles (it once did
# not: a variable reassigned inside an `if` with another shape, which only the compiler refuses)
from pretrain.ops.short_conv import short_conv
x, before = torch.rand(2, 40, 48, requires_grad=True), torch.rand(2, 3, 48, requires_grad=True)
short_conv(x, torch.rand(48, 4), None, before=before).sum().backward()
print(warm.cached(Path(sys.argv[1])))
warm.pack(Path(sys.argv[1]), Path(sys.argv[2]))
"""


def without_interpreter() -> dict:
    """The tool's environment: no TRITON_INTERPRET (this suite sets it), so Triton is its JIT."""
    return {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}


def test_auto_takes_our_kernels_and_each_launch_compiles_for_sm90(tmp_path):
    pytest.importorskip("triton")
    cache = tmp_path / "cache"
    archive = tmp_path / "gpucache" / "triton.tgz.a"
    done = subprocess.run([sys.executable, "-c", LAUNCH, str(cache), str(archive)], cwd=REPO, env=without_interpreter(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    entries = [json.loads(path.read_text()) for path in cache.rglob("*.json") if not path.name.startswith("__grp__")]
    names = {entry["name"] for entry in entries}
    # the first-use check's launches, then the request's: forward and both backward kernels, packed documents
    assert {"_forward_kernel", "_backward_dq_kernel", "_backward_dk_dv_kernel", "_backward_kernel"} <= names, names
    assert all(entry["target"]["arch"] == 90 and entry["target"]["backend"] == "cuda" for entry in entries)
    assert int(done.stdout.split()[-1]) == len(entries) and len(list(cache.rglob("*.cubin"))) == len(entries)
    # the device's PRECISION: bf16 products on the tensor cores, not the interpreter's fp32 stand-in ("ieee")
    forward = next(text for text in (path.read_text() for path in cache.rglob("_forward_kernel.ttir"))
                   if "linear_attention/triton.py" in text)
    assert "inputPrecision = tf32" in forward and "inputPrecision = ieee" not in forward

    # packed for the device's cache folder: each group names its files where the plan unpacks them
    with tarfile.open(archive) as tar:
        members = {member.name for member in tar.getmembers()}
        groups = [json.load(tar.extractfile(name)) for name in members if "/__grp__" in name]
    assert len(groups) == len(entries)
    for group in groups:
        for at in group["child_paths"].values():
            assert at.startswith("/tmp/triton_cache/") and "." + at[len("/tmp/triton_cache"):] in members, at


def test_it_refuses_a_triton_whose_cache_the_device_would_not_read(tmp_path):
    triton = pytest.importorskip("triton")
    if triton.__version__ == "3.6.0":
        pytest.skip("this is the device's Triton")
    done = subprocess.run([sys.executable, "tools/warm_triton_cache.py", "--cache", str(tmp_path)], cwd=REPO,
                          env=without_interpreter(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "3.6.0" in done.stderr and triton.__version__ in done.stderr


PACK = """
import sys
from pathlib import Path
sys.path.insert(0, "tools")
import warm_triton_cache as warm
try:
    warm.pack(Path(sys.argv[1]), Path(sys.argv[2]))
except ValueError as error:
    sys.exit(f"refused: {error}")
"""


def test_a_copied_cache_packs_for_the_device_and_a_failed_pack_keeps_the_last_archive(tmp_path):
    pytest.importorskip("triton")
    cache, gpucache = tmp_path / "copy", tmp_path / "gpucache"
    (cache / "KEY").mkdir(parents=True)
    (cache / "KEY" / "k.cubin").write_bytes(b"cubin")
    # copied from the folder it was built in: the group still names that folder's files
    (cache / "KEY" / "__grp__k.json").write_text(json.dumps({"child_paths": {"k.cubin": "/built/here/KEY/k.cubin"}}))
    gpucache.mkdir()
    (gpucache / "triton.tgz.b").write_bytes(b"a part of an earlier archive")
    pack = [sys.executable, "-c", PACK, str(cache), str(gpucache / "triton.tgz.a")]
    done = subprocess.run(pack, cwd=REPO, env=without_interpreter(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(path.name for path in gpucache.iterdir()) == ["triton.tgz.a"]
    with tarfile.open(gpucache / "triton.tgz.a") as tar:
        group = json.load(tar.extractfile("./KEY/__grp__k.json"))
        assert tar.extractfile("./KEY/k.cubin").read() == b"cubin"
    assert group["child_paths"] == {"k.cubin": "/tmp/triton_cache/KEY/k.cubin"}

    packed = (gpucache / "triton.tgz.a").read_bytes()
    (cache / "KEY" / "__grp__k.json").write_text("{ not json")
    done = subprocess.run(pack, cwd=REPO, env=without_interpreter(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "refused" in done.stderr
    assert sorted(path.name for path in gpucache.iterdir()) == ["triton.tgz.a"]
    assert (gpucache / "triton.tgz.a").read_bytes() == packed
