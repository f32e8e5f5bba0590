"""Per-step metrics: `metrics.jsonl` always; TensorBoard, W&B and a Prometheus endpoint as optional trackers;
and an event log that `WatchEvents` streams from. Trackers get step rows and eval rows (`eval/*` keys) alike."""

from __future__ import annotations

import importlib.util
import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path

from services.contracts.config import ConfigError
from services.contracts.files import append_line, write_atomic
from services.contracts.gen.tandem.v1 import coordinator_pb2

log = logging.getLogger(__name__)

_ACTIVE_POLL_S = 1.0   # WatchEvents: how often a waiting stream asks whether its client is still there


class Tracker(ABC):
    @abstractmethod
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def rewind(self, *, next_step: int) -> None:  # noqa: B027 - optional hook, a no-op unless overridden
        """A resumed run trains again from next_step: forget what was logged for it and later steps."""

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op unless overridden
        pass


class JsonlTracker(Tracker):
    """RUN_DIR/metrics.jsonl: one JSON object per step or eval, `rollout_id` and `time` first."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()   # the eval thread logs too

    def log(self, step: int, metrics: dict[str, float]) -> None:
        line = json.dumps({"rollout_id": step, "time": time.time(), **metrics})
        with self._lock:
            append_line(self.path, line)

    def rewind(self, *, next_step: int) -> None:
        """Keeps the rows of steps before next_step (all of them go when the run starts over from 0, the
        pre-training eval included); a torn last line of a crashed run goes too. Rewritten atomically."""
        if not self.path.exists():
            return
        kept, dropped = [], 0
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                step = json.loads(line)["rollout_id"]
                keep = next_step > 0 and isinstance(step, int) and step < next_step
            except (ValueError, KeyError, TypeError):
                keep = False
            if keep:
                kept.append(line + "\n")
            else:
                dropped += line.strip() != ""
        if dropped:
            write_atomic(self.path, "".join(kept))
            log.info("%s: dropped %d rows of steps from %d on (they are trained again)", self.path, dropped, next_step)


def check_tracker_packages(names: tuple[str, ...]) -> None:
    """Optional trackers need optional packages: say so before any service starts, naming the key."""
    for name, install in (("tensorboard", "pip install tensorboard"), ("wandb", "pip install 'tandem-rl[wandb]'")):
        if name in names and importlib.util.find_spec(name) is None:
            raise ConfigError(f"tracing.trackers: {name} needs the `{name}` package, which is not installed "
                              f"({install}), or drop {name} from tracing.trackers")


class TensorBoardTracker(Tracker):
    def __init__(self, log_dir: Path):
        check_tracker_packages(("tensorboard",))
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def rewind(self, *, next_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = self.writer.log_dir
        self.writer.close()   # purge_step: TensorBoard hides the old events of steps >= next_step
        self.writer = SummaryWriter(log_dir=log_dir, purge_step=next_step)

    def close(self) -> None:
        self.writer.close()


def make_trackers(names: tuple[str, ...], *, run_dir: Path, run_name: str, wandb_project: str | None,
                  prometheus_port: int | None = None) -> list[Tracker]:
    """metrics.jsonl always (first, so every other tracker's view is already on disk), then the optional ones."""
    trackers: list[Tracker] = [JsonlTracker(run_dir / "metrics.jsonl")]
    try:
        if "tensorboard" in names:
            trackers.append(TensorBoardTracker(run_dir / "tensorboard"))
        if "wandb" in names:
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


class EventLog:
    """Append-only list of step events; watchers block on a condition until something new arrives."""

    def __init__(self) -> None:
        self._events: list[coordinator_pb2.StepEvent] = []
        self._cond = threading.Condition()
        self._closed = False

    def emit(self, kind: str, *, rollout_id: int = -1, metrics: dict[str, float] | None = None,
             message: str = "") -> None:
        event = coordinator_pb2.StepEvent(kind=kind, rollout_id=rollout_id, message=message, unix_time=time.time(),
                                          metrics={k: float(v) for k, v in (metrics or {}).items()})
        with self._cond:
            self._events.append(event)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def watch(self, *, include_history: bool, is_active=lambda: True) -> Iterator[coordinator_pb2.StepEvent]:
        with self._cond:
            index = 0 if include_history else len(self._events)
        while True:
            with self._cond:
                while index >= len(self._events) and not self._closed and is_active():
                    self._cond.wait(timeout=_ACTIVE_POLL_S)   # is_active has no way to wake us
                batch = self._events[index:]
                index = len(self._events)
                done = self._closed or not is_active()
            yield from batch
            if done and not batch:
                return
