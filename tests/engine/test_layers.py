"""Imports run one way: config ← ops/data/parallel ← attention ← models ← distributed ← tasks/estimate ← train.

Read from the source (every ``import``, module-level or inside a function), so an upward import hidden in a
function body to dodge a cycle fails here as surely as one at the top.
"""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pretrain"
# docs/ARCHITECTURE.md: the same ladder; hf on top, so nothing of training imports transformers
LAYER = {"config": 0, "atomic": 0, "cli_help": 0, "resident": 0, "host_memory": 0, "scopes": 0, "exit_codes": 0,
         "ops": 1, "data": 1, "parallel": 1, "attention": 2, "models": 3, "distributed": 4, "tasks": 5, "estimate": 5,
         "train": 6, "cli": 7, "hf": 8}


def layer_of(module: str) -> str | None:
    """``pretrain.models.lm`` → ``models``; None for the package itself."""
    parts = module.removesuffix(".__init__").split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "pretrain" else None


def imported_modules(path: Path) -> list[str]:
    """Every module ``path`` imports, ours and others', relative imports made absolute."""
    here = ["pretrain", *path.relative_to(PACKAGE).with_suffix("").parts]
    if here[-1] == "__init__":
        here.append("")  # a package's relative imports start from the package itself
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[:-node.level] if node.level else []
            found.append(".".join([*base, *(node.module or "").split(".")]).strip("."))
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    unplaced = {layer_of("pretrain." + p.relative_to(PACKAGE).with_suffix("").as_posix().replace("/", "."))
                for p in SOURCES} - {None} - set(LAYER)
    assert not unplaced, f"place {sorted(unplaced)} on the ladder: LAYER here and the table of docs/ARCHITECTURE.md"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_downward(path):
    own = layer_of("pretrain." + path.relative_to(PACKAGE).with_suffix("").as_posix().replace("/", "."))
    if own is None:
        return
    upward = [name for name in imported_modules(path) if (layer := layer_of(name)) and LAYER[layer] > LAYER[own]]
    assert not upward, f"{path.name} ({own}) imports from a layer above it: {upward}"


@pytest.mark.dist
def test_the_schema_is_a_leaf():
    """Importing pretrain.config loads nothing of ours above it (nor DeepSpeed): every layer may import it."""
    code = "import sys, pretrain.config; print(*(m for m in sys.modules if m.startswith(('pretrain', 'deepspeed'))))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "pretrain.config" in loaded
    assert {name for name in loaded if layer_of(name) is not None and LAYER[layer_of(name)] > 0} == set()
    assert not [name for name in loaded if name.startswith("deepspeed")]


def test_the_checker_reads_relative_imports(tmp_path):
    """The test above could pass by reading nothing: a known upward import must be found."""
    found = imported_modules(PACKAGE / "tasks" / "config_checks.py")
    assert "pretrain.models.vision" in found and "pretrain.config" in found
    assert "pretrain.models.layers" in imported_modules(PACKAGE / "models" / "lm.py")


def test_models_take_plain_values_not_omegaconf_nodes():
    """The models are built from pretrain.config's dataclasses; a loaded config converts at the call site."""
    for path in (PACKAGE / "models").glob("*.py"):
        assert not [name for name in imported_modules(path) if name.split(".")[0] == "omegaconf"], path.name

