"""Live progress of a run in the terminal: a bar with reward and step time (rich), or plain log lines."""

from __future__ import annotations

import logging
import threading

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from services.contracts.gen.tandem.v1 import coordinator_pb2

log = logging.getLogger("tandem.run")

EVAL_SUMMARY_KEYS = ("reward_mean", "pass@1", "pass@4", "pass@8", "response_len_mean")


def step_summary(metrics: dict[str, float]) -> str:
    parts = []
    for key, label, fmt in (
        ("rollout/reward_mean", "reward", "{:.3f}"),
        ("train/loss", "loss", "{:.4f}"),
        ("perf/step_time_s", "step", "{:.2f}s"),
        ("rollout/staleness", "stale", "{:.0f}"),
        ("weights/version", "v", "{:.0f}"),
    ):
        if key in metrics:
            parts.append(f"{label} {fmt.format(metrics[key])}")
    return "  ".join(parts)


class ProgressView:
    """The bar, fed from the supervisor's WatchEvents thread. The run's length may arrive before the bar starts
    (set_total on that thread, __enter__ on the main one): the bar starts with it, so it shows 80/80, never 80/?."""

    def __init__(self, *, enabled: bool, console: Console | None = None):
        self.enabled = enabled
        self.progress = (
            Progress(
                TextColumn("[bold]tandem"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[summary]}"),
                TimeElapsedColumn(),
                console=console,
            )
            if enabled
            else None
        )
        self.task: TaskID | None = None
        self.total = 0
        self._start = 0
        self._lock = threading.Lock()

    def __enter__(self) -> ProgressView:
        if self.progress is not None:
            self.progress.start()
            with self._lock:
                total = self.total or None
                self.task = self.progress.add_task("run", total=total, completed=self._start, summary="starting…")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()

    def set_total(self, total: int, *, start: int) -> None:
        with self._lock:
            self.total, self._start = total, start
            if self.progress is not None and self.task is not None and total:
                self.progress.update(self.task, total=total, completed=start)

    def on_event(self, event: coordinator_pb2.StepEvent) -> None:
        metrics = dict(event.metrics)
        if event.kind == "step":
            summary = step_summary(metrics)
            if self.progress is not None and self.task is not None:
                self.progress.update(self.task, completed=event.rollout_id + 1, summary=summary)
            else:
                log.info("step %d/%s  %s", event.rollout_id + 1, self.total or "?", summary)
        elif event.kind == "eval":
            evals = "  ".join(
                f"{k} {v:.3f}"
                for k, v in sorted(metrics.items())
                if k.startswith("eval/") and k.split("/")[-1] in EVAL_SUMMARY_KEYS
            )
            self._print(f"eval after rollout {event.rollout_id}: {evals}")
        elif event.kind == "save":
            self._print(f"checkpoint: {event.message}")
        elif event.kind == "state" and event.message:
            self._print(event.message)

    def _print(self, text: str) -> None:
        if self.progress is not None:
            # one record a line whatever the width (a pipe's console is 80 wide): no wrap, no markup in metrics
            self.progress.console.print(text, soft_wrap=True, markup=False, highlight=False)
        else:
            log.info("%s", text)
