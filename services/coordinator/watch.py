"""`tandem ctl watch`: a live table of the run from WatchEvents (history first, then as it happens).

Exits when the coordinator closes the stream at the end of the run: 0 when the run finished or stopped,
1 when it failed. On a terminal the table redraws in place; piped, it prints one line per event as it
arrives and the final table at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.console import Console
from rich.live import Live
from rich.table import Table

from services.contracts.gen.tandem.v1 import coordinator_pb2, coordinator_pb2_grpc

COLUMNS = (
    ("rollout/reward_mean", "reward"),
    ("rollout/response_len_mean", "resp len"),
    ("train/loss", "loss"),
    ("train/kl", "kl"),
    ("train/grad_norm", "grad"),
    ("rollout/staleness", "stale"),
    ("perf/rollout_time_s", "rollout s"),
    ("perf/train_time_s", "train s"),
    ("perf/weight_sync_time_s", "sync s"),
    ("perf/step_time_s", "step s"),
    ("perf/tokens_per_s", "tok/s"),
    ("weights/version", "ver"),
)
SHOWN_ROWS = 20


@dataclass
class WatchState:
    steps: list[coordinator_pb2.StepEvent] = field(default_factory=list)
    message: str = ""  # the latest state message ("running", "finished", "failed: ...")
    last_eval: str = ""
    last_save: str = ""
    state: str = ""

    def on_event(self, event: coordinator_pb2.StepEvent) -> None:
        if event.kind == "step":
            self.steps.append(event)
        elif event.kind == "eval":
            m = dict(event.metrics)
            shown = "  ".join(f"{k} {v:.3f}" for k, v in sorted(m.items()) if k.endswith(("reward_mean", "pass@1")))
            self.last_eval = f"eval after rollout {event.rollout_id}: {shown}"
        elif event.kind == "save":
            self.last_save = f"checkpoint of rollout {event.rollout_id}: {event.message}"
        elif event.kind == "state" and event.message:
            self.message = event.message
            self.state = event.message.split(":")[0].split()[0]

    @property
    def failed(self) -> bool:
        return self.state == "failed"


def render(state: WatchState) -> Table:
    table = Table(
        title=f"tandem run — {state.message}" if state.message else "tandem run",
        caption="\n".join(x for x in (state.last_eval, state.last_save) if x) or None,
    )
    table.add_column("step", justify="right")
    for _, label in COLUMNS:
        table.add_column(label, justify="right")
    for event in state.steps[-SHOWN_ROWS:]:
        m = dict(event.metrics)
        table.add_row(str(event.rollout_id), *(f"{m[k]:.4g}" if k in m else "" for k, _ in COLUMNS))
    return table


def event_line(event: coordinator_pb2.StepEvent) -> str:
    """One plain line per event, for a pipe or a log file."""
    m = dict(event.metrics)
    if event.kind == "step":
        return f"step {event.rollout_id}: " + "  ".join(f"{label} {m[k]:.4g}" for k, label in COLUMNS if k in m)
    if event.kind in ("eval", "sync"):
        return f"{event.kind} {event.rollout_id}: " + "  ".join(f"{k} {v:.4g}" for k, v in sorted(m.items()))
    return f"{event.kind} {event.rollout_id}: {event.message}"


def watch_table(stub: coordinator_pb2_grpc.CoordinatorStub, *, console: Console | None = None) -> int:
    console = console or Console()
    state = WatchState()
    events = stub.WatchEvents(coordinator_pb2.WatchRequest(include_history=True))
    if console.is_terminal:
        with Live(render(state), console=console, refresh_per_second=4) as live:
            for event in events:
                state.on_event(event)
                live.update(render(state))
    else:  # piped: a line per event as it happens (a redrawn table would only show at the end), then the table
        for event in events:
            state.on_event(event)
            print(event_line(event), flush=True)
        console.print(render(state))
    return 1 if state.failed else 0
