"""Bad input to every RPC of every service, over the wire as raw bytes: random bytes, truncated valid
messages, wrong wire types, invalid UTF-8, negative/huge/NaN/very long values and very long lists (see
fuzz_kit). Each answer must be a proper status (never UNKNOWN or INTERNAL), the server must keep serving
(health SERVING, a valid request still works afterwards), and a message over services.max_message_mb gets
RESOURCE_EXHAUSTED naming the limit.

The trainer and rollout are `tandem trainer` / `tandem rollout` processes of their own (fuzzing them inside a
run would disturb it); the coordinator is fuzzed inside a real `tandem run`, which must still finish cleanly."""

from __future__ import annotations

import collections
import subprocess
import sys
from typing import Any

import grpc
import pytest
from fuzz_kit import ACCEPTABLE, all_inputs, call_raw, decodes
from grpc_health.v1 import health_pb2, health_pb2_grpc
from reliability_kit import Services, resolved_config_when_written, wait_running
from tandem_runs import REPO, start_run, stop_run, supervisor_log

from services.contracts.gen.tandem.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from services.rpc.grpc_util import open_channel, wait_healthy
from services.rpc.ports import free_port

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.timeout(600)]

LIMIT_MB = 4
# Short waits so requests that are valid but can never complete (Train of batches nobody writes, a publish
# nobody receives, Generate on a paused engine) answer quickly.
OVERRIDES = [
    f"services.max_message_mb={LIMIT_MB}",
    "weights.timeout_s=2",
    "redis.get_timeout_s=1",
    "loop.step_timeout_s=2",
    "rollout.max_request_samples=2048",
    "trainer.export_hf_on_save=false",
    "trainer.keep_last_checkpoints=1",
    "rollout.sampling.max_new_tokens=2",
]
PROMPT = common_pb2.Prompt(text="3 5 =", label="5", group_id=1)
BASES = {  # plausible requests the extreme values are set on, one field at a time
    "Generate": rollout_pb2.GenerateRequest(rollout_id=1, prompts=[PROMPT], n_samples_per_prompt=2),
    "Evaluate": rollout_pb2.EvaluateRequest(name="e", prompts=[PROMPT], n_samples_per_prompt=1),
    "Score": (
        SCORE := reward_pb2.ScoreRequest(
            model="correct", samples=[reward_pb2.RewardSample(prompt="3 5 =", response="5", label="5")]
        )
    ),
    "Train": trainer_pb2.TrainRequest(rollout_id=1, entry_ids=["1-0"], max_staleness=-1),
    "Save": trainer_pb2.SaveRequest(rollout_id=1),
    "PrepareWeightSync/Trainer": trainer_pb2.PrepareWeightSyncRequest(version=1, transport="gloo", engine_world_size=1),
    "ReceiveWeights": rollout_pb2.ReceiveWeightsRequest(
        plan=common_pb2.WeightSyncPlan(
            version=1,
            transport="gloo",
            timeout_s=1,
            trainer_id="someone-else",
            master_addr="127.0.0.1",
            master_port=1,
            world_size=2,
            buckets=[common_pb2.WeightBucket(index=0, dtype="float32", nbytes=4)],
        ),
        rank_offset=1,
    ),
}
# After a call that changes a service's state, put it back so the next inputs meet a serving service.
RESET = {"Pause": "Resume", "PrepareWeightSync": "Resume", "ReleaseMemory": "ResumeMemory", "Offload": "Onload"}


def _base(service: str, method: str):
    return BASES.get(f"{method}/{service}", BASES.get(method))


