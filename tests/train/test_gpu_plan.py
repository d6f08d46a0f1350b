"""benchmarks/gpu_session.sh, rehearsed: every stage of the device plan reaches its command, and every command is
one the tools accept (flags, op names, test ids, configs and their overrides), so a misspelt one fails here on CPU,
not in a device session's few minutes (the second session lost its first call's five profiles to the script itself).

The script runs for real in its rehearsal mode (``REHEARSE=1``: the tools get ``--dry-run``, pytest collects only)
with ``python3`` on the path a recorder, so the shell's own work (each stage under ``timeout``, the ``profile``
function, the time budget) is what a device call runs; then each recorded command is run here, as its ``python3``
would have: the tools in this process, pytest as a process that collects.
"""
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from launching import PYTHON, REPO

SCRIPT = REPO / "benchmarks" / "gpu_session.sh"
RECORDER = """#!/usr/bin/env bash
# what python3 was asked to run, one file per call, its arguments NUL-separated
printf '%s\\0' "$@" > "$RECORD/$(date +%s%N)-$$"
"""


def rehearse(tmp_path: Path, tokenizer: str, **env) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """The script in rehearsal, its python3 calls recorded → (the run, the calls in the order made)."""
    bin_dir, record, data = tmp_path / "bin", tmp_path / "record", tmp_path / "gpudata"
    for folder in (bin_dir, record, data / "tok"):
        folder.mkdir(parents=True, exist_ok=True)
    (bin_dir / "python3").write_text(RECORDER)
    (bin_dir / "python3").chmod(0o755)
    shutil.copy(tokenizer, data / "tok" / "stdlib.model")
    done = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", RECORD=str(record),
                                   REHEARSE="1", OUT=str(tmp_path / "out"), RES=str(tmp_path / "res"),
                                   GPUDATA=str(data), **env))
    calls = [path.read_bytes().split(b"\0")[:-1] for path in sorted(record.iterdir())]
    return done, [[arg.decode() for arg in call] for call in calls]


def stages() -> dict[str, str]:
    """Each stage's name → the first word of its command (``profile``, ``$PYTEST``, ``$BENCH``, ``bash``)."""
    return dict(re.findall(r"^stage (\w+) \d+ (\S+)", SCRIPT.read_text(), flags=re.M))


@pytest.fixture(scope="module")
def rehearsal(lm_data, tmp_path_factory):
    return rehearse(tmp_path_factory.mktemp("plan"), lm_data["tokenizer"])


def test_every_stage_runs_its_command_within_the_budget(rehearsal):
    done, calls = rehearsal
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ended = dict(re.findall(r"^=== (\w+): rc=(\d+)", done.stdout, flags=re.M))
    assert ended == {name: "0" for name in stages()}, done.stdout[-3000:]
    assert "skipped" not in done.stdout and "rehearsal" in done.stdout
    assert done.stdout.count(" 0 kernels compiled") == len(stages())  # each stage says what it compiled: nothing
    assert not any(call[:2] == ["-m", "pip"] for call in calls), "a rehearsal installs nothing"


def test_every_command_is_one_its_tool_accepts(rehearsal, load_tool, monkeypatch, capsys):
    _, calls = rehearsal
    monkeypatch.chdir(REPO)
    kinds = []
    for call in calls:
        if call[0] == "-c":  # the environment's versions, the closing summary: no arguments of ours
            kinds.append("inline")
        elif call[:2] == ["-m", "pytest"]:
            kinds.append("pytest")
            assert "--collect-only" in call
            collected = subprocess.run([PYTHON, *call], cwd=REPO, capture_output=True, text=True, timeout=300)
            assert collected.returncode == 0, f"{call}:\n{collected.stdout[-3000:]}{collected.stderr[-2000:]}"
        elif call[0] in ("tools/profile_step.py", "tools/bench_triton_gpu.py"):
            kinds.append(call[0])
            assert "--dry-run" in call, call
            tool = load_tool(Path(call[0]).stem)
            assert tool.main(call[1:]) in (0, None), f"{call}: {capsys.readouterr().err[-2000:]}"
            if call[0] == "tools/profile_step.py":  # the run's estimate: the model built, its memory counted
                assert json.loads(capsys.readouterr().out.splitlines()[-1])["memory_per_rank_bytes"] > 0
        else:
            raise AssertionError(f"the plan runs python3 {call[:3]}, which this rehearsal does not know how to check")
    # one call per stage, in the script's order, each of the kind its stage names
    expected = {"profile": "tools/profile_step.py", "$BENCH": "tools/bench_triton_gpu.py", "$PYTEST": "pytest",
                "bash": "inline"}
    assert kinds == [expected[word] for word in stages().values()]

def test_the_second_calls_stages_are_named_as_the_script_names_them(lm_data, tmp_path):
    """The header's ONLY="…" lists exist, and a misspelt name stops the call at once, naming the stages."""
    lists = re.findall(r'ONLY="([a-z0-9_ ]+)"', SCRIPT.read_text())  # not the usage's ONLY="name ..."
    assert lists and all(set(listed.split()) <= set(stages()) for listed in lists), lists
    done, calls = rehearse(tmp_path, lm_data["tokenizer"], ONLY="profile_gdn_compiled profile_gdn_eger")
    assert done.returncode == 2 and not calls
    assert "no stage named profile_gdn_eger" in done.stdout and "profile_gdn_eager" in done.stdout


@pytest.mark.parametrize("argv, message", [
    (["--only", "linear_trition"], "no op named linear_trition"),
    (["--profile", "kda_triton,gdn"], "no op named gdn"),
    (["--bench", "4k"], "comma-separated integers"),
    (["--profile-shape", "8,32"], "B,H,D"),
])
def test_the_kernel_bench_refuses_a_bad_argument_before_it_runs_anything(load_tool, capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        load_tool("bench_triton_gpu").main(["--dry-run", *argv])
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_the_profile_dry_run_names_a_bad_override(load_tool, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    code = load_tool("profile_step").main(["--dry-run", "--config", "configs/lm/gdn_hybrid_1b.yaml",
                                           "model.vocab_size=4096", "train.compiled=true"])
    assert code == 2 and "train.compiled" in capsys.readouterr().err
