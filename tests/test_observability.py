"""Observability of one real `tandem run` (every service its own process, a real redis-server) with the file
exporter, a Prometheus port and `tandem ctl watch` attached:

- one trace per step (rl.loop root), spans of coordinator, rollout and trainer in it, the parent/child
  structure of docs/observability.md, the trainer's rl.train linked to the rl.sample spans it trained on;
- log lines of the services carry the step's trace id;
- the Prometheus endpoint serves the last step's metrics (scraped while the run is paused, so it is stable);
- `tandem ctl watch` shows every step and exits when the run ends;
- `tandem plot` renders the run's metrics into a PNG with its four panels.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from tandem_runs import REPO, coordinator_target, metrics, start_run, stop_run, supervisor_log, wait_status

from services.contracts.gen.tandem.v1 import common_pb2, coordinator_pb2_grpc
from services.rpc.grpc_util import open_channel
from services.rpc.ports import free_port

pytestmark = pytest.mark.slow

SERVICES = {"tandem-coordinator", "tandem-rollout", "tandem-trainer"}
SAVE_INTERVAL = EVAL_INTERVAL = 2


@dataclass
class Observed:
    run_dir: Path
    spans: list[dict]
    scrape: str
    rows_while_paused: list[dict]
    watch_out: str
    watch_rc: int

    def __post_init__(self) -> None:
        self.by_id = {s["span_id"]: s for s in self.spans}
        self.by_trace: dict[str, list[dict]] = collections.defaultdict(list)
        for s in self.spans:
            self.by_trace[s["trace_id"]].append(s)
        self.loops = {s["attributes"]["rl.rollout_id"]: s for s in self.spans if s["name"] == "rl.loop"}
        self.steps = [r["rollout_id"] for r in metrics(self.run_dir) if "rollout/reward_mean" in r]
        last = self.steps[-1]
        # The run is stopped: its last step is saved and evaluated (inside the step, or after it in its trace).
        self.saved = {k for k in self.steps if (k + 1) % SAVE_INTERVAL == 0} | {last}
        self.evaluated = {k for k in self.steps if (k + 1) % EVAL_INTERVAL == 0} | {last}
        self.num_evals = 1 + len(self.evaluated)  # and one before training, under rl.startup

    def find(self, name: str, service: str, rollout_id: int | None = None) -> list[dict]:
        return [
            s
            for s in self.spans
            if s["name"] == name
            and s["service"] == service
            and (rollout_id is None or s["attributes"].get("rl.rollout_id") == rollout_id)
        ]

    def chain(self, span: dict) -> list[tuple[str, str, str]]:
        """(name, service, kind) of the span's ancestors, nearest first, up to the root."""
        out, parent = [], span["parent_span_id"]
        while parent is not None:
            p = self.by_id[parent]  # a missing parent would mean a span was lost or never ended
            out.append((p["name"], p["service"], p["kind"]))
            parent = p["parent_span_id"]
        return out


def _http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return reply.read().decode()


def _wait_port(target: str, *, timeout_s: float = 120.0) -> None:
    """Until the coordinator listens: a gRPC channel made earlier would back off for a second or more."""
    host, port = target.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex((host, int(port))) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {target}")


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Observed:
    """A run paused after its first steps (Prometheus scraped, `ctl watch` attached), resumed, then stopped."""
    run_dir = tmp_path_factory.mktemp("observed") / "run"
    port = free_port()
    proc = start_run(
        run_dir,
        "loop.num_rollout=100000",
        f"loop.eval_interval={EVAL_INTERVAL}",
        f"loop.save_interval={SAVE_INTERVAL}",
        "tracing.exporter=file",
        f"tracing.trackers=[jsonl, {{type: prometheus, port: {port}}}]",
        "algorithm.kl_coef=0.001",
    )
    watch = None
    try:
        target = coordinator_target(run_dir)
        _wait_port(target)
        with open_channel(target) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            wait_status(target, lambda s: s.state == "running" and s.rollout_id >= 1, what="its first step")
            stub.Pause(common_pb2.Empty(), timeout=10)
            paused_at = wait_status(target, lambda s: s.state == "paused", what="paused").rollout_id
            scrape = _http_get(f"http://127.0.0.1:{port}/metrics")
            rows_while_paused = metrics(run_dir)
            with pytest.raises(urllib.error.HTTPError, match="404"):
                _http_get(f"http://127.0.0.1:{port}/other")
            watch = subprocess.Popen(
                [sys.executable, "-m", "services.cli", "ctl", "--addr", target, "watch"],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=REPO,
                env={**os.environ, "COLUMNS": "200"},
            )
            assert watch.stdout is not None
            first = watch.stdout.readline()  # the history comes first: the watcher is connected
            stub.Resume(common_pb2.Empty(), timeout=10)
            wait_status(target, lambda s: s.rollout_id > paused_at, what="a step after resuming")
            stub.Stop(common_pb2.Empty(), timeout=10)
        assert proc.wait(timeout=300) == 0, supervisor_log(run_dir)
        watch_out = first + watch.stdout.read()  # to EOF: watch exits by itself when the run ends
        watch_rc = watch.wait(timeout=60)
    finally:
        stop_run(proc)
        if watch is not None and watch.poll() is None:
            watch.kill()
    spans = [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]
    return Observed(
        run_dir=run_dir,
        spans=spans,
        scrape=scrape,
        rows_while_paused=rows_while_paused,
        watch_out=watch_out,
        watch_rc=watch_rc,
    )


