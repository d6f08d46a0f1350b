"""The benchmark tools' plumbing, on stub steps: probes in fresh processes and the statuses of those that fail,
timing rounds, a configuration too slow for rounds kept at its probe, the JSON, plot and table, and
tools/bench_attention.py's probe mode. Nothing here measures anything: the figures are the tools' to make."""
import json
import sys
from types import SimpleNamespace

import pytest
import torch


@pytest.fixture
def tools(load_tool):
    return SimpleNamespace(benchlib=load_tool("benchlib"), bench_attention=load_tool("bench_attention"))


@pytest.mark.dist
def test_a_probe_that_fails_becomes_a_status_not_an_exception(tools):
    run = tools.benchlib.run_probe
    python = [sys.executable, "-c"]
    ok = run([*python, "print('log line'); print('{\"fwd_s\": 1, \"fwd_bwd_s\": 2, \"peak_mem_bytes\": 3}')"], "cpu",
             cpu_mem_limit_gb=4, timeout_s=60)
    assert ok == {"status": "ok", "fwd_s": 1, "fwd_bwd_s": 2, "peak_mem_bytes": 3}
    oom = run([*python, "import torch; torch.empty(2**31)"], "cpu", cpu_mem_limit_gb=1.5, timeout_s=120)
    assert oom["status"] == "oom", oom
    error = run([*python, "raise SystemExit('shapes do not match')"], "cpu", cpu_mem_limit_gb=4, timeout_s=60)
    assert error == {"status": "error", "error": "shapes do not match"}
    slow = run([*python, "import time; time.sleep(60)"], "cpu", cpu_mem_limit_gb=4, timeout_s=0.5)
    assert slow["status"] == "timeout"


def stub_step(name: str):
    """A forward over fixed inputs whose output is backpropagated: all a measured configuration needs to be."""
    weight = torch.ones(4, requires_grad=True)
    return lambda: weight * 2


def test_side_by_side_measures_what_fits_and_keeps_the_rest_at_their_probe(tools):
    probes = {"fits": {"status": "ok", "fwd_s": 0.0, "fwd_bwd_s": 0.0, "peak_mem_bytes": 100},
              "too_slow": {"status": "ok", "fwd_s": 40.0, "fwd_bwd_s": 60.0, "peak_mem_bytes": 200},
              "oom": {"status": "oom", "error": "can't allocate memory"}}
    records = tools.benchlib.measure_side_by_side(list(probes), probe_one=probes.__getitem__, build_step=stub_step,
                                                  device="cpu", repeats=3, budget_s=30.0, label="stub")
    assert records["fits"]["status"] == "ok" and records["fits"]["repeats"] == 3
    assert records["fits"]["fwd_ms"] >= 0 and records["fits"]["peak_mem_bytes"] == 100
    assert records["too_slow"] | {"load_avg": None} == {"status": "ok", "fwd_ms": 40e3, "fwd_bwd_ms": 60e3,
                                                        "peak_mem_bytes": 200, "repeats": 1, "load_avg": None}
    assert records["oom"]["status"] == "oom" and records["oom"]["fwd_ms"] is None and records["oom"]["repeats"] == 0


def test_reports_hold_every_record(tools, tmp_path):
    records = [{"mixer": "softmax", "seq_len": 64, "status": "ok", "fwd_ms": 2.0, "fwd_bwd_ms": 6.0,
                "peak_mem_bytes": 2**20, "repeats": 2},
               {"mixer": "linear_chunk", "seq_len": 64, "status": "ok", "fwd_ms": 1.0, "fwd_bwd_ms": 3.0,
                "peak_mem_bytes": 2**20, "repeats": 2},
               {"mixer": "softmax", "seq_len": 16384, "status": "oom", "fwd_ms": None, "fwd_bwd_ms": None,
                "peak_mem_bytes": None, "repeats": 0}]
    args = SimpleNamespace(json=tmp_path / "bench.json", plot=tmp_path / "bench.png", markdown=tmp_path / "bench.md")
    tools.benchlib.write_reports(records, args, "stub", x="seq_len", series="mixer", x_label="sequence length T",
                                 x_header="T", baseline="softmax")
    assert json.loads(args.json.read_text()) == records
    assert args.plot.stat().st_size > 0
    table = args.markdown.read_text()
    assert "| 64 | linear_chunk | 1.0 | 3.0 | 1 | 2.00× | 2 |" in table and "| 16384 | softmax | oom |" in table


def test_bench_attention_probe_mode_prints_one_json_record(tools, capsys):
    tools.bench_attention.main(["--probe", "linear_chunk", "--probe-len", "16", "--heads", "1", "--head-dim", "4",
                                "--threads", "1"])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(record) == {"fwd_s", "fwd_bwd_s", "peak_mem_bytes"}
