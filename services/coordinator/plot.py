"""`tandem plot RUN_DIR`: reward, response length, KL and the step-time breakdown as one PNG.

The PNG says what it holds: its `Tandem-Panels` text chunk is JSON of every panel's title and the metric
keys drawn in it, so a reader (or a test) need not guess from pixels.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from services.contracts.files import read_json_rows

PANELS = (
    ("reward", ("rollout/reward_mean", "eval/reward_mean")),
    ("response length (tokens)", ("rollout/response_len_mean", "eval/response_len_mean")),
    ("KL to the reference or the teacher", ("train/kl", "distill/reverse_kl")),
)
STEP_TIME_TITLE = "step time breakdown (s)"
# Parts of perf/step_time_s, stacked; what they leave unexplained is drawn as "other".
STEP_TIME_PARTS = ("perf/rollout_wait_s", "perf/train_time_s", "perf/weight_sync_time_s", "perf/save_time_s")
STEP_TIME = "perf/step_time_s"
PNG_KEY = "Tandem-Panels"


@dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple[str, ...]  # the metrics drawn (those present in the run)
    points: int  # data points drawn over all keys


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run directory?")
    rows = read_json_rows(path)  # a row being appended as we read is not one yet
    if not rows:
        raise ValueError(f"{path} holds no metrics yet")
    return rows


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """In step order, the last row of a step winning (files of runs older than `rewind` may repeat steps)."""
    points = sorted({r["rollout_id"]: r[key] for r in rows if key in r}.items())
    return [p[0] for p in points], [p[1] for p in points]


def _line_panel(ax: Any, rows: list[dict], *, title: str, keys: tuple[str, ...]) -> Panel:
    drawn, count = [], 0
    for key in keys:
        xs, ys = _series(rows, key)
        if xs:
            ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=key)
            drawn.append(key)
            count += len(xs)
    _finish_axes(
        ax,
        title=title,
        empty=not drawn,
        hint="train/kl appears when algorithm.kl_coef > 0, distill/reverse_kl with algorithm.distillation"
        if "train/kl" in keys
        else "",
    )
    return Panel(title=title, keys=tuple(drawn), points=count)


def _step_time_panel(ax: Any, rows: list[dict]) -> Panel:
    steps = [r for r in rows if STEP_TIME in r]
    xs = [r["rollout_id"] for r in steps]
    parts = [k for k in STEP_TIME_PARTS if any(k in r for r in steps)]
    stacks = [[r.get(k, 0.0) for r in steps] for k in parts]
    other = [max(0.0, r[STEP_TIME] - sum(r.get(k, 0.0) for k in parts)) for r in steps]
    if steps:
        ax.stackplot(xs, *stacks, other, labels=[*parts, "other"], alpha=0.8)
        ax.plot(xs, [r[STEP_TIME] for r in steps], color="black", linewidth=1, label=STEP_TIME)
    _finish_axes(ax, title=STEP_TIME_TITLE, empty=not steps)
    return Panel(title=STEP_TIME_TITLE, keys=tuple([*parts, STEP_TIME]) if steps else (), points=len(steps))


def _finish_axes(ax: Any, *, title: str, empty: bool, hint: str = "") -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title)
    ax.set_xlabel("rollout id")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rollout ids are whole steps
    ax.grid(alpha=0.3)
    if empty:
        ax.text(0.5, 0.5, "no data" + (f"\n({hint})" if hint else ""), ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend(fontsize=7)


def render(rows: list[dict], *, out: Path, title: str = "") -> list[Panel]:
    """Draws the four panels of `rows` into the PNG `out`; returns what each panel shows."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    try:
        grid = axes.flatten()
        panels = [_line_panel(ax, rows, title=t, keys=k) for ax, (t, k) in zip(grid, PANELS, strict=False)]
        panels.append(_step_time_panel(grid[3], rows))
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100, metadata={PNG_KEY: json.dumps([asdict(p) for p in panels])})
    finally:
        plt.close(fig)
    return panels


def plot_run(run_dir: Path, *, out: Path | None = None) -> list[Path]:
    out = out or run_dir / "plots.png"
    render(read_metrics(run_dir), out=out, title=str(run_dir))
    return [out]
