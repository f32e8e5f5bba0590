"""The real RolloutPool, RetryPolicy and WeightSync with fake replicas and a fake trainer (no sockets): which replica
a share goes to after a failure, when it is retried and after which pause, and the phases of a weight sync.
tests/test_weight_sync_services.py and tests/test_reliability_*.py run the same pieces against real services."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import grpc
import pytest

from services.contracts.config import ProcessGroupWeights
from services.contracts.rollout_calls import (
    EvaluateRequest,
    EvaluateResult,
    GenerateRequest,
    GenerateResult,
    PrepareResult,
    PromptInput,
    ReceiveRequest,
    ReceiveResult,
    RolloutStatus,
)
from services.contracts.sampling_spec import SamplingSpec
from services.contracts.trainer_calls import PublishResult, WeightSyncRequest
from services.contracts.weight_plan import TensorMeta, WeightBucket, WeightSyncPlan
from services.coordinator.call_errors import ServiceCallError
from services.coordinator.pool import RolloutPool
from services.coordinator.retry import TRAIN_RETRY, TRANSIENT_CODES, RetryPolicy, generate_retry
from services.coordinator.sync import WeightSync, WeightSyncFailed, rank_offsets

UNAVAILABLE, INVALID = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT


class CallLog(list):
    def __call__(self, *entry: Any) -> None:
        self.append(entry)


class FakeClock:
    def __init__(self, log: CallLog):
        self.log, self.now = log, 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.log("sleep", seconds)
        self.now += seconds


class FakeReplica:
    """Fake of one rollout service. `fail`: status codes its next Generate calls raise, in order."""

    def __init__(
        self,
        name: str,
        log: CallLog,
        *,
        fail: list[grpc.StatusCode] | None = None,
        version: int = 0,
        reward: float = 0.0,
        ranks: int = 1,
        checksums: dict[str, str] | None = None,
        fail_prepare: bool = False,
        buckets: list[str] | None = None,
        fail_receive: list[grpc.StatusCode] | None = None,
    ):
        """`checksums`/`buckets`: what it answers a verified receive per tensor / per bucket; `fail_receive`:
        status codes its next receives raise (an engine that found a bucket different answers DATA_LOSS)."""
        self.name, self.log = name, log
        self.fail = list(fail or [])
        self.version = version  # the weight version it generates with and reports
        self.reward, self.ranks, self.checksums, self.fail_prepare = reward, ranks, checksums or {}, fail_prepare
        self.buckets, self.fail_receive = buckets or [], list(fail_receive or [])

    def _raise(self, call: str, code: grpc.StatusCode) -> None:
        raise ServiceCallError(f"{self.name} {call} failed: {code.name}: test", code=code)

    def generate(self, request: GenerateRequest) -> GenerateResult:
        self.log(f"{self.name}.generate", request.rollout_id)
        if self.fail:
            self._raise(f"Generate({request.rollout_id})", self.fail.pop(0))
        return GenerateResult(
            entry_id=f"{self.name}-{request.rollout_id}",
            weight_version=self.version,
            num_samples=len(request.prompts) * request.n_samples_per_prompt,
        )

    def probe(self) -> RolloutStatus:
        self.log(f"{self.name}.probe")
        return RolloutStatus(weight_version=self.version)

    def evaluate(self, request: EvaluateRequest) -> EvaluateResult:
        self.log(f"{self.name}.evaluate", len(request.prompts))
        return EvaluateResult(metrics={"eval/reward_mean": self.reward})

    def prepare_weight_sync(self, *, version: int, pause_mode: str) -> PrepareResult:
        self.log(f"{self.name}.prepare", version)
        if self.fail_prepare:
            self._raise(f"PrepareWeightSync(v{version})", UNAVAILABLE)
        return PrepareResult(ready=True, engine_ranks=self.ranks)

    def receive_weights(self, request: ReceiveRequest) -> ReceiveResult:
        self.log(f"{self.name}.receive", request.plan.version, request.rank_offset)
        if self.fail_receive:
            self._raise(f"ReceiveWeights(v{request.plan.version})", self.fail_receive.pop(0))
        by_bucket = request.plan.verify_by_bucket
        return ReceiveResult(
            version=request.plan.version,
            checksum_s=0.5,
            checksums={} if by_bucket else self.checksums,
            bucket_checksums=tuple(self.buckets) if by_bucket else (),
        )

    def resume(self) -> None:
        self.log(f"{self.name}.resume")

    def wait_healthy(self, timeout_s: float) -> None:
        self.log(f"{self.name}.wait_healthy")

    def release_memory(self, tags: Sequence[str]) -> None:
        self.log(f"{self.name}.release_memory", tuple(tags))

    def resume_memory(self, tags: Sequence[str]) -> None:
        self.log(f"{self.name}.resume_memory", tuple(tags))

    def get_state(self) -> RolloutStatus:
        self.log(f"{self.name}.get_state")
        return RolloutStatus(weight_version=self.version)

    def close(self) -> None:
        self.log(f"{self.name}.close")


def _pool(log: CallLog, replicas: list[FakeReplica], *, max_retries: int = 2) -> RolloutPool:
    def discard(ids: list[str]) -> int:
        log("discard", tuple(ids))
        return len(ids)

    return RolloutPool(replicas, retry=generate_retry(max_retries), clock=FakeClock(log), discard=discard)


def _generate(pool: RolloutPool, rollout_id: int) -> tuple[str, ...]:
    """One prompt: one share, so every call of a generation is made in order, on one thread."""
    return pool.generate(
        rollout_id=rollout_id,
        prompts=[PromptInput(text="1 2 =", label="2")],
        n_samples=2,
        sampling=SamplingSpec(),
        trace_context={},
    ).entry_ids


# ---- the pool: retries of a share ----------------------------------------------------------------------


def test_a_share_that_fails_unavailable_is_retried_on_the_next_replica_after_a_pause():
    log = CallLog()
    pool = _pool(log, [FakeReplica("r0", log, fail=[UNAVAILABLE]), FakeReplica("r1", log)])
    assert _generate(pool, 0) == ("r1-0",)
    assert log == [("r0.generate", 0), ("sleep", 0.5), ("r1.generate", 0)]


def test_a_share_that_fails_invalid_argument_is_not_retried():
    log = CallLog()
    pool = _pool(log, [FakeReplica("r0", log, fail=[INVALID]), FakeReplica("r1", log)])
    with pytest.raises(ServiceCallError, match=r"r0 Generate\(0\) failed: INVALID_ARGUMENT") as info:
        _generate(pool, 0)
    assert info.value.permanent and log == [("r0.generate", 0)]


def test_a_share_failing_on_every_attempt_names_each_failure():
    log = CallLog()
    pool = _pool(
        log, [FakeReplica("r0", log, fail=[UNAVAILABLE]), FakeReplica("r1", log, fail=[UNAVAILABLE])], max_retries=1
    )
    with pytest.raises(ServiceCallError, match=r"r0 Generate\(0\) failed.*; r1 Generate\(0\) failed") as info:
        _generate(pool, 0)
    assert info.value.code == UNAVAILABLE and not info.value.permanent
    assert log == [("r0.generate", 0), ("sleep", 0.5), ("r1.generate", 0)]


def test_a_replica_that_failed_gets_no_share_until_it_holds_the_synced_weights():
    log = CallLog()
    r0, r1 = FakeReplica("r0", log, fail=[UNAVAILABLE], version=2), FakeReplica("r1", log, version=3)
    pool = _pool(log, [r0, r1])
    pool.weights_synced(3)
    assert [_generate(pool, 0), _generate(pool, 1)] == [("r1-0",), ("r1-1",)]
    pool.weights_synced(4)  # the next sync reached every replica: no more suspicion
    r0.version = 4
    assert _generate(pool, 2) == ("r0-2",)
    assert log == [
        ("r0.generate", 0),
        ("sleep", 0.5),
        ("r1.generate", 0),
        ("r0.probe",),
        ("r1.generate", 1),  # r0 restarted with older weights: skipped
        ("r0.generate", 2),
    ]


def test_a_reply_generated_with_weights_older_than_the_synced_ones_is_discarded_and_retried():
    log = CallLog()
    pool = _pool(log, [FakeReplica("r0", log, version=1), FakeReplica("r1", log, version=2)])
    pool.weights_synced(2)
    assert _generate(pool, 5) == ("r1-5",)
    assert log == [("r0.generate", 5), ("discard", ("r0-5",)), ("r1.generate", 5)]


def test_evaluate_splits_the_prompts_and_weights_each_replica_by_its_share():
    log = CallLog()
    pool = _pool(log, [FakeReplica("r0", log, reward=1.0), FakeReplica("r1", log, reward=0.0)])
    prompts = [PromptInput(text=str(i)) for i in range(3)]
    assert pool.evaluate(prompts, n_samples=1, sampling=SamplingSpec()) == {"eval/reward_mean": 2 / 3}
    assert sorted(log) == [("r0.evaluate", 2), ("r1.evaluate", 1)]


# ---- RetryPolicy: one line each ---------------------------------------------------------------------------


def test_retry_pause_grows_linearly_up_to_its_cap():
    assert [generate_retry(5).pause_s(n) for n in range(1, 6)] == [0.5, 1.0, 1.5, 2.0, 2.0]


def test_retry_only_retryable_codes():
    assert [TRAIN_RETRY.retries(c, failures=1, elapsed_s=0) for c in (UNAVAILABLE, INVALID)] == [True, False]


def test_retry_stops_after_its_attempts():
    assert [TRAIN_RETRY.retries(UNAVAILABLE, failures=n, elapsed_s=0) for n in (2, 3)] == [True, False]


def test_retry_stops_after_its_deadline():
    assert not RetryPolicy(attempts=9, retryable=TRANSIENT_CODES, deadline_s=5).retries(
        UNAVAILABLE, failures=1, elapsed_s=5.0
    )


def test_retry_needs_an_attempt():
    with pytest.raises(ValueError, match="attempts must be >= 1"):
        RetryPolicy(attempts=0)


def test_retry_call_pauses_between_attempts_and_returns_the_answer():
    log = CallLog()
    failed = [ServiceCallError(x, code=UNAVAILABLE) for x in "xy"]
    answers: list[ServiceCallError | int] = [*failed, 7]

    def call() -> int:
        answer = answers.pop(0)
        log("call")
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert TRAIN_RETRY.call(call, clock=FakeClock(log)) == 7
    assert log == [("call",), ("sleep", 1.0), ("call",), ("sleep", 2.0), ("call",)]


# ---- WeightSync -------------------------------------------------------------------------------------------


class FakeTrainer:
    """Fake of the trainer's weight-sync calls: a plan of one bucket (checksum `b1`) of one tensor (`c1`); it
    announces the bucket's checksum or the tensor's, as asked."""

    def __init__(self, log: CallLog):
        self.log, self.name = log, "trainer"

    def prepare_weight_sync(self, request: WeightSyncRequest) -> WeightSyncPlan:
        self.log(
            "trainer.prepare", request.version, request.engine_world_size, request.verify, request.verify_by_bucket
        )
        by_bucket = request.verify and request.verify_by_bucket
        tensor = TensorMeta(name="w", dtype="float32", shape=(500,), offset_bytes=0, nbytes=2000)
        return WeightSyncPlan(
            version=request.version,
            transport="gloo",
            buckets=(
                WeightBucket(
                    index=0,
                    dtype="float32",
                    nbytes=2000,
                    tensors=(replace(tensor, checksum="" if by_bucket else "c1"),),
                    checksum="b1" if by_bucket else "",
                ),
            ),
            total_bytes=2000,
            verify=request.verify,
            verify_by_bucket=by_bucket,
            checksum_s=0.25,
        )

    def publish_weights(self, version: int) -> PublishResult:
        self.log("trainer.publish", version)
        return PublishResult(version=version, bytes_sent=2000, time_s=0.25)


def _sync(log: CallLog, replicas: list[FakeReplica], *, verify: bool = True) -> WeightSync:
    return WeightSync(
        trainer=FakeTrainer(log),
        pool=_pool(log, replicas),
        config=ProcessGroupWeights(check_weight_update_equal=verify),
    )


def test_a_sync_prepares_the_engines_then_the_trainer_transfers_verifies_and_resumes():
    log = CallLog()
    sync = _sync(log, [FakeReplica("r0", log, ranks=2, buckets=["b1"])])
    result = sync.run(version=4)
    assert (result.version, result.bytes, result.verified_tensors) == (4, 2000, 1)
    assert log[:2] == [("r0.prepare", 4), ("trainer.prepare", 4, 2, True, True)]  # verified by bucket
    assert sorted(log[2:4]) == [("r0.receive", 4, 1), ("trainer.publish", 4)]  # concurrent
    assert log[4:] == [("r0.resume",)]
    # every phase is timed; publish and receive are the services' own accounts, and so are the checksums
    assert set(result.phase_seconds) == {
        "pause",
        "plan",
        "transfer",
        "publish",
        "receive",
        "verify",
        "resume",
        "checksum",
    }
    assert result.phase_seconds["publish"] == 0.25
    assert result.phase_seconds["checksum"] == 0.25 + 0.5  # the trainer's and the slowest engine's


def test_a_bucket_that_differs_is_sent_again_per_tensor_and_the_error_names_the_tensor_and_replica():
    log = CallLog()
    sync = _sync(log, [FakeReplica("r0", log, buckets=["XX"], checksums={"w": "XX"})])
    with pytest.raises(WeightSyncFailed, match=r"check_weight_update_equal failed on r0: 1 tensors differ \(w\)"):
        sync.run(version=1)
    assert [e for e in log if e[0] == "trainer.prepare"] == [
        ("trainer.prepare", 1, 1, True, True),
        ("trainer.prepare", 1, 1, True, False),
    ]
    assert log.count(("r0.resume",)) == 2 and log[-1] == ("r0.resume",)  # resumed after each attempt


def test_an_engine_that_answers_data_loss_is_rechecked_per_tensor_and_a_clean_resend_passes():
    log = CallLog()
    sync = _sync(
        log, [FakeReplica("r0", log, buckets=["b1"], checksums={"w": "c1"}, fail_receive=[grpc.StatusCode.DATA_LOSS])]
    )
    result = sync.run(version=2)  # the mismatch did not repeat: the sync succeeded
    assert result.verified_tensors == 1
    assert [e for e in log if e[0] == "trainer.prepare"] == [
        ("trainer.prepare", 2, 1, True, True),
        ("trainer.prepare", 2, 1, True, False),
    ]


def test_a_transfer_failing_otherwise_is_not_rechecked():
    log = CallLog()
    sync = _sync(log, [FakeReplica("r0", log, fail_receive=[UNAVAILABLE])])
    with pytest.raises(WeightSyncFailed, match=r"weight transfer of version 3 over gloo failed: .*UNAVAILABLE"):
        sync.run(version=3)
    assert [e[0] for e in log].count("trainer.prepare") == 1


def test_a_sync_failing_in_prepare_says_so_and_resumes_the_engines():
    log = CallLog()
    sync = _sync(log, [FakeReplica("r0", log, fail_prepare=True)])
    with pytest.raises(
        WeightSyncFailed, match="weight sync to version 1 failed in phase prepare: r0 PrepareWeightSync"
    ):
        sync.run(version=1)
    assert log == [("r0.prepare", 1), ("r0.resume",)]


def test_rank_offsets_follow_each_replicas_engine_ranks_after_the_trainer():
    assert rank_offsets([2, 1, 4]) == [1, 3, 4]
