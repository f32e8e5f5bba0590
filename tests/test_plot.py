"""`tandem plot` on what is not (yet) a run's metrics, and panels without data. The plot of a real run's
metrics is in tests/test_observability.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.coordinator.plot import plot_run, render

REPO = Path(__file__).resolve().parents[1]


def test_missing_or_empty_metrics_are_clear_errors(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=r"is .* a run directory"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="holds no metrics yet"):
        plot_run(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "plot", str(tmp_path / "nowhere")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert done.returncode != 0 and "a run directory" in done.stderr


def test_panels_without_their_metrics_say_so(tmp_path: Path):
    from PIL import Image

    rows = [{"rollout_id": 0, "rollout/reward_mean": 0.1}, {"rollout_id": 1, "rollout/reward_mean": 0.2}]
    panels = render(rows, out=tmp_path / "p.png")
    assert [(p.title, p.keys, p.points) for p in panels] == [
        ("reward", ("rollout/reward_mean",), 2),
        ("response length (tokens)", (), 0),
        ("KL to the reference or the teacher", (), 0),
        ("step time breakdown (s)", (), 0),
    ]
    distilled = [{**r, "distill/reverse_kl": 3.0 - r["rollout_id"]} for r in rows]
    assert render(distilled, out=tmp_path / "d.png")[2].keys == ("distill/reverse_kl",)
    with Image.open(tmp_path / "p.png") as image:
        assert [p["title"] for p in json.loads(image.info["Tandem-Panels"])] == [p.title for p in panels]
