"""The real Coordinator driven with fakes of its collaborators: no sockets, no processes, well under a second.

The trainer, rollout pool, weight sync, buffer, trackers and clock are fakes (a real trainer needs DeepSpeed and a
model, the real pool gRPC servers: tests/test_run_*.py run those); the data source is the real one over prompts in
memory. Every fake writes what it is asked into one call log, and each case compares that log with the exact
sequence the loop must produce. The pure decisions of policy.py have a one-line test each at the end.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.contracts.config import TandemConfig
from services.contracts.config_loading import config_from_dict
from services.contracts.rollout_calls import GenerateRequest, GenerateResult
from services.contracts.trainer_calls import (
    LoadResult,
    SaveRequest,
    SaveResult,
    TrainerStatus,
    TrainRequest,
    TrainResult,
)
from services.coordinator import policy
from services.coordinator.builder import CoordinatorParts
from services.coordinator.call_errors import ServiceCallError
from services.coordinator.data import DataCursor, DataSource, PromptRecord
from services.coordinator.loop import Coordinator
from services.coordinator.seams import GenerationResult, SyncResult
from services.coordinator.state import GeneratedBatch, RunState, StreamGroup
from services.telemetry.trackers import Tracker

RECORDS = [PromptRecord(text=f"p{i}", label=str(i)) for i in range(8)]  # 4 batches of 2 per epoch
SAMPLES_PER_STEP = 4  # 2 prompts x 2 samples


class CallLog(list):
    def __call__(self, *entry: Any) -> None:
        self.append(entry)


class InlineExecutor(Executor):
    """Runs each task at once, in the caller's thread: the order of calls is the order the loop makes them."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - handed to whoever waits, as a thread pool does
            fut.set_exception(exc)
        return fut


class LazyFuture(Future):
    """A generation that runs when the loop first waits for it: until then it is "still generating"."""

    def __init__(self, fn: Callable[[], Any]):
        super().__init__()
        self.fn = fn

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            try:
                self.set_result(self.fn())
            except Exception as exc:  # noqa: BLE001 - handed to whoever waits, as a thread pool does
                self.set_exception(exc)
        return super().result(timeout)


class LazyExecutor(Executor):
    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        return LazyFuture(lambda: fn(*args, **kwargs))


class FakeClock:
    def __init__(self, log: CallLog):
        self.log, self.now = log, 0.0

    def monotonic(self) -> float:
        self.now += 0.001
        return self.now

    def sleep(self, seconds: float) -> None:
        self.log("sleep", seconds)


class FakeTrainer:
    """Fake of a trainer service. `failures[rollout_id]`: status codes its Train raises, one per call, first."""

    def __init__(
        self,
        name: str,
        log: CallLog,
        *,
        checkpoint: RunState | None = None,
        failures: dict[int, list[grpc.StatusCode]] | None = None,
        on_train: Callable[[int], None] | None = None,
        answers: dict[int, tuple[int, int]] | None = None,
    ):
        self.name, self.log, self.checkpoint = name, log, checkpoint
        self.failures = failures or {}
        self.on_train = on_train
        self.answers = answers or {}  # rollout id -> (samples trained, samples filtered); else SAMPLES_PER_STEP, 0
        self.requests: list[TrainRequest] = []
        self.saved: list[RunState] = []
        self.step = 0

    def wait_healthy(self, timeout_s: float) -> None:
        self.log(f"{self.name}.wait_healthy")

    def load(self) -> LoadResult:
        self.log(f"{self.name}.load")
        if self.checkpoint is None:
            return LoadResult(loaded=False)
        return LoadResult(
            loaded=True, path=f"/ckpt/{self.name}/rollout_1", extra_state={"coordinator": self.checkpoint.to_json()}
        )

    def train(self, request: TrainRequest) -> TrainResult:
        self.log(f"{self.name}.train", request.rollout_id)
        self.requests.append(request)
        if self.on_train is not None:
            self.on_train(request.rollout_id)
        codes = self.failures.get(request.rollout_id, [])
        if codes:
            code = codes.pop(0)
            raise ServiceCallError(f"{self.name} Train({request.rollout_id}) failed: {code.name}", code=code)
        self.step += 1
        trained, filtered = self.answers.get(request.rollout_id, (SAMPLES_PER_STEP, 0))
        return TrainResult(
            rollout_id=request.rollout_id,
            step=self.step,
            metrics={"loss": 0.5},
            entry_ids=request.entry_ids,
            samples_trained=trained,
            samples_dropped_stale=0,
            samples_filtered=filtered,
            time_s=0.0,
        )

    def save(self, request: SaveRequest) -> SaveResult:
        self.log(f"{self.name}.save", request.rollout_id)
        self.saved.append(RunState.from_json(request.extra_state["coordinator"]))
        return SaveResult(
            path=f"/ckpt/{self.name}/rollout_{request.rollout_id}", hf_path="", step=self.step, time_s=0.0
        )

    def offload(self) -> None:
        self.log(f"{self.name}.offload")

    def onload(self) -> None:
        self.log(f"{self.name}.onload")

    def get_state(self) -> TrainerStatus:
        self.log(f"{self.name}.get_state")
        return TrainerStatus(
            role="actor",
            step=self.step,
            last_rollout_id=-1,
            weight_version=0,
            world_size=1,
            zero_stage=0,
            offloaded=False,
            device="cpu",
            samples_trained=0,
            gpu_memory_reserved_bytes=2**30,
        )


