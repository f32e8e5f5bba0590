"""Metric trackers: metrics.jsonl, the optional TensorBoard plug-in (not installed here: a clear error), W&B offline
against the real package (the dev extra installs it), and the Prometheus endpoint served over real HTTP."""

from __future__ import annotations

import importlib.util
import json
import math
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from services.contracts.config import PrometheusTrackerConfig, TensorBoardTrackerConfig, WandbTrackerConfig
from services.telemetry.prometheus import PrometheusTracker, metric_name, render
from services.telemetry.tracker_registry import make_trackers
from services.telemetry.trackers import JsonlTracker
from services.telemetry.wandb_tracker import WandbTracker


def scrape(port: int, path: str = "/metrics") -> tuple[str, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
        return reply.headers["Content-Type"], reply.read().decode()


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed")
def test_tensorboard_tracker_without_the_package_says_what_to_do(tmp_path: Path):
    with pytest.raises(ValueError) as err:
        make_trackers([TensorBoardTrackerConfig()], run_dir=tmp_path, run_name="r")
    assert str(err.value) == (
        "tracing.trackers: tensorboard needs the `tensorboard` package, which is not installed "
        "(pip install tensorboard), or drop tensorboard from tracing.trackers"
    )


def test_jsonl_tracker_appends_one_row_per_log(tmp_path: Path):
    tracker = JsonlTracker(tmp_path / "metrics.jsonl")
    tracker.log(0, {"rollout/reward_mean": 0.25})
    tracker.log(-1, {"eval/reward_mean": 0.5})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["rollout_id"], r.get("rollout/reward_mean"), r.get("eval/reward_mean")) for r in rows] == [
        (0, 0.25, None),
        (-1, None, 0.5),
    ]
    assert all(isinstance(r["time"], float) for r in rows)


def test_prometheus_names_and_text_format():
    assert metric_name("rollout/reward_mean") == "tandem_rollout_reward_mean"
    assert metric_name("eval/pass@1") == "tandem_eval_pass_1"
    text = render({"tandem_b": 1.5, "tandem_a": math.nan, "tandem_c": math.inf}, run_name='x"y\\z')
    assert text == (
        '# TYPE tandem_a gauge\ntandem_a{run="x\\"y\\\\z"} NaN\n'
        '# TYPE tandem_b gauge\ntandem_b{run="x\\"y\\\\z"} 1.5\n'
        '# TYPE tandem_c gauge\ntandem_c{run="x\\"y\\\\z"} +Inf\n'
    )


def test_prometheus_endpoint_serves_the_latest_values_over_http(tmp_path: Path):
    trackers = make_trackers([PrometheusTrackerConfig(port=0)], run_dir=tmp_path, run_name="demo")
    [prom] = [t for t in trackers if isinstance(t, PrometheusTracker)]
    try:
        assert prom.host == "127.0.0.1" and prom.port > 0
        for tracker in trackers:
            tracker.log(3, {"rollout/reward_mean": 0.5, "perf/step_time_s": 0.25})
            tracker.log(4, {"rollout/reward_mean": 0.75})
            tracker.log(3, {"eval/reward_mean": 0.9})  # an eval of an earlier step arrives late
        content_type, text = scrape(prom.port)
        assert content_type == "text/plain; version=0.0.4; charset=utf-8"
        samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
        assert samples['tandem_rollout_reward_mean{run="demo"}'] == "0.75"
        assert samples['tandem_perf_step_time_s{run="demo"}'] == "0.25"
        assert samples['tandem_eval_reward_mean{run="demo"}'] == "0.9"
        assert samples['tandem_rollout_id{run="demo"}'] == "4.0"  # never goes back
        with pytest.raises(urllib.error.HTTPError, match="404"):
            scrape(prom.port, "/")
    finally:
        for tracker in trackers:
            tracker.close()
    with pytest.raises(OSError):  # closed: nothing listens any more
        socket.create_connection(("127.0.0.1", prom.port), timeout=2).close()


def test_prometheus_port_in_use_is_a_clear_error(tmp_path: Path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"tracing.trackers: prometheus cannot listen on 127.0.0.1:{port}"):
            make_trackers([PrometheusTrackerConfig(port=port)], run_dir=tmp_path, run_name="r")


