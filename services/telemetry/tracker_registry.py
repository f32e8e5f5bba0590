"""The metric trackers, by the `type` a `tracing.trackers` entry names: one explicit table.

Each entry builds its tracker from that entry's own keys. An optional tracker's module is imported only when one is
built (TensorBoard pulls in torch, W&B its SDK, Prometheus an HTTP server), and it registers nothing itself; the
optional package it needs is checked before any service starts (`check_tracker_packages`). A test keeps the keys
equal to the config's tracker types.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from services.contracts.config import (
    ConfigError,
    JsonlTrackerConfig,
    PrometheusTrackerConfig,
    TrackerConfig,
    WandbTrackerConfig,
)
from services.telemetry.trackers import JsonlTracker, Tracker


@dataclass(frozen=True)
class RunTarget:
    """Where a run's trackers write."""

    run_dir: Path
    run_name: str


@dataclass(frozen=True)
class TrackerKind:
    name: str
    build: Callable[[TrackerConfig, RunTarget], Tracker]
    package: str | None = None  # the optional package it needs, and how to install it
    install: str = ""


def _jsonl(config: TrackerConfig, run: RunTarget) -> Tracker:
    return JsonlTracker(run.run_dir / "metrics.jsonl")


def _tensorboard(config: TrackerConfig, run: RunTarget) -> Tracker:
    from services.telemetry.tensorboard_tracker import TensorBoardTracker

    return TensorBoardTracker(run.run_dir / "tensorboard")


def _wandb(config: TrackerConfig, run: RunTarget) -> Tracker:
    from services.telemetry.wandb_tracker import WandbTracker

    assert isinstance(config, WandbTrackerConfig)
    return WandbTracker(project=config.project, run_name=run.run_name, run_dir=run.run_dir)


def _prometheus(config: TrackerConfig, run: RunTarget) -> Tracker:
    from services.telemetry.prometheus import PrometheusTracker

    assert isinstance(config, PrometheusTrackerConfig)
    return PrometheusTracker(port=config.port, run_name=run.run_name)


TRACKERS: Mapping[str, TrackerKind] = MappingProxyType(
    {
        t.name: t
        for t in (
            TrackerKind("jsonl", _jsonl),
            TrackerKind("tensorboard", _tensorboard, package="tensorboard", install="pip install tensorboard"),
            TrackerKind("wandb", _wandb, package="wandb", install="pip install 'tandem-rl[wandb]'"),
            TrackerKind("prometheus", _prometheus),
        )
    }
)


def check_tracker_packages(configs: Sequence[TrackerConfig]) -> None:
    """Optional trackers need optional packages: say so before any service starts, naming the key."""
    for config in configs:
        kind = TRACKERS[config.type]
        if kind.package is not None and importlib.util.find_spec(kind.package) is None:
            raise ConfigError(
                f"tracing.trackers: {kind.name} needs the `{kind.package}` package, which is not "
                f"installed ({kind.install}), or drop {kind.name} from tracing.trackers"
            )


def make_trackers(configs: Sequence[TrackerConfig], *, run_dir: Path, run_name: str) -> list[Tracker]:
    """metrics.jsonl always (first, so every other tracker's view is already on disk), then the others in order."""
    check_tracker_packages(configs)
    run = RunTarget(run_dir=run_dir, run_name=run_name)
    trackers: list[Tracker] = []
    try:
        for config in (JsonlTrackerConfig(), *(c for c in configs if c.type != "jsonl")):
            trackers.append(TRACKERS[config.type].build(config, run))
    except Exception:
        for tracker in trackers:  # e.g. a Prometheus endpoint already listening
            tracker.close()
        raise
    return trackers
