"""Helpers for tests that drive a real `tandem run` (every service a separate process, a real redis-server)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import yaml

from services.contracts.files import read_json_rows
from services.contracts.gen.tandem.v1 import common_pb2, coordinator_pb2_grpc
from services.rpc.grpc_util import open_channel

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "digit_max.yaml"
# The learning e2es run under the examples' own sampling seeds unless TANDEM_E2E_SEED names another: what they
# assert must hold under any seed (bench/e2e_seeds.py runs each under several and prints the margins).
SEED_ENV = "TANDEM_E2E_SEED"
# Where assert_above / assert_below append each asserted value and its threshold (JSON lines), when set.
MARGINS_ENV = "TANDEM_E2E_MARGINS"


def seed_overrides() -> list[str]:
    """rollout.sampling.seed = TANDEM_E2E_SEED and the eval's the next one (the examples' 1 and 2); none if unset."""
    raw = os.environ.get(SEED_ENV, "").strip()
    if not raw:
        return []
    if not raw.isdigit() or int(raw) == 0:
        raise ValueError(f"{SEED_ENV}={raw!r}: a positive integer (0 would draw a new stream every call)")
    seed = int(raw)
    return [f"rollout.sampling.seed={seed}", f"rollout.eval_sampling.seed={seed + 1}"]


def assert_above(what: str, value: float, floor: float, context: object = "") -> None:
    """assert value > floor, recording the margin (TANDEM_E2E_MARGINS) for the seed sweep's table."""
    _record_margin(what, value, ">", floor)
    assert value > floor, f"{what}: {value:.4g} is not > {floor:g}; {context}"


def assert_below(what: str, value: float, ceiling: float, context: object = "") -> None:
    """assert value < ceiling, recording the margin (TANDEM_E2E_MARGINS) for the seed sweep's table."""
    _record_margin(what, value, "<", ceiling)
    assert value < ceiling, f"{what}: {value:.4g} is not < {ceiling:g}; {context}"


def _record_margin(what: str, value: float, op: str, threshold: float) -> None:
    path = os.environ.get(MARGINS_ENV)
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
    row = {"test": test, "seed": os.environ.get(SEED_ENV, ""), "what": what, "value": value, "op": op}
    with open(path, "a") as out:
        out.write(json.dumps({**row, "threshold": threshold}) + "\n")


def window_mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def start_run(run_dir: Path, *overrides: str, config: Path = EXAMPLE) -> subprocess.Popen:
    args = [sys.executable, "-m", "services.cli", "run", str(config), "--run-dir", str(run_dir), "--no-progress"]
    for item in (*seed_overrides(), *overrides):  # a test's own setting wins over the sweep's seed
        args += ["--set", item]
    with open(run_dir.parent / f"{run_dir.name}-supervisor.log", "ab") as log:  # the child keeps its own fd
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)


def supervisor_log(run_dir: Path) -> str:
    path = run_dir.parent / f"{run_dir.name}-supervisor.log"
    return path.read_text(errors="replace") if path.exists() else ""


def coordinator_target(run_dir: Path, *, timeout_s: float = 120.0) -> str:
    """The resolved config.yaml (written once ports are chosen) names the coordinator's address."""
    deadline = time.monotonic() + timeout_s
    path = run_dir / "config.yaml"
    while time.monotonic() < deadline:
        if path.exists():
            cfg = yaml.safe_load(path.read_text())
            port = cfg["services"]["coordinator"]["port"]
            if port:
                return f"{cfg['services']['coordinator']['host']}:{port}"
        time.sleep(0.2)
    raise TimeoutError(f"{path} did not appear; supervisor log:\n{supervisor_log(run_dir)}")


def wait_status(target: str, predicate, *, timeout_s: float = 120.0, what: str = "status"):
    deadline = time.monotonic() + timeout_s
    last = None
    with open_channel(target) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        while time.monotonic() < deadline:
            try:
                last = stub.GetStatus(common_pb2.Empty(), timeout=5)
                if predicate(last):
                    return last
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"coordinator never reached {what}; last status: {last}")


def ctl(target: str, action: str, *, timeout_s: float = 60.0) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "ctl", "--addr", target, "--timeout", str(timeout_s), action],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout_s + 30,
    )
    assert out.returncode == 0, f"tandem ctl {action} failed: {out.stderr}"
    return json.loads(out.stdout)


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return read_json_rows(path) if path.exists() else []  # the run may be appending a row as we read


def checkpoints(run_dir: Path, role: str = "actor") -> list[Path]:
    root = run_dir / "checkpoints" / role
    return sorted(p for p in root.glob("rollout_*") if p.is_dir()) if root.exists() else []


def children_of(pid: int) -> list[int]:
    """All live descendants of pid (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        frontier += kids
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


def stop_run(proc: subprocess.Popen, *, timeout_s: float = 60.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


TRACEBACK = "Traceback (most recent call last)"


def last_lines(text: str, n: int) -> list[str]:
    """The last n lines a command printed (what a user reads first)."""
    return text.rstrip("\n").splitlines()[-n:]


def learning_curve(run_dir) -> tuple[list[dict], list[dict]]:
    """A run's metrics rows: (the evals, the training steps)."""
    rows = metrics(run_dir)
    return [r for r in rows if "eval/reward_mean" in r], [r for r in rows if "rollout/reward_mean" in r]
