"""The files of a run that one process writes and another reads are never seen half-written: a writer process
rewrites them in a loop the way `tandem run` and the coordinator do, while this process reads them in a tight loop
through the real readers (`tandem ctl`'s discovery, the failure record, `tandem plot`'s metrics)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from services.contracts.failure import read_failure
from services.coordinator.ctl import _running_run, find_coordinator
from services.coordinator.plot import read_metrics

REPO = Path(__file__).resolve().parents[1]
PORT = 41234
METRIC_KEYS = 1000  # a row of ~30 KB: its append spans many pages, so a reader can catch it half-way
REWRITES = 100

WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from services.contracts.config_loading import load_config, write_resolved_config
    from services.contracts.failure import FailureRecord, write_failure
    from services.launcher.supervisor import write_run_marker
    from services.telemetry.trackers import JsonlTracker

    run_dir, port, keys, rewrites = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    config = load_config("examples/digit_max.yaml", ["run_name=atomic", f"services.coordinator.port={port}"])
    record = FailureRecord(service="trainer", kind="RESOURCE_EXHAUSTED", what="disk full " + "x" * 20000,
                           kept="", exit_code=1, call="Save")
    tracker = JsonlTracker(run_dir / "metrics.jsonl")
    row = {f"metric/{i}": float(i) for i in range(keys)}
    for i in range(rewrites):
        write_resolved_config(config, run_dir)
        write_run_marker(run_dir, coordinator=f"127.0.0.1:{port}")
        write_failure(run_dir, record)
        tracker.log(i % 4, row)
        if i % 4 == 3:
            tracker.rewind(next_step=2)   # a resume: rows of steps 2.. go, and are logged again
        if i == 0:
            print("ready", flush=True)   # every file now names this process
""")


def _first_files(run_dir: Path) -> None:
    """One complete version of each file before the race starts (a reader may not find them absent)."""
    writer = subprocess.run(
        [sys.executable, "-c", WRITER, str(run_dir), str(PORT), str(METRIC_KEYS), "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert writer.returncode == 0, writer.stderr


def test_run_files_are_whole_to_a_reader_while_they_are_rewritten(tmp_path):
    run_dir = tmp_path / "runs" / "atomic"
    run_dir.mkdir(parents=True)
    _first_files(run_dir)
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(run_dir), str(PORT), str(METRIC_KEYS), str(REWRITES)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None and writer.stdout.readline() == "ready\n", writer.stderr
    torn: list[str] = []
    reads = 0
    while writer.poll() is None and len(torn) < 5:
        reads += 1
        try:
            addr = find_coordinator(addr=None, run_dir=run_dir, token=None, tls_ca=None).addr
            if addr != f"127.0.0.1:{PORT}":
                torn.append(f"config.yaml named {addr}")
        except Exception as exc:  # noqa: BLE001 - whatever a half-written file makes the reader raise
            torn.append(f"config.yaml: {type(exc).__name__}: {str(exc)[:200]}")
        if _running_run(tmp_path / "runs") != run_dir and writer.poll() is None:
            torn.append("run.json did not name the live run")
        if read_failure(run_dir) is None:
            torn.append("failure.json held no record")
        try:
            rows = read_metrics(run_dir)
            short = [len(r) for r in rows if len(r) != METRIC_KEYS + 2]
            if short:
                torn.append(f"metrics.jsonl: rows of {short} keys")
        except Exception as exc:  # noqa: BLE001
            torn.append(f"metrics.jsonl: {type(exc).__name__}: {str(exc)[:200]}")
    writer.kill()
    _, err = writer.communicate(timeout=60)
    assert not torn, f"after {reads} reads: {torn}"
    assert writer.returncode in (0, -9), err
    assert reads > 20, f"only {reads} reads overlapped the rewrites"
