"""The installed console commands run their scripts as ``python SCRIPT`` does: arguments, output, exit status."""
import subprocess
import sys
from importlib.metadata import distribution
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent

pytestmark = pytest.mark.dist


def commands() -> dict[str, str]:
    """The console scripts the installed package declares (pyproject's [project.scripts]): name → module:function."""
    found = {e.name: e.value for e in distribution("pretrain").entry_points if e.group == "console_scripts"}
    assert found, "no console scripts installed: pip install -e ."
    return found


@pytest.mark.parametrize("name", sorted(commands()))
def test_every_command_is_installed_and_prints_its_scripts_help(name, tmp_path):
    done = subprocess.run([str(BIN / name), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    script = commands()[name].split(":")[1]
    assert done.stdout.startswith("usage:") and ("pretrain.py" if script == "train" else f"{script}.py") in done.stdout


def test_a_command_keeps_its_scripts_exit_status_and_errors(tmp_path):
    done = subprocess.run([str(BIN / "pretrain-train"), "--config", "absent.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "absent.yaml: config file not found" in done.stderr
