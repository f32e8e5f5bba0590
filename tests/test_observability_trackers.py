"""Metric trackers: metrics.jsonl, the optional TensorBoard / W&B plug-ins (not installed here: a clear error),
and the Prometheus endpoint served over real HTTP."""

from __future__ import annotations

import importlib.util
import json
import math
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from services.telemetry.prometheus import PrometheusTracker, metric_name, render
from services.telemetry.trackers import JsonlTracker, make_trackers


def scrape(port: int, path: str = "/metrics") -> tuple[str, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
        return reply.headers["Content-Type"], reply.read().decode()


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed")
def test_tensorboard_tracker_without_the_package_says_what_to_do(tmp_path: Path):
    with pytest.raises(ValueError) as err:
        make_trackers(("jsonl", "tensorboard"), run_dir=tmp_path, run_name="r", wandb_project=None)
    assert str(err.value) == ("tracing.trackers: tensorboard needs the `tensorboard` package, which is not installed "
                              "(pip install tensorboard), or drop tensorboard from tracing.trackers")


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_tracker_without_the_package_says_what_to_do(tmp_path: Path):
    with pytest.raises(ValueError, match=r"wandb needs the `wandb` package.*\(pip install wandb\)"):
        make_trackers(("jsonl", "wandb"), run_dir=tmp_path, run_name="r", wandb_project=None)


def test_jsonl_tracker_appends_one_row_per_log(tmp_path: Path):
    tracker = JsonlTracker(tmp_path / "metrics.jsonl")
    tracker.log(0, {"rollout/reward_mean": 0.25})
    tracker.log(-1, {"eval/reward_mean": 0.5})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["rollout_id"], r.get("rollout/reward_mean"), r.get("eval/reward_mean")) for r in rows] == \
           [(0, 0.25, None), (-1, None, 0.5)]
    assert all(isinstance(r["time"], float) for r in rows)


def test_prometheus_names_and_text_format():
    assert metric_name("rollout/reward_mean") == "tandem_rollout_reward_mean"
    assert metric_name("eval/pass@1") == "tandem_eval_pass_1"
    text = render({"tandem_b": 1.5, "tandem_a": math.nan, "tandem_c": math.inf}, run_name='x"y\\z')
    assert text == ('# TYPE tandem_a gauge\ntandem_a{run="x\\"y\\\\z"} NaN\n'
                    '# TYPE tandem_b gauge\ntandem_b{run="x\\"y\\\\z"} 1.5\n'
                    '# TYPE tandem_c gauge\ntandem_c{run="x\\"y\\\\z"} +Inf\n')


def test_prometheus_endpoint_serves_the_latest_values_over_http(tmp_path: Path):
    trackers = make_trackers(("jsonl",), run_dir=tmp_path, run_name="demo", wandb_project=None, prometheus_port=0)
    [prom] = [t for t in trackers if isinstance(t, PrometheusTracker)]
    try:
        assert prom.host == "127.0.0.1" and prom.port > 0
        for tracker in trackers:
            tracker.log(3, {"rollout/reward_mean": 0.5, "perf/step_time_s": 0.25})
            tracker.log(4, {"rollout/reward_mean": 0.75})
            tracker.log(3, {"eval/reward_mean": 0.9})   # an eval of an earlier step arrives late
        content_type, text = scrape(prom.port)
        assert content_type == "text/plain; version=0.0.4; charset=utf-8"
        samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
        assert samples['tandem_rollout_reward_mean{run="demo"}'] == "0.75"
        assert samples['tandem_perf_step_time_s{run="demo"}'] == "0.25"
        assert samples['tandem_eval_reward_mean{run="demo"}'] == "0.9"
        assert samples['tandem_rollout_id{run="demo"}'] == "4.0"   # never goes back
        with pytest.raises(urllib.error.HTTPError, match="404"):
            scrape(prom.port, "/")
    finally:
        for tracker in trackers:
            tracker.close()
    with pytest.raises(OSError):   # closed: nothing listens any more
        socket.create_connection(("127.0.0.1", prom.port), timeout=2).close()


def test_prometheus_port_in_use_is_a_clear_error(tmp_path: Path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"tracing.prometheus_port: cannot listen on 127.0.0.1:{port}"):
            make_trackers(("jsonl",), run_dir=tmp_path, run_name="r", wandb_project=None, prometheus_port=port)
