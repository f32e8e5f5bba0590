"""The coordinator's seams: what the run loop asks of the trainer, the rollout replicas, the weight sync, the data
and the buffer. The gRPC clients (clients.py), the pool (pool.py) and WeightSync (sync.py) implement them; the loop
tests implement them with fakes. Each call has its deadline from the config inside the implementation, and fails
with a ServiceCallError naming the service, the call and the status."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

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
from services.contracts.trainer_calls import (
    LoadResult,
    PublishResult,
    SaveRequest,
    SaveResult,
    TrainerStatus,
    TrainRequest,
    TrainResult,
    WeightSyncRequest,
)
from services.contracts.weight_plan import WeightSyncPlan
from services.coordinator.data import DataCursor, PromptBatch, PromptRecord


class Clock(Protocol):
    def monotonic(self) -> float: ...
    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class TrainerApi(Protocol):
    """One trainer service (the actor, or the critic), as the loop uses it: steps, checkpoints, memory."""

    name: str

    def wait_healthy(self, timeout_s: float) -> None: ...
    def train(self, request: TrainRequest) -> TrainResult: ...
    def save(self, request: SaveRequest) -> SaveResult: ...
    def load(self) -> LoadResult: ...
    def offload(self) -> None: ...
    def onload(self) -> None: ...
    def get_state(self) -> TrainerStatus: ...


class TrainerWeightsApi(Protocol):
    """The actor's half of a weight sync (sync.py)."""

    def prepare_weight_sync(self, request: WeightSyncRequest) -> WeightSyncPlan:
        """The plan the trainer will publish by, for the engines (the weights package's message, passed on)."""
        ...

    def publish_weights(self, version: int) -> PublishResult: ...


class RolloutApi(Protocol):
    """One rollout replica."""

    name: str

    def wait_healthy(self, timeout_s: float) -> None: ...
    def generate(self, request: GenerateRequest) -> GenerateResult: ...
    def evaluate(self, request: EvaluateRequest) -> EvaluateResult: ...
    def prepare_weight_sync(self, *, version: int, pause_mode: str) -> PrepareResult: ...
    def receive_weights(self, request: ReceiveRequest) -> ReceiveResult: ...
    def resume(self) -> None: ...
    def release_memory(self, tags: Sequence[str]) -> None: ...
    def resume_memory(self, tags: Sequence[str]) -> None: ...
    def get_state(self) -> RolloutStatus: ...
    def probe(self) -> RolloutStatus:
        """GetState under the short probe deadline, without waiting for a replica that is down."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class GenerationResult:
    rollout_id: int
    entry_ids: tuple[str, ...]
    responses: tuple[GenerateResult, ...]
    seconds: float
    recorded_metrics: dict[str, float] | None = None  # set when reused from a checkpoint
    # Set by the loop: the data cursor after the generation's last prompts, and whether they ended an epoch
    # (dynamic sampling draws more prompts while it runs).
    cursor_after: DataCursor | None = None
    epoch_end: bool = False
    sampling_metrics: dict[str, float] = field(default_factory=dict)  # dynamic sampling's rounds


@dataclass(frozen=True)
class InFlight:
    """A generation the loop started (or reused from the checkpoint), with the data cursors around its prompts:
    a checkpoint records both, so that a resume reuses its entries or generates the same prompts again."""

    rollout_id: int
    future: Future[GenerationResult]
    cursor_before: DataCursor
    cursor_after: DataCursor

    def result(self) -> GenerationResult:
        return self.future.result()


class RolloutPoolApi(Protocol):
    """All rollout replicas of a run, as the loop uses them."""

    @property
    def size(self) -> int: ...
    def wait_healthy(self, timeout_s: float) -> None: ...
    def generate(
        self,
        *,
        rollout_id: int,
        prompts: list[PromptInput],
        n_samples: int,
        sampling: SamplingSpec,
        trace_context: dict[str, str],
    ) -> GenerationResult: ...
    def generate_one(self, request: GenerateRequest) -> GenerateResult:
        """One Generate on the least busy replica (retried on the next one as `generate`'s shares are)."""
        ...

    def evaluate(self, prompts: list[PromptInput], *, n_samples: int, sampling: SamplingSpec) -> dict[str, float]: ...
    def release_memory(self) -> None: ...
    def resume_memory(self, tags: Sequence[str]) -> None: ...
    def gpu_memory(self) -> tuple[int, int]: ...  # (reserved, freed by the last release), bytes


@dataclass(frozen=True)
class SyncResult:
    version: int
    transport: str
    bytes: int
    seconds: float
    phase_seconds: dict[str, float] = field(default_factory=dict)
    verified_tensors: int = 0

    @property
    def gbps(self) -> float:
        transfer = self.phase_seconds.get("transfer", self.seconds)
        return self.bytes / transfer / 1e9 if transfer > 0 else 0.0


class WeightSyncApi(Protocol):
    def run(self, *, version: int) -> SyncResult: ...


class PromptSource(Protocol):
    """The training prompts, with a cursor the checkpoint saves."""

    cursor: DataCursor

    @property
    def size(self) -> int: ...
    def next_batch(self) -> PromptBatch: ...
    def record_at(self, epoch: int, offset: int) -> PromptRecord: ...


class BufferApi(Protocol):
    """What the loop does to the run's Redis buffer itself (the services read and write the entries)."""

    def missing(self, entry_ids: list[str]) -> list[str]: ...
    def discard_except(self, keep: list[str]) -> int: ...
    def skip(self, entry_ids: list[str], *, group: str) -> int: ...
    def delete(self, entry_ids: list[str]) -> int: ...