class FakePool:
    """Fake of the rollout replicas: the k-th generation of rollout r writes entry `r-a`, `r-b`, ...; the prompts
    whose first group id is g hold `informative[g]` informative groups (default: all of them)."""

    def __init__(self, log: CallLog, *, size: int = 1, informative: dict[int, int] | None = None):
        self.log, self.size = log, size
        self.informative = informative or {}
        self.calls: dict[int, int] = {}

    def wait_healthy(self, timeout_s: float) -> None:
        self.log("pool.wait_healthy")

    def generate(
        self, *, rollout_id: int, prompts: list, n_samples: int, sampling: Any, trace_context: dict[str, str]
    ) -> GenerationResult:
        first = prompts[0].group_id
        self.log("pool.generate", rollout_id, first)  # the first group id names the prompts
        k = self.calls[rollout_id] = self.calls.get(rollout_id, -1) + 1
        reply = GenerateResult(
            entry_id=f"{rollout_id}-{'abcdefgh'[k]}",
            num_samples=len(prompts) * n_samples,
            metrics={"reward_mean": 0.25},
            num_groups=len(prompts),
            informative_groups=self.informative.get(first, len(prompts)),
        )
        return GenerationResult(rollout_id=rollout_id, entry_ids=(reply.entry_id,), responses=(reply,), seconds=0.0)

    def generate_one(self, request: GenerateRequest) -> GenerateResult:
        """loop.mode streaming: one group; its entry is `g<group>-a` (`-b` when the group is generated again)."""
        group = request.prompts[0].group_id
        assert request.rollout_id == group and len(request.prompts) == 1
        self.log("pool.generate_one", group, request.prompts[0].text)
        k = self.calls[group] = self.calls.get(group, -1) + 1
        return GenerateResult(
            entry_id=f"g{group}-{'ab'[k]}",
            num_groups=1,
            num_samples=request.n_samples_per_prompt,
            metrics={"reward_mean": 0.25},
        )

    def evaluate(self, prompts: list, *, n_samples: int, sampling: Any) -> dict[str, float]:
        self.log("pool.evaluate", len(prompts))
        return {"eval/reward_mean": 0.5}

    def release_memory(self) -> None:
        self.log("pool.release_memory")

    def resume_memory(self, tags: Any) -> None:
        self.log("pool.resume_memory", tuple(tags))

    def gpu_memory(self) -> tuple[int, int]:
        self.log("pool.gpu_memory")
        return 0, 0


class FakeSync:
    def __init__(self, log: CallLog):
        self.log = log

    def run(self, *, version: int) -> SyncResult:
        self.log("sync", version)
        return SyncResult(version=version, transport="gloo", bytes=1000, seconds=0.01, phase_seconds={})


class FakeBuffer:
    """Fake of the run's Redis buffer (tests/test_buffer*.py test the real one); `gone` entries are missing."""

    def __init__(self, log: CallLog, *, gone: frozenset[str] = frozenset()):
        self.log, self.gone = log, gone

    def missing(self, entry_ids: list[str]) -> list[str]:
        self.log("buffer.missing", tuple(entry_ids))
        return [e for e in entry_ids if e in self.gone]

    def discard_except(self, keep: list[str]) -> int:
        self.log("buffer.discard_except", tuple(keep))
        return 0

    def skip(self, entry_ids: list[str], *, group: str) -> int:
        self.log("buffer.skip", tuple(entry_ids), group)
        return len(entry_ids)

    def delete(self, entry_ids: list[str]) -> int:
        self.log("buffer.delete", tuple(entry_ids))
        return len(entry_ids)


