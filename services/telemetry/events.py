"""The step events of a run (`EventLog`): the coordinator emits them, `WatchEvents` streams them to `tandem ctl`."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

_ACTIVE_POLL_S = 1.0  # WatchEvents: how often a waiting stream asks whether its client is still there


@dataclass(frozen=True)
class StepEvent:
    """What happened in a run: a step, an eval, a save, a sync, a state change (the coordinator's WatchEvents
    sends each as a tandem.v1.StepEvent)."""

    kind: str
    rollout_id: int = -1
    message: str = ""
    unix_time: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


class EventLog:
    """Append-only list of step events; watchers block on a condition until something new arrives."""

    def __init__(self) -> None:
        self._events: list[StepEvent] = []
        self._cond = threading.Condition()
        self._closed = False

    def emit(
        self, kind: str, *, rollout_id: int = -1, metrics: dict[str, float] | None = None, message: str = ""
    ) -> None:
        event = StepEvent(
            kind=kind,
            rollout_id=rollout_id,
            message=message,
            unix_time=time.time(),
            metrics={k: float(v) for k, v in (metrics or {}).items()},
        )
        with self._cond:
            self._events.append(event)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def watch(self, *, include_history: bool, is_active=lambda: True) -> Iterator[StepEvent]:
        with self._cond:
            index = 0 if include_history else len(self._events)
        while True:
            with self._cond:
                while index >= len(self._events) and not self._closed and is_active():
                    self._cond.wait(timeout=_ACTIVE_POLL_S)  # is_active has no way to wake us
                batch = self._events[index:]
                index = len(self._events)
                done = self._closed or not is_active()
            yield from batch
            if done and not batch:
                return
