"""Bad task data and reward functions with bugs, in real processes: a task file that is not UTF-8 is refused at
the coordinator's start naming file, line and column; empty or too long prompts are refused by preflight; a reward
that raises, or never returns, fails the run once, clearly, instead of being retried on the replicas and restarted
by the supervisor as if it were transient. Each ends in the block of services/contracts/failure.py, with no
traceback on the terminal and the full one in the service's log."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tandem_runs import EXAMPLE, REPO, TRACEBACK, last_lines, start_run, stop_run, supervisor_log

from services.contracts.exits import ExitCode
from services.rpc.grpc_util import ServerOptions, start_server
from services.rpc.ports import free_port

pytestmark = [pytest.mark.reliability]


def _coordinator(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    """`tandem coordinator` alone; the trainer and rollout it names are never reached."""
    ports = (f"services.trainer.port={free_port()}", f"services.rollout=[{{port: {free_port()}}}]")
    args = [sys.executable, "-m", "services.cli", "coordinator", str(EXAMPLE), "--run-dir", str(tmp_path / "run")]
    for item in (*ports, *overrides):
        args += ["--set", item]
    return subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=120)


def test_a_task_file_that_is_not_utf8_is_refused_naming_file_line_and_column(tmp_path):
    data = tmp_path / "tasks.jsonl"
    data.write_bytes(
        b'{"prompt": "1 2 =", "label": "2"}\n{"prompt": "3 \xc3\xa9 =", "label": "3"}\n'
        b'{"prompt": "4 \xff =", "label": "4"}\n'
    )
    out = _coordinator(tmp_path, f"services.coordinator.port={free_port()}", f"data.train_path={data}")
    assert out.returncode == ExitCode.PERMANENT, out.stderr  # tandem run does not restart it: the data stays bad
    logs = tmp_path / "run" / "logs"
    assert last_lines(out.stderr, 6) == [  # `tandem coordinator` alone ends in the same block as `tandem run`
        "tandem coordinator failed: coordinator failed (BAD_INPUT)",
        f"  what went wrong: {data}:3: not valid UTF-8 (byte 0xff at column 15); task files must be UTF-8 JSON lines",
        "  kept:            no checkpoint (none was written yet)",
        "  what to do:      fix the input it names; then run the same command again: with no checkpoint it starts "
        "from the beginning",
        f"  full traceback:  {logs / 'coordinator.log'}",
        "  exit code 3: a restart would only repeat it, so nothing was restarted",
    ]
    assert TRACEBACK not in out.stderr
    assert TRACEBACK in (logs / "coordinator.log").read_text()


def test_bad_prompts_are_refused_before_the_run_naming_file_line_and_the_limits(tmp_path):
    """An empty prompt and prompts longer than the context (the tiny model's 128 positions) minus max_new_tokens,
    in a 20k-line file: one line from preflight, exit 2, nothing started (bench/preflight_prompts.py times 100k)."""
    data = tmp_path / "tasks.jsonl"
    lines = [json.dumps({"prompt": f"{i % 10} {i // 10 % 10} =", "label": str(i % 10)}) for i in range(20_000)]
    lines[11_999] = json.dumps({"prompt": " ".join(["9"] * 130), "label": "9"})
    lines[15_000] = json.dumps({"prompt": "", "label": "1"})
    lines[17_776] = json.dumps({"prompt": " ".join(["8"] * 200), "label": "8"})
    data.write_text("\n".join(lines) + "\n")
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "run",
            str(EXAMPLE),
            "--run-dir",
            str(run_dir),
            "--no-progress",
            "--set",
            f"data.train_path={data}",
            "--set",
            "loop.num_rollout=1",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == ExitCode.BAD_INPUT, out.stderr
    assert out.stderr == (
        f"tandem: data.train_path: {data}:12000: the prompt has 131 tokens, more than the 127 a prompt may have (a "
        "context of 128 tokens, from the model's max_position_embeddings, minus rollout.sampling.max_new_tokens 1); "
        "2 more lines empty or too long (line 15001, 17777)\n"
    )
    assert not (run_dir / "logs").exists()  # no service was started


def test_a_service_on_a_taken_port_says_so_in_one_line(tmp_path):
    other = start_server([], ServerOptions(port=0))  # someone else's server
    try:
        out = _coordinator(tmp_path, f"services.coordinator.port={other.port}")
    finally:
        other.stop(grace_s=0)
    assert out.returncode == 2
    assert f"tandem coordinator: port {other.port} on 127.0.0.1 is in use (another tandem run?)" in out.stderr
    assert "Traceback" not in out.stderr


def _failed_run(run_dir: Path, reward: str, *overrides: str) -> tuple[int, str]:
    """A `tandem run` (restarts allowed) whose reward fails in its first Generate: exit code, what it printed."""
    proc = start_run(
        run_dir,
        "loop.num_rollout=2",
        "loop.eval_interval=null",
        "services.max_restarts=2",
        f"rollout.reward=tests/helpers/bad_rewards.py:{reward}",
        *overrides,
    )
    try:
        code = proc.wait(timeout=240)
    finally:
        stop_run(proc)
    return code, supervisor_log(run_dir)


def _reward_ending(run_dir: Path, what: str, hint: str) -> list[str]:
    return [
        "tandem run failed: rollout-0 answered Generate(0) with INVALID_ARGUMENT",
        f"  what went wrong: {what}",
        "  kept:            no checkpoint (none was written yet)",
        f"  what to do:      {hint}; then run the same command again: with no checkpoint it starts from the beginning",
        f"  full traceback:  {run_dir / 'logs' / 'rollout-0.log'}",
        "  exit code 3: a restart would only repeat it, so nothing was restarted",
    ]


def _assert_failed_once(run_dir: Path, printed: str) -> None:
    """Not retried on a replica, not restarted; no traceback on the terminal, the full one in the replica's log."""
    assert "restarting it (restart" not in printed
    assert TRACEBACK not in printed
    assert "DEADLINE_EXCEEDED" not in printed
    coordinator_log = (run_dir / "logs" / "coordinator.log").read_text()
    assert "retrying on another replica" not in coordinator_log  # the share was not generated again
    rollout_log = (run_dir / "logs" / "rollout-0.log").read_text()
    assert rollout_log.count("Generate: INVALID_ARGUMENT") == 1  # asked once: no retry on the same replica
    assert TRACEBACK in rollout_log


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_reward_that_raises_fails_the_run_once_without_retries_or_restarts(tmp_path):
    run_dir = tmp_path / "run"
    code, printed = _failed_run(run_dir, "raises_on_seven")
    assert code == ExitCode.PERMANENT, printed
    spec = f"{REPO / 'tests/helpers/bad_rewards.py'}:raises_on_seven"
    assert last_lines(printed, 6) == _reward_ending(
        run_dir,
        f"reward function {spec} raised ZeroDivisionError on sample 32: float division by zero",
        "fix the reward function",
    ), printed
    _assert_failed_once(run_dir, printed)
    assert "ZeroDivisionError" in (run_dir / "logs" / "rollout-0.log").read_text()  # the reward's own traceback


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_reward_that_never_returns_is_named_once_after_rollout_reward_timeout_s(tmp_path):
    run_dir = tmp_path / "run"
    code, printed = _failed_run(run_dir, "hangs_on_seven", "rollout.reward_timeout_s=1")
    assert code == ExitCode.PERMANENT, printed
    spec = f"{REPO / 'tests/helpers/bad_rewards.py'}:hangs_on_seven"
    assert last_lines(printed, 6) == _reward_ending(
        run_dir,
        f"reward function {spec} did not return within 1 s (rollout.reward_timeout_s) for sample 32",
        f"make {spec} return sooner (give what it waits for a timeout of its own), or raise rollout.reward_timeout_s",
    ), printed
    _assert_failed_once(run_dir, printed)
