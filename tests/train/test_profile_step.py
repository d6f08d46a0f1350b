"""tools/profile_step.py: a real run's steps under the profiler, their time by category (tools/step_categories.py)."""
import json
import os
import subprocess

import pytest
import torch

from pretrain import scopes

from launching import PYTHON, REPO, tiny_overrides


@pytest.mark.dist
def test_a_tiny_runs_step_is_accounted_for_by_category(lm_data, tmp_path):
    """One gloo rank, DeepSpeed ZeRO as tiny_lm.yaml has it: the categories add up to the profiled steps' time by
    the tool's own clock, the named ones are there, and the figures are the trainer's."""
    overrides = [o for o in tiny_overrides(lm_data, tmp_path / "run") if not o.startswith("deepspeed.zero_stage")]
    done = subprocess.run([PYTHON, "tools/profile_step.py", "--config", "configs/tiny_lm.yaml", "--steps", "2",
                           "--warmup", "1", "--out", str(tmp_path / "profile"), "--peak-tflops", "1", *overrides],
                          cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "profile" / "profile.json").read_text())
    trace = json.loads((tmp_path / "profile" / "trace.json").read_text())
    assert report["zero_stage"] == 1 and trace["traceEvents"]

    rows = {key: row["ms_per_step"] for key, row in report["categories"].items()}
    assert sum(rows.values()) == pytest.approx(report["profiled_step_ms"], rel=0.05)
    for key in ("mixer", "matmul", "elementwise", "loss", "optimizer", "communication"):
        assert rows[key] > 0, key
    assert min(rows.values()) >= 0

    figures = report["throughput"]
    assert figures["train/tokens_per_s"] > 0
    assert report["train_flops_per_token"] == pytest.approx(
        3 * sum(part["per_token"] for part in report["forward_flops"].values()))
    assert report["mfu"] == pytest.approx(figures["train/flops_per_s_per_rank"] / 1e12)
    assert "SoftmaxAttention" in report["forward_flops"] and "Four projections" in done.stdout
    assert "mixer ops" in done.stdout and "MFU" in done.stdout


