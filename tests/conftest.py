"""Shared fixtures. `shared_data`: the real data sets in ../shared/data, skipping the test where they are absent;
`load_tool`: a script of tools/ as a module; `environment_left_as_found`, on every test: no test leaves ``os.environ``
changed for the tests after it.

Without a GPU, Triton kernels run under its CPU interpreter. ``TRITON_INTERPRET`` is read when Triton is first
imported, and torch imports it on the way (``torch.utils.flop_counter`` does): so it is set here, before any test
module is collected, not in the Triton tests themselves. Under pytest-xdist each worker takes its share of the cores
for torch's threads (``share_the_cores_among_workers``).
"""
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def share_the_cores_among_workers() -> None:
    """Under pytest-xdist each worker would start a thread per core for torch's ops: two workers on two cores ran
    the in-process tests 2-6x slower than with a thread each (each one's threads waiting on the other's). So each
    worker, and every process its tests start, gets its share of the cores, unless ``OMP_NUM_THREADS`` says
    otherwise."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        share = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(share)
        torch.set_num_threads(share)


share_the_cores_among_workers()


def patch_triton_language_once_per_launch() -> None:
    """Triton's CPU interpreter patches ``triton.language`` when a kernel launches, and again at every call of a
    ``@triton.jit`` helper inside the kernel (3.x's ``InterpretedFunction.__call__``): ``inspect.getmembers`` of each
    language module, 30,893 times in the linear kernel's tests, the top entry of their profile. Inside a launch that
    has patched every language module the helper sees, the second patch finds nothing left to patch, and is skipped
    here (the linear and delta-rule kernels' tests: 111 s -> 94 s). A Triton without these internals is left as is."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_lang, executor = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or executor is None:
        return
    launch, language = executor.__call__, (interpreter.tl, interpreter.tl.core)
    running = {"launch": False, "patched": None}  # during a launch, the language modules it patched

    def languages(fn) -> set[int]:
        return {id(value) for value in fn.__globals__.values() if any(value is module for module in language)}

    def patch_unless_patched(fn):
        if running["patched"] is not None and languages(fn) <= running["patched"]:
            return None  # a helper's call inside the launch (which ignores what this returns)
        scope = patch_lang(fn)
        if running["launch"] and running["patched"] is None:  # the launch's own patch, before its kernel runs
            running["patched"] = languages(fn)
        return scope

    def launch_patching_once(self, *args, **kwargs):
        running["launch"] = True
        try:
            return launch(self, *args, **kwargs)
        finally:
            running.update(launch=False, patched=None)

    interpreter._patch_lang = patch_unless_patched
    executor.__call__ = launch_patching_once


if os.environ.get("TRITON_INTERPRET") == "1":
    patch_triton_language_once_per_launch()

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


def pytest_collection_modifyitems(items):
    """Files whose tests start processes (marked ``dist``) run first: they are the long ones, and a long file handed
    out last keeps one core busy while the other has run out of work. pytest-xdist hands files out in this order only
    with ``--no-loadscope-reorder`` (the Makefile's); by default it starts with the files of the most tests, the
    short in-process ones, and ended on a sweep or a training file."""
    starting_processes = {item.path for item in items if item.get_closest_marker("dist")}
    items.sort(key=lambda item: item.path not in starting_processes)
