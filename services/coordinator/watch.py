"""`tandem ctl watch`: a live table of the run from WatchEvents."""

from __future__ import annotations

from rich.console import Console
from rich.live import Live
from rich.table import Table

from services.common.gen.tandem.v1 import coordinator_pb2

COLUMNS = (("rollout/reward_mean", "reward"), ("rollout/response_len_mean", "resp len"), ("train/loss", "loss"),
           ("train/kl", "kl"), ("train/grad_norm", "grad"), ("perf/rollout_time_s", "rollout s"),
           ("perf/train_time_s", "train s"), ("perf/weight_sync_time_s", "sync s"), ("perf/step_time_s", "step s"),
           ("weights/version", "ver"))


def render(rows: list[coordinator_pb2.StepEvent], last_message: str) -> Table:
    table = Table(title=f"tandem run — {last_message}" if last_message else "tandem run")
    table.add_column("step", justify="right")
    for _, label in COLUMNS:
        table.add_column(label, justify="right")
    for event in rows[-20:]:
        m = dict(event.metrics)
        table.add_row(str(event.rollout_id), *(f"{m[k]:.4g}" if k in m else "" for k, _ in COLUMNS))
    return table


def watch_table(stub) -> int:  # type: ignore[no-untyped-def]
    rows: list[coordinator_pb2.StepEvent] = []
    message = ""
    console = Console()
    with Live(render(rows, message), console=console, refresh_per_second=4) as live:
        for event in stub.WatchEvents(coordinator_pb2.WatchRequest(include_history=True)):
            if event.kind == "step":
                rows.append(event)
            elif event.message:
                message = event.message
            live.update(render(rows, message))
    return 0