# ---- Weights & Biases, offline (WANDB_MODE=offline: no network, no login) ----------------------------------------


def test_a_configured_wandb_tracker_without_the_package_is_one_line_at_start(tmp_path, monkeypatch, capsys):
    from services.cli import main

    monkeypatch.setitem(sys.modules, "wandb", None)  # what find_spec sees when wandb is not installed
    (tmp_path / "ok.yaml").write_text("model: {path: m}\ndata: {train_path: d.jsonl}\n")
    assert main(["run", str(tmp_path / "ok.yaml"), "--set", "tracing.trackers=[jsonl, wandb]"]) == 2
    assert capsys.readouterr().err == (
        "tandem: tracing.trackers: wandb needs the `wandb` package, which is not installed "
        "(pip install 'tandem-rl[wandb]'), or drop wandb from tracing.trackers\n"
    )


def _wandb_attempt(run_dir: Path, *, next_step: int, steps: range, eval_after: dict[int, int] | None = None) -> str:
    """One coordinator's life: make_trackers, the start-up's rewind, step rows (and eval rows of an earlier step,
    logged late as the asynchronous eval does), close. Returns the W&B run id."""
    start = int(time.time())  # wandb names a run's directory by the second it started: one attempt per second
    while int(time.time()) == start:
        time.sleep(0.05)
    trackers = make_trackers([WandbTrackerConfig(project="tandem-test")], run_dir=run_dir, run_name="demo")
    for tracker in trackers:
        tracker.rewind(next_step=next_step)
    for step in steps:
        for tracker in trackers:
            tracker.log(step, {"rollout/reward_mean": step / 10})
            if eval_after and step in eval_after:
                tracker.log(eval_after[step], {"eval/reward_mean": 0.5})
    wandb_tracker = trackers[1]
    assert isinstance(wandb_tracker, WandbTracker)
    run_id = wandb_tracker.run_id
    for tracker in trackers:
        tracker.close()
    return run_id


@pytest.mark.timeout(180)
def test_wandb_offline_resumes_its_run_id_and_never_logs_a_step_twice(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from helpers.wandb_records import finished_runs

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    first = _wandb_attempt(run_dir, next_step=0, steps=range(5), eval_after={3: 2})  # crashed after step 4
    second = _wandb_attempt(run_dir, next_step=3, steps=range(3, 7))  # resumed from the checkpoint of step 2
    third = _wandb_attempt(run_dir, next_step=7, steps=range(7, 9))  # resumed with nothing to rewind
    assert first == second == third

    runs = finished_runs(run_dir, count=3)
    assert [r.run_id for r in runs] == [first] * 3
    assert runs[0].steps == [0, 1, 2, 3, 4] and runs[0].branch is None
    late_eval = next(row for row in runs[0].rows if "eval/reward_mean" in row)
    assert late_eval["_step"] == 3 and late_eval["eval/rollout_id"] == 2  # joined the newest row, own x-axis
    assert runs[1].branch == (first, 2.0) and runs[1].steps == [3, 4, 5, 6]  # history after step 2 replaced
    assert runs[2].branch is None and runs[2].steps == [7, 8]
    # what W&B holds once synced: each segment truncated at the next one's rewind point, then appended
    history: list[tuple[int, float]] = []
    for run in runs:
        if run.branch is not None:
            history = [(s, v) for s, v in history if s <= run.branch[1]]
        history += [(int(row["_step"]), float(row["rollout/reward_mean"])) for row in run.rows]  # type: ignore[call-overload, arg-type]
    assert [s for s, _ in history] == list(range(9))  # every step once
    assert dict(history)[4] == 0.4
    # and it agrees with metrics.jsonl, rewound by the same rule
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in rows if "rollout/reward_mean" in r] == list(range(9))


@pytest.mark.timeout(120)
def test_wandb_a_run_that_starts_over_from_rollout_0_gets_a_new_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from helpers.wandb_records import finished_runs

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    first = _wandb_attempt(run_dir, next_step=0, steps=range(2))  # crashed before its first checkpoint
    again = _wandb_attempt(run_dir, next_step=0, steps=range(3))
    assert first != again
    assert [(r.run_id, r.steps) for r in finished_runs(run_dir, count=2)] == [(first, [0, 1]), (again, [0, 1, 2])]
