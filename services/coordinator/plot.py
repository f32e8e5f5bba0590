"""`tandem plot RUN_DIR`: reward, response length, KL and the step-time breakdown as one PNG."""

from __future__ import annotations

import json
from pathlib import Path

PANELS = (
    ("reward", ("rollout/reward_mean", "eval/reward_mean")),
    ("response length", ("rollout/response_len_mean",)),
    ("KL / entropy", ("train/kl", "train/entropy")),
    ("step time breakdown (s)", ("perf/rollout_wait_s", "perf/train_time_s", "perf/weight_sync_time_s",
                                 "perf/step_time_s")),
)


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run directory?")
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    if not rows:
        raise ValueError(f"{path} holds no metrics yet")
    return rows


def plot_run(run_dir: Path, *, out: Path | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")   # no display needed
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(8, 3 * len(PANELS)), sharex=True)
    for ax, (title, keys) in zip(axes, PANELS):
        for key in keys:
            points = [(r["rollout_id"], r[key]) for r in rows if key in r]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="." if len(points) < 50 else None, label=key)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    axes[-1].set_xlabel("rollout id")
    fig.tight_layout()
    out = out or run_dir / "plots.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return [out]
