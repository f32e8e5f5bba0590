# Two commands on a fresh machine:  `make demo` (set-up + the demo run)  and  `make test` (set-up + the tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_CONFIG ?= examples/digit_max.yaml
# Test modules go to two workers whole (--dist loadscope), so module-scoped services start once.
PYTEST_ARGS ?= -n 2 --dist loadscope

.PHONY: setup demo test lint protos config-keys bench clean image image-cpu compose-test slurm-test

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

# The container image (deploy/Dockerfile) with docker, else podman: CUDA base by default; image-cpu on Debian
# bookworm with the CPU torch wheel. IMAGE_ARGS: more build flags (--build-arg SGLANG=1 ...).
image:
	deploy/build-image.sh $(IMAGE) -- $(IMAGE_ARGS)

image-cpu: setup
	PYTHON=$(BIN)/python deploy/build-image.sh --cpu $(IMAGE) -- $(IMAGE_ARGS)

# Opt-in runs under real schedulers, not part of `make test` (each installs what it needs, as root, or skips):
# the compose stack in containers (tests/test_compose_run.py) and a job on a one-node Slurm (tests/test_slurm_run.py).
compose-test: setup
	TANDEM_COMPOSE_TEST=1 $(BIN)/python -m pytest -q -s -p no:xdist tests/test_compose_run.py --durations=0

slurm-test: setup
	TANDEM_SLURM_TEST=1 $(BIN)/python -m pytest -q -s -p no:xdist tests/test_slurm_run.py --durations=0

# The gates CI runs before the tests (.ci/run); .pre-commit-config.yaml runs the same on every commit.
lint: setup
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/vulture

protos: setup
	$(BIN)/python -m services.contracts.protogen

# After adding or removing a config key (or changing a default / description): the key list the tests freeze
# (tests/config_keys.txt) and docs/config.md, both generated from the pydantic models.
config-keys: setup
	$(BIN)/python -m services.contracts.config_reference --write

clean:
	rm -rf $(VENV) runs