def test_one_trace_per_step_with_spans_of_all_three_services(observed):
    assert observed.steps == list(range(len(observed.steps))) and len(observed.steps) >= 2
    loops = observed.loops
    # stopped in async mode: the next step's generation had started (its trace opened) but was never trained
    [untrained] = [k for k, s in loops.items() if s["attributes"].get("rl.trained") is False]
    assert sorted(loops) == [*observed.steps, untrained] and untrained == observed.steps[-1] + 1
    assert len({s["trace_id"] for s in loops.values()}) == len(loops)
    for rollout_id, loop in loops.items():
        assert loop["parent_span_id"] is None and loop["service"] == "tandem-coordinator"
        assert loop["attributes"]["rl.mode"] == "async" and "rl.weight_version" in loop["attributes"]
        step = observed.by_trace[loop["trace_id"]]
        names = {s["name"] for s in step}
        if rollout_id == untrained:
            assert "rl.sample" in names and "rl.train" not in names, names
            continue
        assert {s["service"] for s in step} == SERVICES, rollout_id
        assert {"rl.sample", "rl.reward", "rl.train", "rl.sync"} <= names, (rollout_id, names)
        assert ("rl.save" in names) == (rollout_id in observed.saved), rollout_id
        assert ("rl.eval" in names) == (rollout_id in observed.evaluated), rollout_id
        assert loop["attributes"]["rl.tokens"] > 0 and loop["attributes"]["rl.step_time_s"] > 0
    # every span that names a rollout id lies in that step's trace, whichever process made it
    for s in observed.spans:
        rollout_id = s["attributes"].get("rl.rollout_id", -1)
        if rollout_id >= 0:
            assert s["trace_id"] == loops[rollout_id]["trace_id"], s


def test_parent_child_structure(observed):
    coordinator, rollout, trainer = "tandem-coordinator", "tandem-rollout", "tandem-trainer"
    loop = ("rl.loop", coordinator, "INTERNAL")

    def rpc(method: str, service: str) -> list[tuple[str, str, str]]:
        return [(method, service, "SERVER"), (method, coordinator, "CLIENT")]

    def coordinator_span(name: str) -> tuple[str, str, str]:
        return (name, coordinator, "INTERNAL")

    for k in observed.steps:
        [sample] = observed.find("rl.sample", rollout, k)
        assert observed.chain(sample) == [*rpc("/tandem.v1.Rollout/Generate", rollout), loop]
        [reward] = observed.find("rl.reward", rollout, k)
        assert reward["parent_span_id"] == sample["span_id"]
        [outer] = observed.find("rl.train", coordinator, k)
        assert observed.chain(outer) == [loop]
        [inner] = observed.find("rl.train", trainer, k)
        assert observed.chain(inner) == [*rpc("/tandem.v1.Trainer/Train", trainer), coordinator_span("rl.train"), loop]
        trace = observed.by_trace[observed.loops[k]["trace_id"]]
        syncs = {s["service"]: s for s in trace if s["name"] == "rl.sync"}
        sync = coordinator_span("rl.sync")
        assert observed.chain(syncs[coordinator]) == [loop]
        assert observed.chain(syncs[trainer]) == [*rpc("/tandem.v1.Trainer/PublishWeights", trainer), sync, loop]
        assert observed.chain(syncs[rollout]) == [*rpc("/tandem.v1.Rollout/ReceiveWeights", rollout), sync, loop]
        assert syncs[coordinator]["attributes"]["rl.bytes"] == syncs[trainer]["attributes"]["rl.bytes"] > 0
    for k in observed.saved:
        [save] = observed.find("rl.save", trainer, k)
        assert observed.chain(save) == [*rpc("/tandem.v1.Trainer/Save", trainer), coordinator_span("rl.save"), loop]
    evals = [s for s in observed.spans if s["name"] == "rl.eval.generate"]
    assert len(evals) == observed.num_evals
    for s in evals:  # under rl.startup (before training) or a step's rl.loop
        chain = observed.chain(s)
        assert chain[:3] == [*rpc("/tandem.v1.Rollout/Evaluate", rollout), coordinator_span("rl.eval")]
        assert chain[3:] in ([coordinator_span("rl.startup")], [loop])
    assert sum(observed.chain(s)[3:] == [loop] for s in evals) == len(observed.evaluated)


