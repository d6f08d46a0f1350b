"""Shared fixtures. `shared_data`: the real data sets in ../shared/data, skipping the test where they are absent;
`load_tool`: a script of tools/ as a module; `environment_left_as_found`, on every test: no test leaves ``os.environ``
changed for the tests after it.

Without a GPU, Triton kernels run under its CPU interpreter. ``TRITON_INTERPRET`` is read when Triton is first
imported, and torch imports it on the way (``torch.utils.flop_counter`` does): so it is set here, before any test
module is collected, not in the Triton tests themselves.
"""
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"


STEERING = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_EXTENSIONS_DIR",
            "OMP_NUM_THREADS", "TRITON_INTERPRET"}  # what the processes a test starts take from it


@pytest.fixture(autouse=True)
def environment_left_as_found(request):
    """A test that changes ``os.environ`` here changes it for every later test and every process they start: one
    left ``TORCH_EXTENSIONS_DIR`` at its empty temporary folder, and the next test's rank rebuilt DeepSpeed's comm
    op there (a minute). Change it through ``monkeypatch``, which puts it back. Checked: every variable the test
    found, and those that steer ranks; not new ones of libraries (DeepSpeed and inductor add their own on first
    use, in whichever test that is)."""
    before = dict(os.environ)
    yield
    watched = (before.keys() | STEERING) - {"PYTEST_CURRENT_TEST"}  # pytest's own, set for each phase
    changed = sorted(key for key in watched if before.get(key) != os.environ.get(key))
    assert not changed, f"{request.node.nodeid} left os.environ changed: {', '.join(changed)}"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data not present at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def load_tool():
    """``load_tool("eval_ppl")``: tools/eval_ppl.py as a module. tools/ is not a package and its scripts import
    each other by name (``import benchlib``), as they do when run, so tools/ goes on ``sys.path``."""
    tools = str(REPO / "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
