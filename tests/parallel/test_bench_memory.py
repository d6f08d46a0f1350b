"""tools/bench_sequence_parallel.py's variants end to end on a tiny LM: each variant's peak beside the dry run's
estimate for the same setting, and the interleaved speed comparison."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]


def test_variants_are_measured_side_by_side_with_their_estimates(tmp_path):
    out = tmp_path / "bench.json"
    command = [sys.executable, str(ROOT / "tools/bench_sequence_parallel.py"), "--sizes", "1", "--seq-lens", "512",
               "--dim", "16", "--layers", "1", "--vocab", "50", "--doc-len", "100", "--steps", "1",
               "--speed-rounds", "1", "--variant", "plain=", "--variant", "sliced=model.mini_sequence=64",
               "--json", str(out), "--markdown", str(tmp_path / "bench.md")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    memory = {r["variant"]: r for r in result["memory"]}
    assert set(memory) == {"plain", "sliced"}
    assert all(r["status"] == "ok" and r["peak_mem_bytes"] > 0 for r in memory.values())
    assert 0 < memory["sliced"]["estimate_bytes"] < memory["plain"]["estimate_bytes"]
    assert [r["variant"] for r in result["speed"]] == ["plain", "sliced"]
    assert result["speed"][0]["relative"] == 1.0 and result["speed"][1]["tokens_per_s"] > 0
    table = (tmp_path / "bench.md").read_text()
    assert "- sliced: `model.mini_sequence=64`" in table and "| sliced | 1 | 512 |" in table


def test_a_malformed_variant_is_refused():
    done = subprocess.run([sys.executable, str(ROOT / "tools/bench_sequence_parallel.py"), "--variant", "nameonly"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode != 0 and "--variant wants NAME=KEY=VALUE" in done.stderr
