"""The metric trackers of a run, built from `tracing`: metrics.jsonl always, then the optional ones. The optional
trackers' modules are imported only when one is built (they pull in torch, wandb or an HTTP server)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from services.contracts.config import ConfigError
from services.telemetry.trackers import JsonlTracker, Tracker


def check_tracker_packages(names: tuple[str, ...]) -> None:
    """Optional trackers need optional packages: say so before any service starts, naming the key."""
    for name, install in (("tensorboard", "pip install tensorboard"), ("wandb", "pip install 'tandem-rl[wandb]'")):
        if name in names and importlib.util.find_spec(name) is None:
            raise ConfigError(f"tracing.trackers: {name} needs the `{name}` package, which is not installed "
                              f"({install}), or drop {name} from tracing.trackers")


def make_trackers(names: tuple[str, ...], *, run_dir: Path, run_name: str, wandb_project: str | None,
                  prometheus_port: int | None = None) -> list[Tracker]:
    """metrics.jsonl always (first, so every other tracker's view is already on disk), then the optional ones."""
    trackers: list[Tracker] = [JsonlTracker(run_dir / "metrics.jsonl")]
    try:
        if "tensorboard" in names:
            check_tracker_packages(("tensorboard",))
            from services.telemetry.tensorboard_tracker import TensorBoardTracker

            trackers.append(TensorBoardTracker(run_dir / "tensorboard"))
        if "wandb" in names:
            check_tracker_packages(("wandb",))
            from services.telemetry.wandb_tracker import WandbTracker

            trackers.append(WandbTracker(project=wandb_project, run_name=run_name, run_dir=run_dir))
        if prometheus_port is not None:
            from services.telemetry.prometheus import PrometheusTracker

            trackers.append(PrometheusTracker(port=prometheus_port, run_name=run_name))
    except Exception:
        for tracker in trackers:   # e.g. a Prometheus endpoint already listening
            tracker.close()
        raise
    return trackers
