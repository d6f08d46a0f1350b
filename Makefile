# Set-up is part of every target: a fresh clone runs `make demo` or `make test` and nothing else.
VENV ?= .venv
PY := $(VENV)/bin/python
TEST_WORKERS ?= 2  # pytest-xdist processes; each test file runs whole in one (its module fixtures are built once)
STAMP := $(VENV)/.installed-stamp
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup test demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,formats,hf]'  # formats, hf: the input-format and transformers tests run too
	$(PY) -c 'from pretrain.distributed.process_group import build_comm_op; build_comm_op()'  # once, not in a test
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder  # files in the order conftest.py sets

demo: $(STAMP)
	$(PY) tools/demo.py

clean:
	rm -rf $(VENV) runs/demo .pytest_cache