def fuzz_service(target: str, service_descriptor: Any, *, skip_decodable: tuple[str, ...] = ()) -> dict:
    """Every input to every method; returns {method: Counter of status names}. Asserts as it goes."""
    seen: dict[str, collections.Counter] = {}
    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    with grpc.insecure_channel(target, options=options) as channel:
        for i, method in enumerate(service_descriptor.methods):
            counts = seen.setdefault(method.name, collections.Counter())
            for what, data in all_inputs(method, _base(service_descriptor.name, method.name), seed=i):
                if method.name in skip_decodable and decodes(method, data):
                    continue  # e.g. a valid Stop would end the run under test
                code, details = call_raw(channel, method, data, timeout_s=30)
                counts[code.name] += 1
                assert code in ACCEPTABLE, f"{service_descriptor.name}.{method.name} [{what}]: {code.name}: {details}"
                reset = service_descriptor.methods_by_name.get(RESET.get(method.name, ""))
                if reset is not None and code == grpc.StatusCode.OK:
                    assert call_raw(channel, reset, b"", timeout_s=30)[0] == grpc.StatusCode.OK
            _assert_serving(channel)
    return seen


def _assert_serving(channel: grpc.Channel) -> None:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _assert_oversized_refused(target: str, service_descriptor) -> None:
    method = service_descriptor.methods[0]
    big = b"x" * ((LIMIT_MB + 1) << 20)  # refused on its size, before anyone parses it
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        code, details = call_raw(channel, method, big, timeout_s=30)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
        assert str(LIMIT_MB << 20) in details, details  # "Received message larger than max (N vs. 4194304)"
        _assert_serving(channel)


@pytest.fixture(scope="module")
def standalone(tmp_path_factory, redis_server):
    s = Services(tmp_path_factory.mktemp("fuzz"), redis_server.url, OVERRIDES)
    yield s
    s.close()