def test_trainer_span_links_to_the_rollout_span_that_produced_its_batch(observed):
    steps = {r["rollout_id"]: r for r in metrics(observed.run_dir) if "rollout/reward_mean" in r}
    for k in observed.steps:
        samples = observed.find("rl.sample", "tandem-rollout", k)
        [train] = observed.find("rl.train", "tandem-trainer", k)
        assert {(lk["trace_id"], lk["span_id"]) for lk in train["links"]} == {
            (s["trace_id"], s["span_id"]) for s in samples
        }
        attrs = train["attributes"]
        assert attrs["rl.entries"] == len(samples) and attrs["rl.bytes"] > 0
        assert attrs["rl.samples"] == sum(s["attributes"]["rl.samples"] for s in samples)
        assert attrs["rl.staleness"] == steps[k]["rollout/staleness"]
        assert samples[0]["attributes"]["rl.entry_id"] and samples[0]["attributes"]["rl.tokens"] > 0


def test_service_logs_carry_the_step_trace_ids(observed):
    logs = observed.run_dir / "logs"
    for k in observed.steps:
        trace_id = observed.loops[k]["trace_id"]
        trainer = [line for line in (logs / "trainer.log").read_text().splitlines() if f"rollout {k}: step" in line]
        assert len(trainer) == 1 and f"trace={trace_id} " in trainer[0], trainer
    saved = [line for line in (logs / "coordinator.log").read_text().splitlines() if "saved rollout" in line]
    assert len(saved) == len(observed.saved)
    for line in saved:
        k = int(line.split("saved rollout ")[1].split()[0])
        assert f"trace={observed.loops[k]['trace_id']} " in line, line


def test_prometheus_endpoint_serves_the_last_step(observed):
    values, types = {}, set()
    for line in observed.scrape.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:]
            assert kind == "gauge"
            types.add(name)
        else:
            sample, value = line.rsplit(" ", 1)
            name, labels = sample.split("{")
            assert labels == 'run="digit_max"}' and name in types, line
            values[name] = float(value)
    last = max((r for r in observed.rows_while_paused if "rollout/reward_mean" in r), key=lambda r: r["rollout_id"])
    assert values["tandem_rollout_id"] == last["rollout_id"]
    for key, name in (
        ("rollout/reward_mean", "tandem_rollout_reward_mean"),
        ("train/kl", "tandem_train_kl"),
        ("perf/step_time_s", "tandem_perf_step_time_s"),
        ("weights/version", "tandem_weights_version"),
    ):
        assert values[name] == last[key], key


def test_ctl_watch_shows_every_step_and_exits_when_the_run_ends(observed):
    assert observed.watch_rc == 0, observed.watch_out
    lines = observed.watch_out.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [int(line.split()[1].rstrip(":")) for line in steps] == observed.steps, observed.watch_out
    assert all("reward " in line and "step s " in line for line in steps)
    assert any(line.startswith(f"eval {observed.steps[-1]}:") for line in lines)
    table = observed.watch_out[observed.watch_out.index("tandem run — ") :]
    assert table.startswith("tandem run — finished"), table
    rows = [line for line in table.splitlines() if line.startswith("│")]
    assert [int(r.split("│")[1]) for r in rows] == observed.steps[-20:], table


def test_plot_renders_the_four_panels_of_the_run(observed, tmp_path):
    from PIL import Image

    out = tmp_path / "plot.png"
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "plot", str(observed.run_dir), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 0 and f"wrote {out}" in done.stdout, done.stderr
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (1200, 800)
        panels = {p["title"]: p for p in json.loads(image.info["Tandem-Panels"])}
    kl = "KL to the reference or the teacher"
    assert list(panels) == ["reward", "response length (tokens)", kl, "step time breakdown (s)"]
    n = len(observed.steps)
    assert panels["reward"] == {
        "title": "reward",
        "keys": ["rollout/reward_mean", "eval/reward_mean"],
        "points": n + observed.num_evals,
    }
    assert panels["response length (tokens)"]["points"] == n + observed.num_evals
    assert panels[kl] == {"title": kl, "keys": ["train/kl"], "points": n}
    breakdown = panels["step time breakdown (s)"]
    assert {"perf/rollout_wait_s", "perf/train_time_s", "perf/weight_sync_time_s", "perf/step_time_s"} <= set(
        breakdown["keys"]
    ) and breakdown["points"] == n


def test_every_train_span_and_step_row_carries_the_mismatch_metrics(observed):
    """No rollout correction is configured: the training-inference mismatch is still measured every step, in the
    metrics and on the coordinator's rl.train span."""
    rows = {r["rollout_id"]: r for r in metrics(observed.run_dir) if "rollout/reward_mean" in r}
    for rollout_id in observed.steps:
        [train] = observed.find("rl.train", "tandem-coordinator", rollout_id)
        row = rows[rollout_id]
        for key in ("kl", "kl_k3", "ppl_ratio", "chi2", "ratio_p50", "token_masked_frac"):
            assert train["attributes"][f"rl.mismatch.{key}"] == row[f"mismatch/{key}"], (rollout_id, key)
        assert row["mismatch/token_masked_frac"] == 0.0 and "train/tis_masked_frac" not in row
