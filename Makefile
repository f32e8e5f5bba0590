# Two commands on a fresh machine:  `make demo` (set-up + the demo run)  and  `make test` (set-up + the tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_CONFIG ?= examples/digit_max.yaml
# Test modules go to two workers whole (--dist loadscope), so module-scoped services start once.
PYTEST_ARGS ?= -n 2 --dist loadscope

.PHONY: setup demo test lint protos bench clean

setup: $(VENV)/.installed

# torch is pinned so pip takes the CPU wheel on disk instead of a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

demo: setup
	$(BIN)/tandem run $(DEMO_CONFIG) --run-dir runs/demo --init-model

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The gates CI runs before the tests (.ci/run); .pre-commit-config.yaml runs the same on every commit.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

protos: setup
	$(BIN)/python -m services.contracts.protogen

clean:
	rm -rf $(VENV) runs
