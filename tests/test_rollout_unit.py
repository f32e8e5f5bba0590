"""RolloutService's decisions, with fakes of its parts (no model, no tokenizer, no Redis): the real service, the real
retry ledger (RecentCalls), the real batch building and the real weight receipt, over a fake engine, a fake sample
source and a fake batch writer that record every call in one log.

What is checked: a Generate asks the source once with the request as given (the per-step seed mixed in, the
configured reward), writes one batch holding exactly the source's samples and answers with its counts; a retry gets
the first result without sampling or writing again, a failed call is not remembered, new weights forget every
result; a caller gone away writes nothing; a bad request is refused before any sampling; an Evaluate writes nothing;
ReceiveWeights refuses a foreign trainer before touching the engine and clamps the plan's timeout; memory is released
after the weight receiver's mappings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest
from helpers.scripted_engine import GenerateOnlyEngine

from services.contracts.common_calls import Ack
from services.contracts.config import TandemConfig
from services.contracts.config_loading import config_from_dict
from services.contracts.rollout_calls import (
    EvaluateRequest,
    GenerateRequest,
    GenerateResult,
    MemoryRequest,
    PrepareRequest,
    PrepareResult,
    PromptInput,
    ReceiveRequest,
)
from services.contracts.sampling_spec import SamplingSpec
from services.contracts.weight_plan import WeightSyncPlan
from services.contracts.wire import RolloutBatchData
from services.rollout.builder import RolloutParts
from services.rollout.engines.interface import SampleOutput
from services.rollout.recent_calls import RecentCalls
from services.rollout.samples import SampleRequest, Scored, Scorer, mix_seed
from services.rollout.service import CallerGone, RolloutService
from services.rollout.tokenizer import Texts
from services.rollout.weight_receipt import WeightReceipt
from services.weights.transport_base import SyncStats

Log = list[tuple[object, ...]]
STREAM = "tandem:unit"


def make_config(**rollout: object) -> TandemConfig:
    return config_from_dict(
        {
            "run_name": "unit",
            "model": {"path": "unused"},
            "data": {"train_path": "unused.jsonl"},
            "rollout": {"n_samples_per_prompt": 2, "max_request_samples": 64, **rollout},
            "weights": {"timeout_s": 30, "trainer_id": "actor-0"},
        }
    )


class FakeTexts(Texts):
    """Prompts arrive as token ids here; decoding writes the ids out."""

    def __init__(self) -> None:
        pass

    def model_inputs(self, prompts: Sequence[object]) -> tuple[list[str], list[list[int]]]:
        assert not prompts, "every prompt of these tests carries token ids"
        return [], []

    def decode(self, token_ids: Sequence[int]) -> str:
        return " ".join(map(str, token_ids))


class FakeEngine(GenerateOnlyEngine):
    """Records the calls the service makes beside generation (the source generates in these tests)."""

    def __init__(self, log: Log):
        super().__init__(max_context=32, version=3)
        self.log = log

    def _generate_admitted(self, prompts, sampling, budgets):
        raise AssertionError("the fake source generates by itself")

    def receive_weights(self, plan, *, rank_offset, receiver):
        self.log.append(("engine.receive_weights", plan.version, plan.timeout_s, rank_offset))
        self._version = plan.version
        return SyncStats(version=plan.version, bytes=12, seconds=0.5, checksums={"w": "c"})

    def pause(self, mode="drain", *, timeout_s=None):
        self.log.append(("engine.pause", mode, timeout_s))

    def resume(self):
        self.log.append(("engine.resume",))

    def release_memory(self, tags=()):
        self.log.append(("engine.release_memory", tuple(tags)))

    def resume_memory(self, tags=()):
        self.log.append(("engine.resume_memory", tuple(tags)))

    def close(self):
        self.log.append(("engine.close",))


class FakeReward:
    spec = "fake_reward"

    def score(self, *, prompts, responses, labels, metadatas, timeout_s=None) -> list[float]:
        raise AssertionError("the fake source scores by itself")

    def score_detailed(self, *, prompts, responses, labels, metadatas, timeout_s=None, tokens=None):
        raise AssertionError("the fake source scores by itself")


class FakeSource:
    """Each sample's response is its prompt's last id + 1 and its sample index; reward 1.0 for sample 0, else 0."""

    def __init__(self, log: Log, *, fail: int = 0):
        self.log, self.fail = log, fail

    def reward_for(self, spec: str | None) -> Scorer:
        self.log.append(("source.reward_for", spec))
        return FakeReward()

    def metadata(self) -> Mapping[str, str]:
        return {"source": "fake"}

    def sample(self, request: SampleRequest) -> Scored:
        self.log.append(
            ("source.sample", request.rollout_id, request.n, request.inputs.ids, request.sampling, request.reward.spec)
        )
        if self.fail:
            self.fail -= 1
            raise RuntimeError("the engine fell over")
        outputs = [
            SampleOutput(token_ids=(ids[-1] + 1, j), log_probs=(-0.5, -0.25), finish_reason="stop", weight_version=3)
            for ids in request.inputs.ids
            for j in range(request.n)
        ]
        return Scored(
            prompt_ids=[ids for ids in request.inputs.ids for _ in range(request.n)],
            outputs=outputs,
            rewards=[1.0 if j == 0 else 0.0 for _ in request.inputs.ids for j in range(request.n)],
            responses=[""] * len(outputs),
            generate_s=0.25,
            reward_s=0.125,
        )


class FakeWriter:
    def __init__(self, log: Log):
        self.log = log
        self.batches: list[RolloutBatchData] = []

    def put(self, batch: RolloutBatchData, *, stream: str, trace_context: dict[str, str]) -> str:
        self.batches.append(batch)
        self.log.append(("writer.put", stream, batch.rollout_id))
        return f"{len(self.batches)}-0"

    def close(self) -> None:
        self.log.append(("writer.close",))


def make_service(log: Log, *, config: TandemConfig | None = None, fail: int = 0) -> RolloutService:
    config = config or make_config()
    engine = FakeEngine(log)
    return RolloutService(
        RolloutParts(
            config=config,
            replica=0,
            producer="rollout-0",
            stream=STREAM,
            texts=FakeTexts(),
            engine=engine,
            source=FakeSource(log, fail=fail),
            writer=FakeWriter(log),
            weights=WeightReceipt(config, engine=engine, replica=0),
            recent=RecentCalls(),
        )
    )


def prompts(*groups: int) -> tuple[PromptInput, ...]:
    return tuple(PromptInput(token_ids=(5, g), label=str(g), group_id=g) for g in groups)


def test_generate_samples_once_writes_the_sources_samples_and_answers_with_their_counts():
    log: Log = []
    service = make_service(log)
    sampling = SamplingSpec(temperature=1.0, max_new_tokens=4, seed=11)
    result = service.generate(GenerateRequest(rollout_id=7, prompts=prompts(1, 2), sampling=sampling.params()))
    assert log == [
        ("source.reward_for", None),
        ("source.sample", 7, 2, [[5, 1], [5, 2]], sampling.with_seed(mix_seed(11, 7)), "fake_reward"),
        ("writer.put", STREAM, 7),
    ]
    assert isinstance(service.parts.writer, FakeWriter)
    [batch] = service.parts.writer.batches
    assert batch.group_ids.tolist() == [1, 1, 2, 2]
    assert batch.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert batch.metadata == {
        "reward": "fake_reward",
        "engine": "scripted",
        "n_samples_per_prompt": "2",
        "temperature": "1.0",
        "source": "fake",
    }
    assert (result.entry_id, result.num_samples, result.num_groups, result.informative_groups) == ("1-0", 4, 2, 2)
    assert (result.num_prompt_tokens, result.num_response_tokens, result.weight_version) == (8, 8, 3)
    assert (result.generate_time_s, result.reward_time_s, result.producer) == (0.25, 0.125, "rollout-0")


def test_a_retry_gets_the_first_result_and_new_weights_forget_it():
    log: Log = []
    service = make_service(log)
    first = service.generate(GenerateRequest(rollout_id=1, prompts=prompts(1, 2)))
    assert service.generate(GenerateRequest(rollout_id=1, prompts=prompts(1, 2))) == first
    assert [c[0] for c in log].count("writer.put") == 1
    other = service.generate(GenerateRequest(rollout_id=1, prompts=prompts(1, 2), stream="tandem:other"))  # another key
    assert other.entry_id == "2-0"
    plan = WeightSyncPlan(version=4, trainer_id="actor-0", timeout_s=10, transport="disk")
    service.receive_weights(ReceiveRequest(plan=plan, rank_offset=0))
    again = service.generate(GenerateRequest(rollout_id=1, prompts=prompts(1, 2)))
    assert again.entry_id == "3-0"
    assert [c[0] for c in log].count("source.sample") == 3


def test_a_failed_generate_is_not_remembered():
    log: Log = []
    service = make_service(log, fail=1)
    with pytest.raises(RuntimeError, match="fell over"):
        service.generate(GenerateRequest(rollout_id=0, prompts=prompts(1)))
    result: GenerateResult = service.generate(GenerateRequest(rollout_id=0, prompts=prompts(1)))
    assert result.entry_id == "1-0"
    assert [c[0] for c in log] == [
        "source.reward_for",
        "source.sample",
        "source.reward_for",
        "source.sample",
        "writer.put",
    ]


def test_a_caller_gone_away_gets_no_batch_written():
    log: Log = []
    service = make_service(log)
    with pytest.raises(CallerGone, match="went away"):
        service.generate(GenerateRequest(rollout_id=0, prompts=prompts(1)), caller_active=lambda: False)
    assert "writer.put" not in [c[0] for c in log]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rollout_id": 0, "prompts": ()}, r"Generate\(rollout_id=0\): no prompts given"),
        ({"rollout_id": -1, "prompts": prompts(1)}, "rollout_id must be >= 0, got -1"),
        ({"rollout_id": 0, "prompts": prompts(1, 1)}, "several prompts share group_id 1"),
        ({"rollout_id": 0, "prompts": prompts(1), "n_samples_per_prompt": 65}, "more than rollout.max_request_samples"),
        ({"rollout_id": 0, "prompts": prompts(1), "n_samples_per_prompt": -2}, "n_samples_per_prompt must be >= 1"),
        ({"rollout_id": 0, "prompts": (PromptInput(group_id=3),)}, r"prompt 0 \(group_id 3\) is empty"),
        ({"rollout_id": 0, "prompts": (PromptInput(token_ids=tuple(range(40)), group_id=0),)}, "context holds 32"),
    ],
)
def test_a_bad_generate_is_refused_before_any_sampling(kwargs, message):
    log: Log = []
    with pytest.raises(ValueError, match=message):
        make_service(log).generate(GenerateRequest(**kwargs))
    assert "source.sample" not in [c[0] for c in log]


def test_evaluate_samples_with_the_eval_settings_and_writes_nothing():
    log: Log = []
    service = make_service(log, config=make_config(eval_n_samples_per_prompt=3))
    result = service.evaluate(EvaluateRequest(name="held_out", prompts=prompts(1, 2), reward="math_answer"))
    assert log == [
        ("source.reward_for", "math_answer"),
        (
            "source.sample",
            -1,
            3,
            [[5, 1], [5, 2]],
            SamplingSpec.from_config(service.config.rollout.eval_sampling),
            "fake_reward",
        ),
    ]
    assert result.metrics["held_out/pass@1"] == pytest.approx(1 / 3)
    assert result.weight_version == 3


def test_receive_weights_refuses_a_foreign_trainer_before_the_engine_and_clamps_the_timeout():
    def plan(*, trainer_id: str, timeout_s: float) -> WeightSyncPlan:
        return WeightSyncPlan(version=2, transport="disk", trainer_id=trainer_id, timeout_s=timeout_s)

    log: Log = []
    service = make_service(log)
    with pytest.raises(PermissionError, match="trainer 'intruder' is not the accepted trainer 'actor-0'"):
        service.receive_weights(ReceiveRequest(plan=plan(trainer_id="intruder", timeout_s=5), rank_offset=0))
    with pytest.raises(ValueError, match="rank_offset must be >= 0"):
        service.receive_weights(ReceiveRequest(plan=plan(trainer_id="actor-0", timeout_s=5), rank_offset=-1))
    assert log == []
    result = service.receive_weights(ReceiveRequest(plan=plan(trainer_id="actor-0", timeout_s=999), rank_offset=3))
    assert log == [("engine.receive_weights", 2, 30.0, 3)]  # weights.timeout_s, not the caller's 999
    assert (result.version, result.bytes_received, result.time_s, result.checksums) == (2, 12, 0.5, {"w": "c"})


def test_pause_memory_and_close_reach_the_engine_in_order():
    log: Log = []
    service = make_service(log)
    ready = service.prepare_weight_sync(PrepareRequest(version=5, pause_mode="in_place"))
    assert ready == PrepareResult(ready=True, engine_ranks=1)
    assert service.resume() == Ack(message="resumed")
    assert service.release_memory(MemoryRequest(tags=("kv_cache",))) == Ack(message="released kv_cache")
    assert service.resume_memory(MemoryRequest()) == Ack(message="resumed all")
    service.close()
    assert log == [
        ("engine.pause", "in_place", 30.0),
        ("engine.resume",),
        ("engine.release_memory", ("kv_cache",)),
        ("engine.resume_memory", ()),
        ("writer.close",),
        ("engine.close",),
    ]


def test_a_retry_arriving_while_the_first_call_runs_waits_for_its_result():
    """RecentCalls: the second caller of a key in flight does not compute; it gets the first caller's result."""
    import threading

    calls = RecentCalls[str](size=2)
    started, release = threading.Event(), threading.Event()
    computed: list[str] = []

    def slow() -> str:
        computed.append("first")
        started.set()
        assert release.wait(30)
        return "result"

    results: list[str] = []
    first = threading.Thread(target=lambda: results.append(calls.run("key", slow)))
    first.start()
    assert started.wait(30)
    second = threading.Thread(target=lambda: results.append(calls.run("key", lambda: "recomputed")))
    second.start()
    release.set()
    first.join(30)
    second.join(30)
    assert results == ["result", "result"] and computed == ["first"]
    calls.run("a", lambda: "a")
    calls.run("b", lambda: "b")
    assert len(calls) == 2 and calls.run("key", lambda: "again") == "again"  # the oldest went beyond the bound
