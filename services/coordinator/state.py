"""The coordinator's run state, saved inside every trainer checkpoint (one source of truth on resume)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from services.coordinator.data import DataCursor


@dataclass(frozen=True)
class GeneratedBatch:
    """A generation that finished but was not trained yet: on resume its Redis entries are reused."""

    rollout_id: int
    entry_ids: tuple[str, ...]
    cursor_before: DataCursor
    cursor_after: DataCursor
    metrics: dict[str, float] = field(default_factory=dict)  # the generation's rollout metrics

    def to_dict(self) -> dict:
        return {
            "rollout_id": self.rollout_id,
            "entry_ids": list(self.entry_ids),
            "cursor_before": self.cursor_before.to_dict(),
            "cursor_after": self.cursor_after.to_dict(),
            "metrics": self.metrics,
        }

    @classmethod
    def from_dict(cls, d: dict) -> GeneratedBatch:
        return cls(
            rollout_id=int(d["rollout_id"]),
            entry_ids=tuple(d["entry_ids"]),
            cursor_before=DataCursor.from_dict(d["cursor_before"]),
            cursor_after=DataCursor.from_dict(d["cursor_after"]),
            metrics={k: float(v) for k, v in d.get("metrics", {}).items()},
        )


@dataclass(frozen=True)
class StreamGroup:
    """loop.mode streaming: a prompt drawn for generation and not trained yet, and where it stands in the data order
    (so a resume generates it again). `entry_id` is its buffer entry once its samples are done, "" before."""

    group_id: int
    epoch: int
    offset: int
    entry_id: str = ""
    weight_version: int = 0  # the version its generation started with (once done)

    def to_dict(self) -> dict:
        return {
            "group_id": self.group_id,
            "epoch": self.epoch,
            "offset": self.offset,
            "entry_id": self.entry_id,
            "weight_version": self.weight_version,
        }

    @classmethod
    def from_dict(cls, d: dict) -> StreamGroup:
        return cls(
            group_id=int(d["group_id"]),
            epoch=int(d["epoch"]),
            offset=int(d["offset"]),
            entry_id=str(d.get("entry_id", "")),
            weight_version=int(d.get("weight_version", 0)),
        )


@dataclass(frozen=True)
class RunState:
    next_rollout_id: int = 0
    weight_version: int = 0
    cursor: DataCursor = field(default_factory=DataCursor)  # data cursor before generating next_rollout_id
    pending: tuple[GeneratedBatch, ...] = ()  # generated, not yet trained, in rollout order
    groups: tuple[StreamGroup, ...] = ()  # streaming: drawn, not yet trained (cursor is after them)
    samples_generated: int = 0
    samples_trained: int = 0
    samples_dropped_stale: int = 0
    samples_critic_only: int = 0  # PPO warm-up: trained by the critic only, never by the actor
    samples_filtered: int = 0  # dynamic sampling: in uniform or surplus groups, acknowledged
    weights_pushed: bool = True  # engines hold exactly the trainer's weights (no step since sync)
    history: tuple[str, ...] = field(default_factory=tuple)  # checkpoint paths, oldest first

    def resumed(self) -> RunState:
        """The state a resume starts from: weights trained after the last sync were never pushed under the saved
        version, so they get a new one (pushed at start-up)."""
        return replace(
            self, weight_version=self.weight_version + (0 if self.weights_pushed else 1), weights_pushed=True
        )

    def trained(
        self, rollout_id: int, *, generated: int, trained: int, dropped_stale: int, critic_only: int, filtered: int = 0
    ) -> RunState:
        """After the step of `rollout_id`: its samples counted (generated = trained + dropped_stale + filtered +
        critic_only), its generation no longer pending, and the trainer's weights ahead of the engines' until the
        next sync."""
        return replace(
            self,
            next_rollout_id=rollout_id + 1,
            samples_generated=self.samples_generated + generated,
            samples_trained=self.samples_trained + trained,
            samples_dropped_stale=self.samples_dropped_stale + dropped_stale,
            samples_critic_only=self.samples_critic_only + critic_only,
            samples_filtered=self.samples_filtered + filtered,
            pending=tuple(p for p in self.pending if p.rollout_id != rollout_id),
            weights_pushed=False,
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "next_rollout_id": self.next_rollout_id,
                "weight_version": self.weight_version,
                "cursor": self.cursor.to_dict(),
                "pending": [p.to_dict() for p in self.pending],
                "groups": [g.to_dict() for g in self.groups],
                "samples_generated": self.samples_generated,
                "samples_trained": self.samples_trained,
                "samples_dropped_stale": self.samples_dropped_stale,
                "samples_critic_only": self.samples_critic_only,
                "samples_filtered": self.samples_filtered,
                "weights_pushed": self.weights_pushed,
                "history": list(self.history),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> RunState:
        d = json.loads(text)
        return cls(
            next_rollout_id=int(d["next_rollout_id"]),
            weight_version=int(d["weight_version"]),
            cursor=DataCursor.from_dict(d["cursor"]),
            pending=tuple(GeneratedBatch.from_dict(p) for p in d.get("pending", [])),
            groups=tuple(StreamGroup.from_dict(g) for g in d.get("groups", [])),
            samples_generated=int(d.get("samples_generated", 0)),
            samples_trained=int(d.get("samples_trained", 0)),
            samples_dropped_stale=int(d.get("samples_dropped_stale", 0)),
            samples_critic_only=int(d.get("samples_critic_only", 0)),
            samples_filtered=int(d.get("samples_filtered", 0)),
            weights_pushed=bool(d.get("weights_pushed", True)),
            history=tuple(d.get("history", [])),
        )
