"""Bad task data and reward functions with bugs, in real processes: a task file that is not UTF-8 is refused at
the coordinator's start naming file, line and column; a reward that raises fails the run once, clearly, instead
of being retried on the replicas and restarted by the supervisor as if it were transient."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tandem_runs import EXAMPLE, REPO, start_run, stop_run, supervisor_log

from services.buffer.redis_server import free_port
from services.contracts.exits import ExitCode
from services.rpc.grpc_util import ServerOptions, start_server

pytestmark = [pytest.mark.reliability]


def _coordinator(tmp_path, *overrides: str) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
    """`tandem coordinator` alone; the trainer and rollout it names are never reached."""
    ports = (f"services.trainer.port={free_port()}", f"services.rollout=[{{port: {free_port()}}}]")
    args = [sys.executable, "-m", "services.cli", "coordinator", str(EXAMPLE), "--run-dir", str(tmp_path / "run")]
    for item in (*ports, *overrides):
        args += ["--set", item]
    return subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=120)


def test_a_task_file_that_is_not_utf8_is_refused_naming_file_line_and_column(tmp_path):
    data = tmp_path / "tasks.jsonl"
    data.write_bytes(b'{"prompt": "1 2 =", "label": "2"}\n{"prompt": "3 \xc3\xa9 =", "label": "3"}\n'
                     b'{"prompt": "4 \xff =", "label": "4"}\n')
    out = _coordinator(tmp_path, f"services.coordinator.port={free_port()}", f"data.train_path={data}")
    assert out.returncode == ExitCode.PERMANENT, out.stderr   # tandem run does not restart it: the data stays bad
    assert f"{data}:3: not valid UTF-8 (byte 0xff at column 15); task files must be UTF-8 JSON lines" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_service_on_a_taken_port_says_so_in_one_line(tmp_path):
    other = start_server([], ServerOptions(port=0))   # someone else's server
    try:
        out = _coordinator(tmp_path, f"services.coordinator.port={other.port}")
    finally:
        other.stop(grace_s=0)
    assert out.returncode == 2
    assert f"tandem coordinator: port {other.port} on 127.0.0.1 is in use (another tandem run?)" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_reward_that_raises_fails_the_run_once_without_retries_or_restarts(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_run(run_dir, "loop.num_rollout=20", "loop.eval_interval=null", "services.max_restarts=2",
                     "rollout.reward=tests/helpers/bad_rewards.py:raises_on_seven")
    try:
        code = proc.wait(timeout=240)
    finally:
        stop_run(proc)
    log = supervisor_log(run_dir)
    assert code == ExitCode.PERMANENT, log
    assert "bad_rewards.py:raises_on_seven raised ZeroDivisionError on sample" in log
    assert "coordinator failed on an error a restart would only repeat (exit 3): not restarting it" in log
    assert "restarting it (restart" not in log
    coordinator_log = (run_dir / "logs" / "coordinator.log").read_text()
    assert "retrying on another replica" not in coordinator_log       # the share was not generated again
    assert "INVALID_ARGUMENT: RewardError" in coordinator_log