def test_fuzz_rollout_service(standalone):
    target = standalone.config.services.rollout[0].target
    seen = fuzz_service(target, rollout_pb2.DESCRIPTOR.services_by_name["Rollout"])
    assert seen["Generate"]["INVALID_ARGUMENT"] > 0 and seen["Generate"]["OK"] > 0
    _assert_oversized_refused(target, rollout_pb2.DESCRIPTOR.services_by_name["Rollout"])
    with open_channel(target) as channel:  # still generating real batches
        stub = rollout_pb2_grpc.RolloutStub(channel)
        reply = stub.Generate(BASES["Generate"], timeout=60)
        assert reply.num_samples == 2 and reply.entry_id
        # a weight plan from another trainer (CUDA IPC handles would come in one) is refused outright
        with pytest.raises(grpc.RpcError) as info:
            stub.ReceiveWeights(BASES["ReceiveWeights"], timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "'someone-else' is not the accepted trainer" in info.value.details()


def test_fuzz_trainer_service(standalone):
    target = standalone.config.services.trainer.target
    seen = fuzz_service(target, trainer_pb2.DESCRIPTOR.services_by_name["Trainer"])
    assert seen["Train"]["INVALID_ARGUMENT"] > 0 and seen["Load"]["INVALID_ARGUMENT"] > 0
    _assert_oversized_refused(target, trainer_pb2.DESCRIPTOR.services_by_name["Trainer"])
    with open_channel(target) as channel:
        stub = trainer_pb2_grpc.TrainerStub(channel)
        assert stub.GetState(common_pb2.Empty(), timeout=10).role == "actor"
        with pytest.raises(grpc.RpcError) as info:  # a Load unpickles: only our own checkpoint directories
            stub.Load(trainer_pb2.LoadRequest(path="/tmp"), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside" in info.value.details()


@pytest.fixture(scope="module")
def reward_service(tmp_path_factory, example_model):
    """`tandem reward` over examples/judge.yaml, its judge the random-init tiny model, as a process of its own."""
    run_dir = tmp_path_factory.mktemp("fuzz-reward")
    port = free_port()
    sets = [*OVERRIDES[:1], f"services.reward.port={port}", f"reward.models.correct.path={example_model}"]
    sets += ["rollout.max_request_samples=64"]
    argv = [sys.executable, "-m", "services.cli", "reward", str(REPO / "examples" / "judge.yaml"), "--run-dir"]
    with open(run_dir / "reward.log", "ab") as log:
        proc = subprocess.Popen(
            [*argv, str(run_dir), *(a for item in sets for a in ("--set", item))],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    target = f"127.0.0.1:{port}"
    try:
        wait_healthy(target, timeout_s=300)
        yield target
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_fuzz_reward_service(reward_service):
    service = reward_pb2.DESCRIPTOR.services_by_name["Reward"]
    seen = fuzz_service(reward_service, service)
    assert seen["Score"]["INVALID_ARGUMENT"] > 0 and seen["Score"]["NOT_FOUND"] > 0 and seen["Score"]["OK"] > 0
    _assert_oversized_refused(reward_service, service)
    with open_channel(reward_service) as channel:  # still scoring
        stub = reward_pb2_grpc.RewardStub(channel)
        reply = stub.Score(BASES["Score"], timeout=60)
        assert len(reply.scores) == 1 and len(reply.verdicts) == 1
        with pytest.raises(grpc.RpcError) as info:
            stub.Score(reward_pb2.ScoreRequest(model="nope", samples=SCORE.samples), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "served: correct" in (info.value.details() or "")
        assert stub.GetState(common_pb2.Empty(), timeout=10).models[0].name == "correct"


def test_fuzz_coordinator_inside_a_run(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_run(run_dir, "loop.num_rollout=100000", "data.eval_max_prompts=4", *OVERRIDES[:1])
    try:
        wait_running(run_dir, rollout_id=1)
        s = resolved_config_when_written(run_dir)["services"]["coordinator"]
        target = f"{s['host']}:{s['port']}"
        service = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"]
        fuzz_service(target, service, skip_decodable=("Stop",))
        _assert_oversized_refused(target, service)
        with open_channel(target) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            assert stub.GetStatus(common_pb2.Empty(), timeout=10).state in ("running", "paused")
            stub.Resume(common_pb2.Empty(), timeout=10)
            assert stub.Stop(common_pb2.Empty(), timeout=10).ok
        assert proc.wait(timeout=120) == 0, supervisor_log(run_dir)
    finally:
        stop_run(proc)


def test_a_weighted_sum_of_a_rule_and_the_judge_through_the_rollouts_client(reward_service):
    """The rollout's side against the real service (beside the fuzzing, to start it once): its gRPC client and
    batcher score `0.5*digit_task + 0.5*judge:correct`, each sample the rule's half plus the judge's own score."""
    from services.contracts.config_loading import load_config
    from services.rollout.reward_client import RewardClient
    from services.rollout.reward_mix import RewardResolver
    from services.rollout.rewards import resolve_reward

    port = reward_service.rpartition(":")[2]
    config = load_config(
        REPO / "examples" / "judge.yaml",
        [f"services.reward.port={port}", "rollout.reward=0.5*digit_task + 0.5*judge:correct"],
    )
    reward = RewardResolver(config, client_factory=RewardClient).resolve(config.rollout.reward)
    prompts, responses, labels = ["3 7 =", "3 7 =", "9 0 =", "0 1 ="], ["7", "3", "9", "x"], ["7", "7", "9", "1"]
    scored = reward.score_detailed(
        prompts=prompts, responses=responses, labels=labels, metadatas=[{}] * 4, tokens=[5] * 4
    )
    with open_channel(reward_service) as channel:
        judged = (
            reward_pb2_grpc.RewardStub(channel)
            .Score(
                reward_pb2.ScoreRequest(
                    model="correct",
                    samples=[
                        reward_pb2.RewardSample(prompt=p, response=r, label=lb)
                        for p, r, lb in zip(prompts, responses, labels, strict=True)
                    ],
                ),
                timeout=60,
            )
            .scores
        )
    rule = resolve_reward("digit_task").score(prompts=prompts, responses=responses, labels=labels, metadatas=[{}] * 4)
    assert rule == [1.0, 0.0, 1.0, 0.0]
    assert scored.values == pytest.approx([0.5 * a + 0.5 * b for a, b in zip(rule, judged, strict=True)])
    assert scored.metrics["reward/digit_task/mean"] == 0.5
    assert scored.metrics["reward/correct/mean"] == pytest.approx(sum(judged) / 4)
