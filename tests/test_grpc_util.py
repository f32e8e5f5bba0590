"""gRPC plumbing (services/rpc/grpc_util.py) against servers running in their own processes."""

from __future__ import annotations

import ipaddress
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from conftest import HELPERS_DIR, PYTHON
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.contracts.gen.tandem.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
)
from services.rpc.grpc_util import open_channel, wait_healthy
from services.rpc.ports import free_port

TOKEN = "s3cret-token"


@dataclass
class Server:
    proc: subprocess.Popen
    port: int

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


def start(*args: str) -> Server:
    proc = subprocess.Popen(
        [PYTHON, str(HELPERS_DIR / "grpc_server.py"), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stderr is not None
    line = proc.stdout.readline()
    if not line.startswith("TANDEM_READY test-server "):
        proc.kill()
        raise AssertionError(f"helper server did not start: {line!r} {proc.stderr.read()}")
    return Server(proc, int(line.split()[-1]))


def stop(server: Server) -> int:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(timeout=20)
    assert server.proc.stdout is not None and server.proc.stderr is not None
    server.proc.stdout.close()
    server.proc.stderr.close()
    return code


@pytest.fixture(scope="module")
def plain():
    server = start("--max-message-mb", "1")
    yield server
    stop(server)


@pytest.fixture(scope="module")
def authed():
    server = start("--auth-token", TOKEN)
    yield server
    stop(server)


def health(target: str, service: str = "") -> int:
    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def rpc_error(fn, *args, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        fn(*args, **kw)
    return err.value


# ---- health and reflection ----------------------------------------------------------------------------


def test_health_reports_serving_for_the_server_and_each_service(plain):
    wait_healthy(plain.target, timeout_s=10)
    wait_healthy(plain.target, timeout_s=10, service="tandem.v1.Coordinator")
    serving = health_pb2.HealthCheckResponse.SERVING
    assert health(plain.target) == serving
    assert health(plain.target, "tandem.v1.Coordinator") == serving
    assert health(plain.target, "tandem.v1.Rollout") == serving
    err = rpc_error(health, plain.target, "tandem.v1.Nope")
    assert err.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_and_describes_the_services(plain):
    with grpc.insecure_channel(plain.target) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="tandem.v1.Coordinator"),
        ]
        listed, described = list(stub.ServerReflectionInfo(iter(requests), timeout=5))
    names = {s.name for s in listed.list_services_response.service}
    assert names == {
        "tandem.v1.Coordinator",
        "tandem.v1.Rollout",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    assert described.file_descriptor_response.file_descriptor_proto  # what `grpcurl describe` needs


def test_a_call_and_a_server_stream_work(plain):
    with open_channel(plain.target) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        assert stub.GetStatus(common_pb2.Empty(), timeout=5).state == "running"
        events = list(stub.WatchEvents(coordinator_pb2.WatchRequest(), timeout=5))
    assert [e.rollout_id for e in events] == [0, 1, 2]


# ---- auth ------------------------------------------------------------------------------------------------


def test_bearer_token_is_required_except_for_health_and_reflection(authed):
    with grpc.insecure_channel(authed.target) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        err = rpc_error(stub.GetStatus, common_pb2.Empty(), timeout=5)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "services.auth_token" in err.details()
        err = rpc_error(lambda: list(stub.WatchEvents(coordinator_pb2.WatchRequest(), timeout=5)))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        err = rpc_error(
            stub.GetStatus, common_pb2.Empty(), timeout=5, metadata=[("authorization", "Bearer wrong-token")]
        )
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        # Health and reflection stay open (load balancers and grpcurl carry no token).
        assert (
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            == health_pb2.HealthCheckResponse.SERVING
        )
        listed = list(
            reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
        )
        assert "tandem.v1.Coordinator" in {s.name for s in listed[0].list_services_response.service}
    wait_healthy(authed.target, timeout_s=10)

    with open_channel(authed.target, auth_token=TOKEN) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        assert stub.GetStatus(common_pb2.Empty(), timeout=5).run_dir == "helper"
        assert len(list(stub.WatchEvents(coordinator_pb2.WatchRequest(), timeout=5))) == 3
    with open_channel(authed.target, auth_token="wrong") as ch:
        err = rpc_error(coordinator_pb2_grpc.CoordinatorStub(ch).GetStatus, common_pb2.Empty(), timeout=5)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED


# ---- limits and errors -------------------------------------------------------------------------------------


def test_oversized_messages_are_refused_with_resource_exhausted(plain):
    with open_channel(plain.target, max_message_mb=64) as ch:
        stub = rollout_pb2_grpc.RolloutStub(ch)
        small = rollout_pb2.GenerateRequest(prompts=[common_pb2.Prompt(text="x" * 1000)] * 100)
        assert stub.Generate(small, timeout=10).num_samples == 100
        big = rollout_pb2.GenerateRequest(prompts=[common_pb2.Prompt(text="x" * (2 << 20))])  # server limit 1 MiB
        err = rpc_error(stub.Generate, big, timeout=10)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with open_channel(plain.target, max_message_mb=1) as ch:  # a reply over the client limit
        err = rpc_error(rollout_pb2_grpc.RolloutStub(ch).Resume, common_pb2.Empty(), timeout=10)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert rollout_pb2_grpc.RolloutStub(ch).Generate(small, timeout=10).num_samples == 100  # still usable


@pytest.mark.parametrize(
    "method, request_msg, code, details",
    [
        (
            "Eval",
            coordinator_pb2.EvalRequest(timeout_s=-1),
            grpc.StatusCode.INVALID_ARGUMENT,
            "ValueError: timeout_s must be positive, got -1.0",
        ),
        (
            "Pause",
            common_pb2.Empty(),
            grpc.StatusCode.FAILED_PRECONDITION,
            "FailedPrecondition: the run is not started yet",
        ),
        ("Resume", common_pb2.Empty(), grpc.StatusCode.NOT_FOUND, "KeyError: no such step 7"),
        ("Save", common_pb2.Empty(), grpc.StatusCode.NOT_FOUND, "EntryNotFoundError: entry 1-1 is not in stream s"),
        ("Stop", common_pb2.Empty(), grpc.StatusCode.INTERNAL, "RuntimeError: boom"),
    ],
)
def test_map_errors_turns_exceptions_into_status_codes(plain, method, request_msg, code, details):
    with open_channel(plain.target) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        err = rpc_error(getattr(stub, method), request_msg, timeout=5)
        assert err.code() == code and err.details() == details
        assert stub.GetStatus(common_pb2.Empty(), timeout=5).state == "running"  # the server lives on


def test_map_errors_in_a_server_stream(plain):
    with open_channel(plain.target) as ch:
        events = coordinator_pb2_grpc.CoordinatorStub(ch).WatchEvents(
            coordinator_pb2.WatchRequest(include_history=True), timeout=5
        )
        assert next(events).rollout_id == 0
        err = rpc_error(next, events)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details() == "ValueError: history is not kept"


# ---- binding and lifecycle -----------------------------------------------------------------------------------


def listening_addresses(port: int) -> set[str]:
    """Local addresses of LISTEN sockets on `port`, from /proc/net/tcp{,6} (IPv4-mapped shown as IPv4)."""
    found = set()
    for name in ("tcp", "tcp6"):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, port_hex = local.split(":")
            if state != "0A" or int(port_hex, 16) != port:
                continue
            raw = b"".join(bytes.fromhex(addr[i : i + 8])[::-1] for i in range(0, len(addr), 8))  # host-order words
            ip = ipaddress.ip_address(raw)
            mapped = getattr(ip, "ipv4_mapped", None)
            found.add(str(mapped or ip))
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_server_binds_loopback_by_default(plain):
    assert listening_addresses(plain.port) == {"127.0.0.1"}


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_bind_host_is_honoured_and_sigterm_stops_cleanly():
    server = start("--bind-host", "0.0.0.0")
    try:
        assert listening_addresses(server.port) in ({"0.0.0.0"}, {"::"})  # every interface (dual-stack)
        wait_healthy(server.target, timeout_s=10)
    finally:
        assert stop(server) == 0
    assert listening_addresses(server.port) == set()


def test_a_second_server_on_a_taken_port_fails_clearly_and_the_first_keeps_it(plain):
    """SO_REUSEPORT is off: without that, gRPC would let both processes listen and split the connections."""
    second = subprocess.run(
        [PYTHON, str(HELPERS_DIR / "grpc_server.py"), "--port", str(plain.port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode != 0 and "TANDEM_READY" not in second.stdout
    assert f"PortInUse: port {plain.port} on 127.0.0.1 is in use (another tandem run?)" in second.stderr
    for _ in range(20):  # every new connection still reaches the first server
        with grpc.insecure_channel(plain.target) as channel:
            status = coordinator_pb2_grpc.CoordinatorStub(channel).GetStatus(common_pb2.Empty(), timeout=10)
        assert status.run_dir == "helper"
    assert health(plain.target) == health_pb2.HealthCheckResponse.SERVING


def test_wait_healthy_gives_up_with_the_last_error():
    port = free_port()
    with pytest.raises(TimeoutError, match=rf"127.0.0.1:{port} not healthy after 0s \(last: UNAVAILABLE"):
        wait_healthy(f"127.0.0.1:{port}", timeout_s=0.3)
    with pytest.raises(RuntimeError, match="child exited"):
        wait_healthy(f"127.0.0.1:{port}", timeout_s=10, should_abort=lambda: "child exited")
