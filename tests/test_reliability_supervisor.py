"""`tandem run` itself under faults: killed with kill -9, its coordinator flooded with WatchEvents streams, its
fixed ports already taken by another run. Real processes and a real redis-server throughout."""

from __future__ import annotations

import os
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from reliability_kit import redis_pid, rollout_pid, service_pid, wait_for, wait_running
from tandem_runs import (
    alive,
    checkpoints,
    children_of,
    coordinator_target,
    start_run,
    stop_run,
    supervisor_log,
    wait_status,
)

from services.contracts.gen.tandem.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from services.rpc.grpc_util import open_channel
from services.rpc.ports import free_port

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.timeout(300)]

COMMON = ("loop.eval_interval=null", "loop.save_interval=100", "loop.step_timeout_s=60")


def test_kill_9_of_tandem_run_takes_redis_server_and_every_service_with_it(tmp_path):
    run_dir, everything = tmp_path / "run", set()
    proc = start_run(run_dir, "loop.num_rollout=400", *COMMON)
    try:
        wait_running(run_dir, rollout_id=1)
        named = {
            "redis-server": redis_pid(proc.pid),
            "trainer": service_pid(proc.pid, "trainer"),
            "rollout": rollout_pid(proc.pid, 0),
            "coordinator": service_pid(proc.pid, "coordinator"),
        }
        everything = set(children_of(proc.pid))
        assert set(named.values()) <= everything
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        wait_for(
            lambda: not any(alive(pid) for pid in everything),
            what="the children of the killed supervisor",
            timeout_s=120,
            every_s=0.2,
        )
    finally:
        stop_run(proc)
        for pid in filter(alive, everything):  # some only when the test failed: leave nothing behind
            os.kill(pid, signal.SIGKILL)
    assert "Traceback" not in supervisor_log(run_dir)


def test_idle_watch_streams_beyond_the_limit_are_refused_and_never_starve_the_control_api(tmp_path):
    """More idle WatchEvents streams than the control API has threads (16): GetStatus, health and Ctrl-C's
    graceful Stop still answer; a stream beyond services.max_watch_streams is refused; a closed one frees its slot."""
    run_dir, limit = tmp_path / "run", 24
    proc = start_run(run_dir, "loop.num_rollout=400", f"services.max_watch_streams={limit}", *COMMON)
    try:
        wait_running(run_dir, rollout_id=1)
        target = coordinator_target(run_dir)
        with open_channel(target) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            stub.Pause(common_pb2.Empty(), timeout=30)  # no more step events: the streams sit idle
            wait_status(target, lambda st: st.state == "paused", what="paused")
            accepted, refused = _open_streams(stub, limit + 1)
            # the supervisor's own progress stream holds a slot too
            assert len(accepted) in (limit - 1, limit) and len(refused) == limit + 1 - len(accepted)
            assert {e.code() for e in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert f"{limit} WatchEvents streams are open already (services.max_watch_streams)" in refused[0].details()
            assert stub.GetStatus(common_pb2.Empty(), timeout=10).state == "paused"
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            accepted.pop().cancel()  # the caller goes away: its slot comes back within a second or so
            again = wait_for(lambda: _open_streams(stub, 1)[0], what="a freed stream slot", every_s=0.5)
            code = stop_run(proc, timeout_s=120)  # Ctrl-C: the supervisor's Stop gets through
            # every open stream ends normally with the run, the last events saying so
            assert all(list(call)[-1].message == "finished" for call in [*accepted, *again])
    finally:
        stop_run(proc)
    log = supervisor_log(run_dir)
    assert code == 0, log
    assert "could not reach the coordinator" not in log and checkpoints(run_dir)  # the graceful stop saved


def _open_streams(stub, n: int) -> tuple[list, list[grpc.RpcError]]:
    """Opens n WatchEvents streams with history: an accepted stream sends its first event at once."""
    accepted, refused = [], []
    for _ in range(n):
        call = stub.WatchEvents(coordinator_pb2.WatchRequest(include_history=True))
        try:
            next(call)
            accepted.append(call)
        except grpc.RpcError as exc:
            refused.append(exc)
    return accepted, refused


def test_a_second_run_on_the_same_fixed_ports_fails_clearly_and_the_first_keeps_them(tmp_path):
    ports = {name: free_port() for name in ("coordinator", "trainer", "rollout")}
    fixed = (
        f"services.coordinator.port={ports['coordinator']}",
        f"services.trainer.port={ports['trainer']}",
        f"services.rollout=[{{port: {ports['rollout']}}}]",
    )
    first, second = tmp_path / "first", tmp_path / "second"
    proc = start_run(first, "loop.num_rollout=400", *COMMON, *fixed)
    other = None
    try:
        wait_running(first, rollout_id=1)
        target = f"127.0.0.1:{ports['coordinator']}"
        with open_channel(target) as channel:
            coordinator_pb2_grpc.CoordinatorStub(channel).Pause(common_pb2.Empty(), timeout=30)
        other = start_run(second, "loop.num_rollout=400", *COMMON, *fixed)
        assert other.wait(timeout=240) == 2
        log = supervisor_log(second)
        assert f"tandem run: port {ports['trainer']} on 127.0.0.1 is in use (another tandem run?)" in log, log
        assert "healthy" not in log  # it started nothing (a health check would have reached the first run)
        status = wait_status(target, lambda st: st.state == "paused", what="the first run, untouched")
        assert status.run_dir == str(first)
        assert stop_run(proc, timeout_s=120) == 0, supervisor_log(first)
    finally:
        stop_run(proc)
        if other is not None:
            stop_run(other)
