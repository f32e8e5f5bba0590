"""What the coordinator's control API is asked and answers (tandem.v1 coordinator.proto), as frozen dataclasses;
its step events are services.telemetry.events.StepEvent."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RunStatus:
    state: str  # "starting" | "running" | "paused" | "stopping" | "finished" | "failed"
    rollout_id: int  # the next rollout id to train
    num_rollout: int
    weight_version: int
    data_cursor: int
    epoch: int
    last_metrics: dict[str, float] = field(default_factory=dict)
    run_dir: str = ""
    last_checkpoint: str = ""
    error: str = ""


@dataclass(frozen=True)
class EvalRequest:
    timeout_s: float = 0.0


@dataclass(frozen=True)
class EvalResult:
    rollout_id: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class WatchRequest:
    include_history: bool = False  # replay the events recorded so far first
