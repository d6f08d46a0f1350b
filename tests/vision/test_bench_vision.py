"""tools/bench_vision.py end to end on a tiny backbone: records, plot and table, and a resolution predicted to
outlast the probe timeout recorded as such without being run."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]


def test_bench_records_every_backbone_and_skips_what_cannot_finish(tmp_path):
    preset = tmp_path / "tiny.yaml"
    preset.write_text("task: vision\ndata: {train_shards: unused}\nvision: {num_classes: 10, stage_dims: [16, 16, 16, "
                      "16], stage_depths: [1, 1, 1, 1], stage_heads: [1, 1, 1, 1], mlp_ratio: 1.0}\n")
    out = tmp_path / "bench.json"
    # 8192² is 65536× the pixels of 32²: any 32-px step of 0.5 ms or more predicts past the 30-s probe timeout
    command = [sys.executable, str(ROOT / "tools/bench_vision.py"), "--preset", str(preset), "--resolutions",
               "32,8192", "--backbones", "linear,softmax", "--repeats", "2", "--budget-s", "5", "--probe-timeout", "30",
               "--json", str(out), "--plot", str(tmp_path / "bench.png"), "--markdown", str(tmp_path / "bench.md")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]

    records = {(r["backbone"], r["resolution"]): r for r in json.loads(out.read_text())}
    assert set(records) == {(b, r) for b in ("linear", "softmax") for r in (32, 8192)}
    for name in ("linear", "softmax"):
        small, huge = records[name, 32], records[name, 8192]
        assert small["status"] == "ok", small
        assert small["fwd_ms"] > 0 and small["fwd_bwd_ms"] > 0 and small["peak_mem_bytes"] > 0
        assert small["repeats"] in (1, 2)  # 1 when a loaded machine makes the probe look slower than the budget
        assert huge["status"] == "too_slow" and huge["fwd_ms"] is None, huge
        assert huge["fwd_gflops_per_image"] > 65536 * small["fwd_gflops_per_image"] * 0.99
    assert records["softmax", 8192]["fwd_gflops_per_image"] > 10 * records["linear", 8192]["fwd_gflops_per_image"]
    assert (tmp_path / "bench.png").stat().st_size > 0
    table = (tmp_path / "bench.md").read_text()
    assert "| 8192 | softmax | too_slow |" in table and "| 32 | linear |" in table
