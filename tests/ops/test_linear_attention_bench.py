"""tools/bench_attention.py end to end on tiny shapes: records, plot and table, and a length that does not fit
recorded as such rather than crashing the run."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_records_every_mixer_and_survives_a_length_that_does_not_fit(tmp_path):
    out = tmp_path / "bench.json"
    # --budget-s is far above what these shapes need, so both are timed in rounds even on a loaded machine.
    # linear_naive builds a [H, T, T] fp32 matrix: 1 GiB at T = 16384, beyond what the probes may map besides torch
    command = [sys.executable, str(ROOT / "tools/bench_attention.py"), "--device", "cpu", "--seq-lens", "64,16384",
               "--mixers", "linear_chunk,linear_naive", "--heads", "1", "--head-dim", "8", "--repeats", "2",
               "--cpu-mem-limit-gb", "1.5", "--budget-s", "30", "--probe-timeout", "120",
               "--json", str(out), "--plot", str(tmp_path / "bench.png"), "--markdown", str(tmp_path / "bench.md")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]

    records = {(r["mixer"], r["seq_len"]): r for r in json.loads(out.read_text())}
    assert set(records) == {(m, t) for m in ("linear_chunk", "linear_naive") for t in (64, 16384)}
    for key in [("linear_chunk", 64), ("linear_naive", 64)]:
        r = records[key]
        assert r["status"] == "ok", r
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["peak_mem_bytes"] > 0 and r["repeats"] == 2
    assert records[("linear_naive", 16384)]["status"] == "oom", records[("linear_naive", 16384)]
    assert records[("linear_naive", 16384)]["fwd_ms"] is None
    assert records[("linear_chunk", 16384)]["status"] == "ok"
    assert (tmp_path / "bench.png").stat().st_size > 0
    table = (tmp_path / "bench.md").read_text()
    assert "| 16384 | linear_naive | oom |" in table
