"""Evaluations of the current weights: in the background between steps, or at once (start-up, `tandem ctl eval`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future

from services.contracts.config import RolloutConfig
from services.contracts.sampling_spec import SamplingSpec
from services.coordinator.data import PromptRecord
from services.coordinator.seams import RolloutPoolApi
from services.telemetry.events import EventLog
from services.telemetry.tracing import span
from services.telemetry.trackers import Tracker


class Evaluator:
    def __init__(
        self,
        *,
        pool: RolloutPoolApi,
        rollout: RolloutConfig,
        prompts: Callable[[], list[PromptRecord]],
        executor: Executor,
        trackers: list[Tracker],
        events: EventLog,
        weight_version: Callable[[], int],
    ):
        self.pool = pool
        self.rollout = rollout
        self.prompts = prompts  # the eval set, read again for every eval
        self.executor = executor  # one eval at a time, beside the loop
        self.trackers = trackers
        self.events = events
        self.weight_version = weight_version
        self._pending: list[Future] = []
        self._evaluated: set[int] = set()
        self._lock = threading.Lock()

    def evaluate(self) -> dict[str, float]:
        prompts = [p.to_input(i) for i, p in enumerate(self.prompts())]
        with span("rl.eval", weight_version=self.weight_version(), prompts=len(prompts)):
            return self.pool.evaluate(
                prompts,
                n_samples=self.rollout.eval_n_samples_per_prompt,
                sampling=SamplingSpec.from_config(self.rollout.eval_sampling),
            )

    def record(self, rollout_id: int, metrics: dict[str, float]) -> dict[str, float]:
        metrics = {**metrics, "weights/version": float(self.weight_version())}
        for tracker in self.trackers:
            tracker.log(rollout_id, metrics)
        self.events.emit("eval", rollout_id=rollout_id, metrics=metrics)
        return metrics

    def run_now(self, rollout_id: int) -> dict[str, float]:
        return self.record(rollout_id, self.evaluate())

    def submit(self, rollout_id: int) -> None:
        with self._lock:
            self._evaluated.add(rollout_id)
            self._pending.append(self.executor.submit(self.run_now, rollout_id))

    def evaluated(self, rollout_id: int) -> bool:
        with self._lock:
            return rollout_id in self._evaluated

    def drain(self) -> None:
        """Waits for every eval submitted so far (raising the first failure)."""
        with self._lock:
            pending = list(self._pending)
        for fut in pending:
            fut.result()
