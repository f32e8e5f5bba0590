"""What a metric tracker is (`Tracker`), and the one every run has: `metrics.jsonl` (`JsonlTracker`).

The optional ones (TensorBoard, W&B, a Prometheus endpoint) live in their own modules and are built by name through
tracker_registry.py. Trackers get step rows and eval rows (`eval/*` keys) alike."""

from __future__ import annotations

import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path

from services.contracts.files import append_line, write_atomic

log = logging.getLogger(__name__)


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
        self._lock = threading.Lock()  # the eval thread logs too

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
