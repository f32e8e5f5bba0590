"""What a trainer is asked and answers, as frozen dataclasses: TrainerService takes and returns these, the
coordinator's loop builds and reads them, and only the gRPC edges (trainer/server.py, coordinator/clients.py) turn
them into the tandem.v1 messages and back (services/contracts/convert.py, by field name). The plan a PrepareWeightSync
answers is services.contracts.weight_plan.WeightSyncPlan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from services.contracts.untyped import JsonObject, JsonValue

TrainerRole = Literal["actor", "critic"]
TRAINER_ROLES: tuple[TrainerRole, ...] = ("actor", "critic")


@dataclass(frozen=True)
class TrainRequest:
    """One optimizer step on the named entries (or the next `num_batches` of the role's consumer group)."""

    rollout_id: int
    entry_ids: tuple[str, ...] = ()
    num_batches: int = 0
    max_staleness: int = -1  # fully_async / streaming: drop samples older than this (-1: off)
    use_critic_values: bool = False  # the actor under PPO: read the critic's values of this rollout
    trace_context: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainResult:
    rollout_id: int
    step: int  # optimizer steps committed so far
    metrics: dict[str, float]
    entry_ids: tuple[str, ...]  # entries trained on (acknowledged)
    samples_trained: int
    samples_dropped_stale: int
    samples_filtered: int  # dynamic sampling: samples of uniform or surplus groups, not trained
    time_s: float
    replayed: bool = False  # recorded earlier: a retried Train

    def to_json(self) -> JsonObject:
        """As the checkpoint's ledger keeps it (tandem_state.json)."""
        return {
            "rollout_id": self.rollout_id,
            "step": self.step,
            "metrics": dict(self.metrics),
            "entry_ids": list(self.entry_ids),
            "samples_trained": self.samples_trained,
            "samples_dropped_stale": self.samples_dropped_stale,
            "samples_filtered": self.samples_filtered,
            "time_s": self.time_s,
        }

    @classmethod
    def from_json(cls, data: JsonObject) -> TrainResult:
        """Reads `to_json`'s form, and the protobuf JSON checkpoints before this type held (camelCase keys, 64-bit
        ints as strings, zero values left out)."""

        def value(key: str, camel: str, default: JsonValue) -> JsonValue:
            return data.get(key, data.get(camel, default))

        return cls(
            rollout_id=int(value("rollout_id", "rolloutId", 0)),
            step=int(value("step", "step", 0)),
            metrics={str(k): float(v) for k, v in dict(value("metrics", "metrics", {})).items()},
            entry_ids=tuple(str(e) for e in value("entry_ids", "entryIds", [])),
            samples_trained=int(value("samples_trained", "samplesTrained", 0)),
            samples_dropped_stale=int(value("samples_dropped_stale", "samplesDroppedStale", 0)),
            samples_filtered=int(value("samples_filtered", "samplesFiltered", 0)),
            time_s=float(value("time_s", "timeS", 0.0)),
        )


@dataclass(frozen=True)
class SaveRequest:
    rollout_id: int
    path: str = ""  # empty: the trainer's checkpoint directory
    export_hf: bool = False
    extra_state: dict[str, str] = field(default_factory=dict)  # opaque blobs kept with the checkpoint


@dataclass(frozen=True)
class SaveResult:
    path: str
    hf_path: str  # empty: no Hugging Face export
    step: int
    time_s: float


@dataclass(frozen=True)
class LoadRequest:
    path: str = ""  # empty: the latest complete checkpoint


@dataclass(frozen=True)
class LoadResult:
    loaded: bool  # False: no checkpoint to load
    path: str = ""
    rollout_id: int = 0  # the last rollout id the checkpoint holds
    step: int = 0
    weight_version: int = 0
    extra_state: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class WeightSyncRequest:
    """PrepareWeightSync: the plan of the next weight publish."""

    version: int
    transport: str = ""  # empty: weights.transport
    engine_world_size: int = 1  # every engine rank together
    verify: bool = False
    verify_by_bucket: bool = False  # with verify: one checksum per bucket, not per tensor


@dataclass(frozen=True)
class PublishRequest:
    version: int


@dataclass(frozen=True)
class PublishResult:
    version: int
    bytes_sent: int
    time_s: float


@dataclass(frozen=True)
class TrainerStatus:
    role: TrainerRole
    step: int
    last_rollout_id: int
    weight_version: int
    world_size: int
    zero_stage: int
    offloaded: bool
    device: str
    samples_trained: int
    gpu_memory_reserved_bytes: int  # CUDA memory rank 0's allocator holds (0 on CPU)
