"""`python -m services.rpc.healthcheck HOST:PORT`, the compose health check, against real servers."""

from __future__ import annotations

import subprocess
import time
from concurrent import futures

import grpc
import pytest
from conftest import HELPERS_DIR, PYTHON, REPO_ROOT
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.rpc.ports import free_port


def healthcheck(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "services.rpc.healthcheck", *args], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60
    )


@pytest.fixture
def health_server():
    """A bare grpc.health.v1 server whose status the test sets."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def test_serving_tandem_service_passes_and_a_stopped_one_fails():
    proc = subprocess.Popen(
        [PYTHON, str(HELPERS_DIR / "grpc_server.py")], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT
    )
    assert proc.stdout is not None
    try:
        line = proc.stdout.readline()
        assert line.startswith("TANDEM_READY test-server "), line
        target = f"127.0.0.1:{int(line.split()[-1])}"
        ok = healthcheck(target)
        assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
        named = healthcheck(target, "--service", "tandem.v1.Rollout")
        assert named.returncode == 0, named.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stdout.close()
    gone = healthcheck(target, "--timeout", "1")
    assert gone.returncode == 1 and "UNAVAILABLE" in gone.stderr


def test_not_serving_and_unknown_service_fail(health_server):
    servicer, target = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    out = healthcheck(target)
    assert out.returncode == 1 and "NOT_SERVING" in out.stderr
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck(target).returncode == 0
    unknown = healthcheck(target, "--service", "tandem.v1.Nope")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr


def test_a_port_nobody_listens_on_fails_within_the_timeout():
    start = time.monotonic()
    out = healthcheck(f"127.0.0.1:{free_port()}", "--timeout", "2")
    assert out.returncode == 1 and out.stderr.strip()
    assert time.monotonic() - start < 30