def test_a_bad_key_is_refused_by_name(load_tool, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    code = load_tool("profile_step").main(["--config", "configs/tiny_lm.yaml", "--out", str(tmp_path),
                                           "train.sequence_length=64"])
    assert code == 2 and "train.sequence_length" in capsys.readouterr().err


def test_scopes_cost_nothing_unless_a_profiler_records():
    assert isinstance(scopes.scope(scopes.MIXER), type(scopes._NOTHING))
    with torch.profiler.profile() as prof:
        with scopes.scope(scopes.MIXER):
            torch.ones(2).sum()
    assert any(event.name == scopes.MIXER for event in prof.events())


def _trace(*events):
    """A Chrome trace of ``(phase, cat, name, tid, ts, dur, args)`` events, as kineto writes them."""
    out = []
    for phase, cat, name, tid, ts, dur, args in events:
        event = {"ph": phase, "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts}
        if phase == "X":
            event.update(dur=dur, args=args)
        else:
            event["id"] = args["id"]
        out.append(event)
    return {"traceEvents": out}


def test_device_time_goes_to_the_launching_ops_category(load_tool):
    """CUDA: kernels by the op that launched them (a backward kernel by its forward op's region), an overlapped
    collective counted once as compute, and the time no kernel runs as the device waiting on the host."""
    categories = load_tool("step_categories")
    launch = lambda ts, correlation: ("X", "cuda_runtime", "cudaLaunchKernel", 1, ts, 1, {"correlation": correlation})
    trace = _trace(
        ("X", "user_annotation", "ProfilerStep#1", 1, 0, 100, {}),
        ("X", "user_annotation", "mixer", 1, 5, 25, {}),
        ("X", "cpu_op", "aten::linear", 1, 6, 4, {}), launch(7, 1),
        ("X", "cpu_op", "aten::bmm", 1, 12, 8, {}), launch(13, 2),
        ("X", "cpu_op", "c10d::allreduce_", 1, 40, 5, {}), launch(41, 3),
        ("X", "user_annotation", "optimizer", 1, 70, 20, {}),
        ("X", "cpu_op", "aten::_foreach_add_", 1, 71, 9, {}), launch(72, 5),
        # autograd's thread: the bmm's backward, joined to its forward op by a fwdbwd flow
        ("X", "cpu_op", "autograd::engine::evaluate_function: BmmBackward0", 2, 50, 10, {}),
        ("X", "cpu_op", "BmmBackward0", 2, 50.5, 8.5, {}),
        ("X", "cuda_runtime", "cudaLaunchKernel", 2, 51, 1, {"correlation": 4}),
        ("s", "fwdbwd", "fwdbwd", 1, 12, 0, {"id": 7}), ("f", "fwdbwd", "fwdbwd", 2, 50.5, 0, {"id": 7}),
        ("X", "kernel", "gemm", 7, 10, 10, {"correlation": 1}),
        ("X", "kernel", "bmm_kernel", 7, 20, 15, {"correlation": 2}),
        ("X", "kernel", "ncclDevKernel_AllReduce_Sum_f32", 20, 30, 20, {"correlation": 3}),
        ("X", "kernel", "bmm_backward_kernel", 7, 55, 10, {"correlation": 4}),
        ("X", "kernel", "multi_tensor_apply_kernel", 7, 75, 10, {"correlation": 5}),
    )
    counted = categories.step_time(trace)
    assert counted.device == "cuda" and counted.steps == 1 and counted.window_us == 100
    assert counted.ms_per_step() == pytest.approx({"mixer": 0.025, "matmul": 0.010, "elementwise": 0, "loss": 0,
                                                   "optimizer": 0.010, "communication": 0.015, "other": 0,
                                                   "host": 0.040})
    assert counted.top("mixer", 5) == [("bmm_kernel", pytest.approx(0.015)),
                                       ("bmm_backward_kernel", pytest.approx(0.010))]
    # the kernels each category launched: what a host-bound step pays for, whatever each one's length
    assert counted.kernels_per_step() == {"mixer": 2, "matmul": 1, "elementwise": 0, "loss": 0, "optimizer": 1,
                                          "communication": 1, "other": 0, "host": 0}
    # what the host's main thread does meanwhile: each op's self time (its launches aside), the rest between ops
    assert counted.ms_per_step(host=True) == pytest.approx({"mixer": 0.007, "matmul": 0.003, "elementwise": 0,
                                                            "loss": 0, "optimizer": 0.008, "communication": 0.004,
                                                            "other": 0, "host": 0.078})


def test_a_compiled_blocks_kernels_go_by_what_launched_them(load_tool):
    """train.compile: no regions inside a compiled graph, so our custom op's kernels are mixer ops (its matmuls
    too), the graph's matmuls are matmuls, and inductor's fused kernels are elementwise; forward and backward."""
    categories = load_tool("step_categories")
    launch = lambda tid, ts, correlation: ("X", "cuda_runtime", "cuLaunchKernel", tid, ts, 1,
                                          {"correlation": correlation})
    graph = "## Call CompiledFxGraph fhzguny5qk3f5xoe ##"
    trace = _trace(
        ("X", "user_annotation", "ProfilerStep#1", 1, 0, 100, {}),
        ("X", "cpu_op", "Torch-Compiled Region: 0/0", 1, 1, 40, {}),
        ("X", "cpu_op", graph, 1, 2, 38, {}),
        launch(1, 3, 1),  # a fused norm
        ("X", "cpu_op", "aten::mm", 1, 5, 3, {}), launch(1, 6, 2),
        ("X", "cpu_op", "pretrain::delta_rule", 1, 10, 20, {}),
        ("X", "cpu_op", "aten::mm", 1, 11, 3, {}), launch(1, 12, 3),  # a matmul inside our op's chunk form
        launch(1, 20, 4),  # our Triton kernel
        ("X", "cpu_op", "CompiledFunctionBackward", 2, 50, 30, {}),
        ("X", "cpu_op", graph.replace("fhzg", "fyvk"), 2, 51, 28, {}),
        ("X", "cpu_op", "pretrain::delta_rule_backward", 2, 52, 10, {}), launch(2, 53, 5),
        launch(2, 70, 6),  # a fused kernel of the backward graph
        ("X", "kernel", "triton_red_fused_rms_norm_0", 7, 4, 4, {"correlation": 1}),
        ("X", "kernel", "nvjet_sm90_tst_256x128", 7, 8, 6, {"correlation": 2}),
        ("X", "kernel", "cutlass_gemm", 7, 14, 6, {"correlation": 3}),
        ("X", "kernel", "_chunk_kernel", 7, 21, 9, {"correlation": 4}),
        ("X", "kernel", "_chunk_backward_kernel", 7, 54, 12, {"correlation": 5}),
        ("X", "kernel", "triton_poi_fused_mul_1", 7, 71, 3, {"correlation": 6}),
    )
    counted = categories.step_time(trace).ms_per_step()
    assert counted == pytest.approx({"mixer": 0.027, "matmul": 0.006, "elementwise": 0.007, "loss": 0,
                                     "optimizer": 0, "communication": 0, "other": 0, "host": 0.060})


def test_cpu_time_is_each_ops_self_time_and_waiting_on_gloo_is_communication(load_tool):
    """CPU: the main thread's ops by their self time (an op inside another counts once), the time outside its ops
    while gloo's thread runs a collective as communication, the rest as host. The step's mark may sit on a thread
    of its own (kineto puts it there in some versions)."""
    trace = _trace(
        ("X", "user_annotation", "ProfilerStep#1", 5, 0, 100, {}),
        ("X", "user_annotation", "mixer", 1, 10, 30, {}),
        ("X", "cpu_op", "aten::bmm", 1, 12, 18, {}),
        ("X", "cpu_op", "aten::copy_", 1, 14, 6, {}),
        ("X", "cpu_op", "aten::linear", 1, 30, 8, {}),
        ("X", "cpu_op", "c10d::allreduce_", 1, 50, 2, {}),
        ("X", "user_annotation", "gloo:all_reduce", 9, 50, 20, {}),
    )
    counted = load_tool("step_categories").step_time(trace)
    assert counted.device == "cpu"
    assert counted.ms_per_step() == pytest.approx({"mixer": 0.018, "matmul": 0.008, "elementwise": 0, "loss": 0,
                                                   "optimizer": 0, "communication": 0.020, "other": 0,
                                                   "host": 0.054})
    assert counted.top("mixer", 5) == [("aten::bmm", pytest.approx(0.012)), ("aten::copy_", pytest.approx(0.006))]


def test_a_trace_without_steps_is_refused(load_tool):
    with pytest.raises(ValueError, match="ProfilerStep"):
        load_tool("step_categories").step_time(_trace(("X", "cpu_op", "aten::mm", 1, 0, 5, {})))
