"""A weight transfer between a real trainer process and a real rollout process (gloo) whose peer is killed
(kill -9) mid-sync — after the engine joined the transfer and while it waits for the trainer's bytes. The
survivor fails within weights.timeout_s with an error naming the phase, the version and the peer; a
restarted peer is re-synced by the next WeightSync.run, checksums verified tensor by tensor. After those failed syncs,
both services still stop within services.timeouts.shutdown_s of a SIGTERM, on a busy machine."""

from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch.distributed as dist
from reliability_kit import Services, wait_for
from stopping import stop_under_load

from services.contracts.gen.tandem.v1 import common_pb2, rollout_pb2, trainer_pb2
from services.coordinator.sync import WeightSync

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.timeout(300)]
DEADLINE_S = 6.0  # weights.timeout_s of these syncs
# The callers' own deadline, well beyond DEADLINE_S: an answer from the service (its error text, not gRPC's
# "Deadline Exceeded") shows the survivor gave up by itself instead of hanging.
CALL_S = DEADLINE_S + 30


@pytest.fixture(scope="module")
def services(tmp_path_factory, redis_server):
    s = Services(
        tmp_path_factory.mktemp("sync"),
        redis_server.url,
        [f"weights.timeout_s={DEADLINE_S}", "weights.check_weight_update_equal=true"],
    )
    yield s
    s.close()


def _start_transfer(s: Services, version: int):
    """Phase prepare by hand, then the engine's ReceiveWeights; returns (plan, its future) once the engine
    has joined (posted `ready` in the trainer's store) and waits for the trainer's go."""
    s.rollout.stub.PrepareWeightSync(rollout_pb2.PrepareReceiveRequest(version=version), timeout=10)
    plan = s.trainer.stub.PrepareWeightSync(
        trainer_pb2.PrepareWeightSyncRequest(version=version, transport="gloo", engine_world_size=1, verify=True),
        timeout=10,
    )
    receive = ThreadPoolExecutor(1).submit(
        s.rollout.stub.ReceiveWeights, rollout_pb2.ReceiveWeightsRequest(plan=plan, rank_offset=1), timeout=CALL_S
    )
    store = dist.TCPStore(plan.master_addr, plan.master_port, is_master=False, timeout=datetime.timedelta(seconds=10))
    ctl = dist.PrefixStore(f"{plan.group_name}/ctl", store)
    wait_for(lambda: ctl.check([f"v{version}/ready/1"]), what="the engine joining the transfer", timeout_s=30)
    return plan, receive


def _error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


def test_rollout_killed_mid_sync_trainer_fails_in_time_and_a_restarted_engine_resyncs(services):
    s = services
    sync = WeightSync(trainer=s.trainer, pool=s.pool, config=s.config.weights)
    assert sync.run(version=0).verified_tensors > 0
    plan, receive = _start_transfer(s, version=1)
    s.kill("rollout")
    err = _error(lambda: s.trainer.stub.PublishWeights(trainer_pb2.PublishWeightsRequest(version=1), timeout=CALL_S))
    assert err.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE), err
    assert err.details().startswith("WeightSync"), err.details()  # the trainer's own error
    assert "gloo weight sync v1 failed on the trainer" in err.details() and "engine rank(s) [1]" in err.details()
    gone = _error(receive.result)  # the coordinator's side of the engine
    assert gone.code() == grpc.StatusCode.UNAVAILABLE
    s.restart("rollout")
    result = sync.run(version=2)  # a fresh engine: the group is rebuilt
    assert result.verified_tensors == len({m.name for b in plan.buckets for m in b.tensors})
    assert s.rollout.stub.GetState(common_pb2.Empty(), timeout=10).weight_version == 2


def test_trainer_killed_mid_sync_engine_fails_in_time_and_a_restarted_trainer_resyncs(services):
    s = services
    sync = WeightSync(trainer=s.trainer, pool=s.pool, config=s.config.weights)
    assert sync.run(version=3).verified_tensors > 0
    _plan, receive = _start_transfer(s, version=4)
    s.kill("trainer")
    err = _error(receive.result)
    assert err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), err
    assert err.details().startswith("WeightSync"), err.details()  # the engine's own error
    assert "gloo weight sync v4 failed on the engine rank 1" in err.details()
    assert "trainer rank 0 at 127.0.0.1" in err.details()
    s.rollout.stub.Resume(common_pb2.Empty(), timeout=10)  # as WeightSync does after a failure
    s.restart("trainer")
    assert sync.run(version=4).verified_tensors > 0  # same engine, new trainer and group


def test_after_failed_syncs_both_services_stop_within_budget_when_another_thread_takes_the_sigterm(services):
    """Every core busy, and the SIGTERM taken by a thread other than the main one (as the kernel does when another
    thread is starting a thread): each service still logs its stop and exits 0 within shutdown_s."""
    s = services
    budget_s = s.config.services.timeouts.shutdown_s
    for name in ("rollout", "trainer"):
        took_s = stop_under_load(s.procs[name], budget_s=budget_s)
        assert s.procs[name].returncode == 0, (name, s.procs[name].returncode)
        log = (s.run_dir / f"{name}.log").read_text(errors="replace")
        assert "stopping (SIGTERM)" in log, (name, log[-2000:])
        print(f"{name} stopped in {took_s:.2f}s of its {budget_s:g}s budget")