class FakeTracker(Tracker):
    def __init__(self, calls: CallLog):
        self.calls = calls
        self.rows: dict[tuple[int, str], dict[str, float]] = {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        kind = "eval" if any(k.startswith("eval/") for k in metrics) else "step"
        self.rows[(step, kind)] = dict(metrics)
        self.calls("tracker.log", step, kind)

    def rewind(self, *, next_step: int) -> None:
        self.calls("tracker.rewind", next_step)


def make_config(**sections: dict[str, Any]) -> TandemConfig:
    data: dict[str, Any] = {
        "model": {"path": "unused"},
        "data": {"train_path": "unused", "shuffle": False},
        "rollout": {"rollout_batch_size": 2, "n_samples_per_prompt": 2},
        "loop": {"num_rollout": 3},
        "tracing": {"trackers": []},
    }
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return config_from_dict(data)


class Run:
    """A Coordinator over fakes, and the log they share."""

    def __init__(
        self,
        config: TandemConfig,
        *,
        checkpoint: RunState | None = None,
        pool_size: int = 1,
        failures: dict[int, list[grpc.StatusCode]] | None = None,
        buffer: bool = False,
        gone: frozenset[str] = frozenset(),
        on_train: Callable[[Coordinator, int], None] | None = None,
        informative: dict[int, int] | None = None,
        answers: dict[int, tuple[int, int]] | None = None,
        generations: Executor | None = None,
    ):
        self.log = CallLog()
        self.trainer = FakeTrainer(
            "trainer",
            self.log,
            checkpoint=checkpoint,
            failures=failures,
            answers=answers,
            on_train=lambda rid: on_train(self.coordinator, rid) if on_train else None,
        )
        self.critic = FakeTrainer("critic", self.log) if config.algorithm.uses_critic else None
        self.tracker = FakeTracker(self.log)
        self.coordinator = Coordinator(
            CoordinatorParts(
                config=config,
                run_dir=Path("/nonexistent/run"),
                trainer=self.trainer,
                critic=self.critic,
                pool=FakePool(self.log, size=pool_size, informative=informative),
                sync=FakeSync(self.log),
                data=DataSource(
                    RECORDS,
                    batch_size=config.rollout.rollout_batch_size,
                    shuffle=False,
                    seed=0,
                    num_epochs=config.data.num_epochs,
                ),
                buffer=FakeBuffer(self.log, gone=gone) if buffer else None,
                trackers=[self.tracker],
                eval_prompts=lambda: RECORDS[:3],
                generations=generations or InlineExecutor(),
                evals=InlineExecutor(),
                clock=FakeClock(self.log),
            )
        )

    def run(self) -> CallLog:
        self.coordinator.run()
        return self.log

    def messages(self) -> Iterator[str]:
        return (e.message for e in self.coordinator.events.watch(include_history=True))


FRESH_START = [("trainer.wait_healthy",), ("pool.wait_healthy",), ("trainer.load",), ("tracker.rewind", 0), ("sync", 0)]


def gen(rollout_id: int, first_group: int) -> tuple:
    return ("pool.generate", rollout_id, first_group)


def step(rollout_id: int) -> tuple:
    return ("tracker.log", rollout_id, "step")


# ---- the three loop modes ----------------------------------------------------------------------------


def test_async_generates_the_next_batch_before_training_the_current_one():
    run = Run(make_config(loop={"mode": "async"}))
    assert run.run() == [
        *FRESH_START,
        gen(0, 0),
        gen(1, 2),
        ("trainer.train", 0),
        ("sync", 1),
        step(0),
        gen(2, 4),
        ("trainer.train", 1),
        ("sync", 2),
        step(1),
        ("trainer.train", 2),
        ("sync", 3),
        ("trainer.save", 2),
        step(2),
    ]
    [final] = run.trainer.saved
    assert (final.next_rollout_id, final.weight_version, final.pending) == (3, 3, ())
    assert final.samples_generated == final.samples_trained == 3 * SAMPLES_PER_STEP
    assert run.coordinator.status == "finished"


def test_sync_generates_each_batch_after_the_weights_of_the_previous_step_arrived():
    run = Run(make_config(loop={"mode": "sync"}))
    assert run.run() == [
        *FRESH_START,
        gen(0, 0),
        ("trainer.train", 0),
        ("sync", 1),
        gen(1, 2),
        step(0),
        ("trainer.train", 1),
        ("sync", 2),
        gen(2, 4),
        step(1),
        ("trainer.train", 2),
        ("sync", 3),
        ("trainer.save", 2),
        step(2),
    ]


@pytest.mark.parametrize("inflight", ["off", "keep", "recompute"])
def test_in_flight_updates_sync_without_waiting_for_the_next_batchs_generation(inflight):
    """Generations finish only when the loop waits for them: without rollout.inflight_update the sync waits for the
    next batch's generation; with it the sync lands while that generation runs (between two of its decode steps)."""
    run = Run(make_config(loop={"mode": "async"}, rollout={"inflight_update": inflight}), generations=LazyExecutor())
    if inflight == "off":
        middle = [("trainer.train", 0), gen(1, 2), ("sync", 1), step(0), ("trainer.train", 1), gen(2, 4), ("sync", 2)]
    else:  # each generation finishes when its own step waits for it, after the sync that landed in it
        middle = [
            ("trainer.train", 0),
            ("sync", 1),
            step(0),
            gen(1, 2),
            ("trainer.train", 1),
            ("sync", 2),
            step(1),
            gen(2, 4),
        ]
    assert run.run() == [
        *FRESH_START,
        gen(0, 0),
        *middle,
        *([step(1)] if inflight == "off" else []),
        ("trainer.train", 2),
        ("sync", 3),
        ("trainer.save", 2),
        step(2),
    ]


STREAMING: dict[str, Any] = {
    "loop": {"mode": "streaming", "groups_in_flight": 4, "num_rollout": 3, "save_interval": 1},
    "redis": {"max_buffered_batches": 4},
}


def one(group: int) -> tuple:
    return ("pool.generate_one", group, f"p{group}")


def test_streaming_sends_each_group_alone_trains_them_as_they_finish_and_checkpoints_the_rest():
    """Up to 4 groups out (groups_in_flight), at most a step's 2 done and waiting (this executor finishes a Generate
    when it is sent, so no more are sent then); each step trains the first 2 done, and the room they leave is
    filled at once; a checkpoint records every group drawn and not trained; nothing is drawn past the last step."""
    run = Run(make_config(**STREAMING))
    assert run.run() == [
        *FRESH_START,
        one(0),
        one(1),
        one(2),
        one(3),
        ("trainer.train", 0),
        ("sync", 1),
        ("trainer.save", 0),
        step(0),
        one(4),
        one(5),
        ("trainer.train", 1),
        ("sync", 2),
        ("trainer.save", 1),
        step(1),
        ("trainer.train", 2),
        ("sync", 3),
        ("trainer.save", 2),
        step(2),
    ]
    assert [list(r.entry_ids) for r in run.trainer.requests] == [["g0-a", "g1-a"], ["g2-a", "g3-a"], ["g4-a", "g5-a"]]
    assert [r.max_staleness for r in run.trainer.requests] == [1, 1, 1]
    first, second, final = run.trainer.saved
    assert [(g.group_id, g.entry_id, g.epoch, g.offset) for g in first.groups] == [(2, "g2-a", 0, 2), (3, "g3-a", 0, 3)]
    assert first.cursor == DataCursor(0, 4, 4) and [g.group_id for g in second.groups] == [4, 5]
    assert final.groups == () and final.samples_generated == final.samples_trained == 3 * SAMPLES_PER_STEP


def test_a_streaming_step_trains_the_groups_that_finished_first_not_the_ones_sent_first():
    """Generates run on threads; group 0 takes longest, so the first step trains two of the others and group 0
    waits for a later step. Every group is trained exactly once."""
    slow = threading.Event()

    class SlowFirstPool(FakePool):
        def generate_one(self, request: GenerateRequest) -> GenerateResult:
            if request.prompts[0].group_id == 0:
                slow.wait(10)  # until the first step has trained
            return super().generate_one(request)

    run = Run(
        make_config(**STREAMING),
        generations=ThreadPoolExecutor(max_workers=4),
        on_train=lambda _c, rid: slow.set() if rid == 0 else None,
    )
    assert run.coordinator.stream is not None
    run.coordinator.pool = run.coordinator.stream.pool = SlowFirstPool(run.log)
    run.run()
    steps = [list(r.entry_ids) for r in run.trainer.requests]
    assert "g0-a" not in steps[0] and sorted(e for s in steps for e in s) == [f"g{g}-a" for g in range(6)]


def test_a_streaming_resume_reuses_buffered_groups_and_generates_the_others_again():
    """The checkpoint holds 4 groups drawn and not trained: g2 done and still buffered (reused), g3 done but trained
    after the checkpoint (its entry is gone: generated again), g4 still generating and g5 not sent (generated, from
    their recorded place in the data order). Entries nobody recorded are deleted."""
    groups = (
        StreamGroup(2, 0, 2, "g2-a", weight_version=1),
        StreamGroup(3, 0, 3, "g3-a"),
        StreamGroup(4, 0, 4),
        StreamGroup(5, 0, 5),
    )
    saved = RunState(
        next_rollout_id=1,
        weight_version=1,
        cursor=DataCursor(0, 6, 6),
        groups=groups,
        samples_generated=4,
        samples_trained=4,
    )
    run = Run(make_config(**STREAMING), checkpoint=saved, buffer=True, gone=frozenset({"g3-a"}))
    assert run.run() == [
        ("trainer.wait_healthy",),
        ("pool.wait_healthy",),
        ("trainer.load",),
        ("buffer.missing", ("g2-a", "g3-a")),
        ("buffer.discard_except", ("g2-a",)),
        ("tracker.rewind", 1),
        ("sync", 1),
        one(3),
        one(4),
        one(5),
        ("trainer.train", 1),
        ("sync", 2),
        ("trainer.save", 1),
        step(1),
        ("trainer.train", 2),
        ("sync", 3),
        ("trainer.save", 2),
        step(2),
    ]
    assert [list(r.entry_ids) for r in run.trainer.requests] == [["g2-a", "g3-a"], ["g4-a", "g5-a"]]  # g3-a: anew
    assert run.trainer.saved[-1].samples_generated == 4 + 2 * SAMPLES_PER_STEP


def test_fully_async_keeps_a_generation_per_replica_in_flight_and_checkpoints_them():
    config = make_config(
        loop={"mode": "fully_async", "num_rollout": 4, "update_weights_interval": 2, "save_interval": 2}
    )
    run = Run(config)
    assert run.run() == [
        *FRESH_START,
        gen(0, 0),
        gen(1, 2),
        ("trainer.train", 0),
        step(0),
        gen(2, 4),
        ("trainer.train", 1),
        ("sync", 1),
        ("trainer.save", 1),
        step(1),
        gen(3, 6),
        ("trainer.train", 2),
        step(2),
        ("trainer.train", 3),
        ("sync", 2),
        ("trainer.save", 3),
        step(3),
    ]
    assert [r.max_staleness for r in run.trainer.requests] == [1, 1, 1, 1]  # loop.max_staleness
    mid = run.trainer.saved[0]
    assert [p.rollout_id for p in mid.pending] == [2]  # the generation in flight, for a resume to reuse
    assert mid.pending[0].entry_ids == ("2-a",)
    assert mid.cursor == mid.pending[0].cursor_before == DataCursor(epoch=0, offset=4, consumed=4)


# ---- resume ---------------------------------------------------------------------------------------------


def test_resume_reuses_buffered_generations_and_regenerates_those_trained_since():
    """Rollout 2's entries are still buffered: reused. One of rollout 3's was trained after the checkpoint (gone):
    its prompts are generated again (group 6, where its cursor starts). Everything else in the buffer goes."""
    pending = (
        GeneratedBatch(
            rollout_id=2,
            entry_ids=("2-a",),
            cursor_before=DataCursor(0, 4, 4),
            cursor_after=DataCursor(0, 6, 6),
            metrics={"rollout/num_samples": 4.0},
        ),
        GeneratedBatch(
            rollout_id=3, entry_ids=("3-a", "3-b"), cursor_before=DataCursor(0, 6, 6), cursor_after=DataCursor(0, 8, 8)
        ),
    )
    saved = RunState(
        next_rollout_id=2,
        weight_version=2,
        weights_pushed=False,
        cursor=DataCursor(0, 4, 4),
        pending=pending,
        samples_generated=8,
        samples_trained=8,
    )
    run = Run(
        make_config(loop={"mode": "fully_async", "num_rollout": 5}),
        checkpoint=saved,
        buffer=True,
        gone=frozenset({"3-b"}),
    )
    assert run.run() == [
        ("trainer.wait_healthy",),
        ("pool.wait_healthy",),
        ("trainer.load",),
        ("buffer.missing", ("2-a",)),
        ("buffer.missing", ("3-a", "3-b")),
        ("buffer.discard_except", ("2-a",)),
        ("tracker.rewind", 2),
        ("sync", 3),  # trained after the last sync: a new version
        gen(3, 6),
        ("trainer.train", 2),
        ("sync", 4),
        step(2),
        gen(4, 8),
        ("trainer.train", 3),
        ("sync", 5),
        step(3),
        ("trainer.train", 4),
        ("sync", 6),
        ("trainer.save", 4),
        step(4),
    ]
    assert run.trainer.requests[0].entry_ids == ("2-a",)
    assert run.tracker.rows[(2, "step")]["rollout/reused_from_checkpoint"] == 1.0
    assert run.trainer.saved[-1].samples_generated == 8 + 3 * SAMPLES_PER_STEP


def test_an_already_finished_run_loads_its_checkpoint_and_does_nothing_else():
    run = Run(make_config(), checkpoint=RunState(next_rollout_id=3, weight_version=3))
    assert run.run() == [("trainer.wait_healthy",), ("pool.wait_healthy",), ("trainer.load",)]
    assert run.coordinator.status == "finished"
    assert any(
        m.startswith("this run already finished: 3 of 3 rollouts trained, last checkpoint /ckpt/trainer/")
        for m in run.messages()
    )


# ---- PPO, evals, memory ------------------------------------------------------------------------------------


def test_ppo_warm_up_steps_train_the_critic_alone_and_skip_the_actor_share():
    run = Run(
        make_config(loop={"mode": "sync"}, algorithm={"advantage_estimator": "gae", "num_critic_only_steps": 2}),
        buffer=True,
    )
    assert run.run() == [
        ("trainer.wait_healthy",),
        ("critic.wait_healthy",),
        ("pool.wait_healthy",),
        ("trainer.load",),
        ("critic.load",),
        ("buffer.discard_except", ()),
        ("tracker.rewind", 0),
        ("sync", 0),
        gen(0, 0),
        ("critic.train", 0),
        ("buffer.skip", ("0-a",), "actor"),
        ("sync", 1),
        gen(1, 2),
        step(0),
        ("critic.train", 1),
        ("buffer.skip", ("1-a",), "actor"),
        ("sync", 2),
        gen(2, 4),
        step(1),
        ("critic.train", 2),
        ("trainer.train", 2),
        ("sync", 3),
        ("critic.save", 2),
        ("trainer.save", 2),
        step(2),
    ]
    assert run.critic is not None and not any(r.use_critic_values for r in run.critic.requests)
    assert [r.use_critic_values for r in run.trainer.requests] == [True]
    final = run.trainer.saved[-1]
    assert (final.samples_critic_only, final.samples_trained) == (2 * SAMPLES_PER_STEP, SAMPLES_PER_STEP)


def test_evals_run_before_training_on_the_interval_and_after_the_last_step():
    run = Run(make_config(loop={"mode": "sync", "eval_interval": 2}))
    evaluate = ("pool.evaluate", 3)
    assert run.run() == [
        *FRESH_START,
        evaluate,
        ("tracker.log", -1, "eval"),
        gen(0, 0),
        ("trainer.train", 0),
        ("sync", 1),
        gen(1, 2),
        step(0),
        ("trainer.train", 1),
        ("sync", 2),
        gen(2, 4),
        evaluate,
        ("tracker.log", 1, "eval"),
        step(1),
        ("trainer.train", 2),
        ("sync", 3),
        ("trainer.save", 2),
        evaluate,
        ("tracker.log", 2, "eval"),
        step(2),
    ]


def test_offloading_moves_memory_between_engines_and_trainer_around_train_and_sync():
    run = Run(make_config(loop={"mode": "sync", "num_rollout": 2, "offload_train": True, "offload_rollout": True}))
    release = [("pool.release_memory",), ("pool.gpu_memory",)]
    weights, caches = ("pool.resume_memory", ("weights",)), ("pool.resume_memory", ("kv_cache", "cuda_graph"))
    offload = [("trainer.get_state",), ("trainer.offload",), ("trainer.get_state",)]
    assert run.run() == [
        *FRESH_START,
        gen(0, 0),
        *release,
        ("trainer.train", 0),
        weights,
        ("sync", 1),
        caches,
        *offload,
        gen(1, 2),
        step(0),
        *release,
        ("trainer.onload",),
        ("trainer.train", 1),
        weights,
        ("sync", 2),
        caches,
        *offload,
        ("trainer.save", 1),
        step(1),
    ]


# ---- stop and failures ---------------------------------------------------------------------------------


def test_a_stop_ends_the_run_after_the_current_step_with_a_checkpoint_of_the_generation_in_flight():
    def stop_during_step_1(coordinator: Coordinator, rollout_id: int) -> None:
        if rollout_id == 1:
            coordinator.control.stop()

    run = Run(make_config(loop={"mode": "async", "num_rollout": 5}), on_train=stop_during_step_1)
    assert run.run() == [
        *FRESH_START,
        gen(0, 0),
        gen(1, 2),
        ("trainer.train", 0),
        ("sync", 1),
        step(0),
        gen(2, 4),
        ("trainer.train", 1),
        ("sync", 2),
        ("trainer.save", 1),
        step(1),
    ]
    [final] = run.trainer.saved
    assert (final.next_rollout_id, final.weight_version) == (2, 2)
    assert [p.rollout_id for p in final.pending] == [2] and final.cursor == DataCursor(0, 4, 4)
    assert run.coordinator.status == "finished"


def test_a_train_that_fails_unavailable_is_retried_after_a_pause():
    run = Run(make_config(loop={"mode": "sync", "num_rollout": 2}), failures={1: [grpc.StatusCode.UNAVAILABLE]})
    assert run.run() == [
        *FRESH_START,
        gen(0, 0),
        ("trainer.train", 0),
        ("sync", 1),
        gen(1, 2),
        step(0),
        ("trainer.train", 1),
        ("sleep", 1.0),
        ("trainer.train", 1),
        ("sync", 2),
        ("trainer.save", 1),
        step(1),
    ]
    assert run.coordinator.status == "finished"


def test_a_train_that_fails_invalid_argument_fails_the_run_at_once_as_permanent():
    run = Run(make_config(loop={"mode": "sync"}), failures={1: [grpc.StatusCode.INVALID_ARGUMENT]})
    with pytest.raises(ServiceCallError) as info:
        run.run()
    assert info.value.permanent
    assert run.log == [
        *FRESH_START,
        gen(0, 0),
        ("trainer.train", 0),
        ("sync", 1),
        gen(1, 2),
        step(0),
        ("trainer.train", 1),
    ]
    assert run.coordinator.status == "failed"
    assert "failed: ServiceCallError: trainer Train(1) failed: INVALID_ARGUMENT" in list(run.messages())


def test_a_train_still_unavailable_after_its_attempts_fails_the_run_as_transient():
    run = Run(make_config(loop={"mode": "sync"}), failures={0: [grpc.StatusCode.UNAVAILABLE] * 3})
    with pytest.raises(ServiceCallError) as info:
        run.run()
    assert not info.value.permanent
    assert run.log == [
        *FRESH_START,
        gen(0, 0),
        ("trainer.train", 0),
        ("sleep", 1.0),
        ("trainer.train", 0),
        ("sleep", 2.0),
        ("trainer.train", 0),
    ]


# ---- dynamic sampling ---------------------------------------------------------------------------------------

DYNAMIC = {"dynamic_sampling": {"enabled": True, "max_rounds": 3}}


def test_dynamic_sampling_generates_rounds_until_the_batch_is_full_and_trains_every_entry_in_one_call(caplog):
    """Rollout 0: 1 of its 2 groups is informative, a second round (groups 2-3) brings 2 more: 2 rounds, 1 surplus.
    Rollout 1: no group is informative in 3 rounds (groups 4-5, 6-7, then 8-9 of the next epoch): the cap; it trains
    on what there is (nothing) and says so. Rollout 2: both groups informative at once. Every round's entries go to
    the step's one Train, and the books add up to what was generated."""
    config = make_config(rollout=DYNAMIC, loop={"mode": "async", "save_interval": 100})
    answers = {0: (4, 4), 1: (0, 12), 2: (4, 0)}  # what the trainer keeps: rollout_batch_size informative groups
    run = Run(config, informative={0: 1, 2: 2, 4: 0, 6: 0, 8: 0, 10: 2}, answers=answers)
    assert run.run() == [
        *FRESH_START,
        gen(0, 0),
        gen(0, 2),
        gen(1, 4),
        gen(1, 6),
        gen(1, 8),
        ("trainer.train", 0),
        ("sync", 1),
        step(0),
        gen(2, 10),
        ("trainer.train", 1),
        ("sync", 2),
        ("trainer.save", 1),
        step(1),  # the epoch ended in rollout 1's second round: a save point
        ("trainer.train", 2),
        ("sync", 3),
        ("trainer.save", 2),
        step(2),
    ]
    assert [list(r.entry_ids) for r in run.trainer.requests] == [["0-a", "0-b"], ["1-a", "1-b", "1-c"], ["2-a"]]
    rows = [run.tracker.rows[(i, "step")] for i in range(3)]
    assert [r["rollout/dynamic_rounds"] for r in rows] == [2.0, 3.0, 1.0]
    assert [r["rollout/informative_groups"] for r in rows] == [3.0, 0.0, 2.0]
    assert [r["rollout/filtered_group_frac"] for r in rows] == [0.25, 1.0, 0.0]
    assert [r["rollout/surplus_groups"] for r in rows] == [1.0, 0.0, 0.0]
    assert [r["rollout/groups_short"] for r in rows] == [0.0, 2.0, 0.0]
    assert [r["rollout/extra_samples"] for r in rows] == [4.0, 8.0, 0.0]
    assert [r["rollout/num_samples"] for r in rows] == [8.0, 12.0, 4.0]
    assert [r["rollout/filtered_samples"] for r in rows] == [4.0, 12.0, 0.0]
    assert all(r["perf/extra_generate_time_s"] >= 0 for r in rows)
    assert "rollout 1: 0 of 6 groups informative after 3 rounds" in caplog.text
    mid, final = run.trainer.saved
    # the checkpoint of step 1 records rollout 2's generation in flight: its range of the data cursor
    assert [(p.rollout_id, p.entry_ids, p.cursor_before, p.cursor_after) for p in mid.pending] == [
        (2, ("2-a",), DataCursor(1, 2, 10), DataCursor(1, 4, 12))
    ]
    assert (final.samples_generated, final.samples_trained, final.samples_filtered) == (24, 8, 16)
    assert final.samples_generated == (
        final.samples_trained + final.samples_dropped_stale + final.samples_filtered + final.samples_critic_only
    )


def test_dynamic_sampling_in_sync_mode_generates_the_rounds_after_the_weights_arrived():
    run = Run(make_config(rollout=DYNAMIC, loop={"mode": "sync", "num_rollout": 2}), informative={0: 0, 2: 1, 4: 1})
    assert run.run() == [
        *FRESH_START,
        gen(0, 0),
        gen(0, 2),
        gen(0, 4),
        ("trainer.train", 0),
        ("sync", 1),
        gen(1, 6),
        step(0),
        ("trainer.train", 1),
        ("sync", 2),
        ("trainer.save", 1),
        step(1),
    ]
    assert list(run.trainer.requests[0].entry_ids) == ["0-a", "0-b", "0-c"]


def test_a_resume_reuses_every_round_of_a_recorded_generation_or_generates_its_range_again():
    """Rollout 2 was generated in two rounds (groups 10-13). Still buffered: one Train names both entries and the
    next generation starts after the range. One entry gone (trained after the checkpoint): the range is generated
    again from its start, the same prompts (group 10, then group 12)."""
    pending = (
        GeneratedBatch(
            rollout_id=2,
            entry_ids=("2-a", "2-b"),
            cursor_before=DataCursor(1, 2, 10),
            cursor_after=DataCursor(1, 6, 14),
            metrics={"rollout/num_samples": 8.0},
        ),
    )
    saved = RunState(
        next_rollout_id=2,
        weight_version=2,
        cursor=DataCursor(1, 2, 10),
        pending=pending,
        samples_generated=20,
        samples_trained=8,
        samples_filtered=12,
    )
    config = make_config(rollout=DYNAMIC, loop={"mode": "async", "num_rollout": 4})
    reused = Run(config, checkpoint=saved, buffer=True, informative={10: 1}, answers={2: (4, 4)})
    assert reused.run() == [
        ("trainer.wait_healthy",),
        ("pool.wait_healthy",),
        ("trainer.load",),
        ("buffer.missing", ("2-a", "2-b")),
        ("buffer.discard_except", ("2-a", "2-b")),
        ("tracker.rewind", 2),
        ("sync", 2),
        gen(3, 14),
        ("trainer.train", 2),
        ("sync", 3),
        step(2),
        ("trainer.train", 3),
        ("sync", 4),
        ("trainer.save", 3),
        step(3),
    ]
    assert list(reused.trainer.requests[0].entry_ids) == ["2-a", "2-b"]
    final = reused.trainer.saved[-1]
    assert final.samples_generated == 20 + 8 + SAMPLES_PER_STEP == final.samples_trained + final.samples_filtered

    again = Run(
        config, checkpoint=saved, buffer=True, gone=frozenset({"2-b"}), informative={10: 1}, answers={2: (4, 4)}
    )
    assert again.run()[3:] == [
        ("buffer.missing", ("2-a", "2-b")),
        ("buffer.discard_except", ()),
        ("tracker.rewind", 2),
        ("sync", 2),
        gen(2, 10),
        gen(2, 12),
        gen(3, 14),
        ("trainer.train", 2),
        ("sync", 3),
        step(2),
        ("trainer.train", 3),
        ("sync", 4),
        ("trainer.save", 3),
        step(3),
    ]
    assert list(again.trainer.requests[0].entry_ids) == ["2-a", "2-b"]  # the regenerated entries


# ---- policy: one line each ---------------------------------------------------------------------------------


def test_overlaps():
    assert [policy.overlaps(m) for m in ("async", "sync", "fully_async")] == [True, False, False]


def test_sync_pause_mode_and_waiting_follow_inflight_update():
    assert [policy.sync_pause_mode(m) for m in ("off", "keep", "recompute")] == ["drain", "in_place", "retract"]
    assert [policy.waits_for_generation_before_sync(m) for m in ("off", "keep")] == [True, False]


def test_sync_due():
    assert [policy.sync_due(i, interval=2, mode="async") for i in range(4)] == [False, True, False, True]


def test_sync_due_every_step_in_sync_mode():
    assert all(policy.sync_due(i, interval=3, mode="sync") for i in range(4))


def test_should_exit():
    assert [policy.should_exit(i, start_id=2, stop_requested=False, exit_after=2) for i in (2, 3)] == [False, True]


def test_should_exit_on_stop():
    assert policy.should_exit(0, start_id=0, stop_requested=True, exit_after=None)


def test_is_final():
    assert [policy.is_final(i, num_rollout=3, exiting=False) for i in range(3)] == [False, False, True]


def test_is_final_when_exiting():
    assert policy.is_final(0, num_rollout=3, exiting=True)


def test_save_due():
    assert [policy.save_due(i, interval=2, epoch_end=False, requested=False, final=False) for i in range(4)] == [
        False,
        True,
        False,
        True,
    ]


def test_save_due_at_an_epoch_end_only_with_an_interval():
    assert [policy.save_due(0, interval=n, epoch_end=True, requested=False, final=False) for n in (9, None)] == [
        True,
        False,
    ]


def test_save_due_when_requested_or_final():
    assert policy.save_due(0, interval=None, epoch_end=False, requested=True, final=False) and policy.save_due(
        0, interval=None, epoch_end=False, requested=False, final=True
    )


def test_eval_due():
    assert [policy.eval_due(i, interval=2, num_rollout=5) for i in range(5)] == [False, True, False, True, True]


def test_eval_due_never_without_an_interval():
    assert not policy.eval_due(4, interval=None, num_rollout=5)


def test_eval_before_training():
    assert [policy.eval_before_training(interval=2, next_rollout_id=n, skip=False) for n in (0, 3)] == [True, False]


def test_eval_before_training_skipped():
    assert not policy.eval_before_training(interval=2, next_rollout_id=0, skip=True)


def test_final_eval_due():
    assert [policy.final_eval_due(3, interval=2, evaluated=e) for e in (False, True)] == [True, False]


def test_final_eval_due_not_before_a_step_or_without_evals():
    assert not policy.final_eval_due(-1, interval=2, evaluated=False) and not policy.final_eval_due(
        3, interval=None, evaluated=False
    )


def test_final_save_due():
    assert [policy.final_save_due(3, stopped=True, last_saved=s) for s in (2, 3)] == [True, False]


def test_final_save_due_only_for_a_stopped_run():
    assert not policy.final_save_due(3, stopped=False, last_saved=2)


def test_critic_only():
    assert [policy.critic_only(i, has_critic=True, num_critic_only_steps=2) for i in range(3)] == [True, True, False]


def test_critic_only_never_without_a_critic():
    assert not policy.critic_only(0, has_critic=False, num_critic_only_steps=2)


def test_may_start_generation():
    assert [policy.may_start_generation(n, replicas=2, next_id=1, num_rollout=5) for n in (2, 3)] == [True, False]


def test_may_start_generation_not_past_the_last_rollout():
    assert not policy.may_start_generation(0, replicas=2, next_id=5, num_rollout=5)
