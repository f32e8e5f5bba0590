"""Helpers of the fault-injection tests (tests/test_reliability_*.py): find a run's processes, read what its
checkpoints and its Redis data directory hold afterwards, and check that every sample was trained once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import cast

import grpc
import yaml
from tandem_runs import EXAMPLE, REPO, checkpoints, children_of

from services.buffer.stream import connect, stream_key
from services.contracts.config_loading import load_config, write_resolved_config
from services.contracts.gen.tandem.v1 import common_pb2, coordinator_pb2_grpc
from services.coordinator.clients import make_clients
from services.coordinator.pool import RolloutPool
from services.launcher.redis_server import EmbeddedRedis
from services.launcher.supervisor import resolve_for_local_run

BATCH_SAMPLES = 32 * 8  # rollout_batch_size × n_samples_per_prompt of examples/digit_max.yaml


def resolved_config(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / "config.yaml").read_text())


def service_pids(supervisor_pid: int, marker: str) -> list[int]:
    """The pids of the children of `tandem run` that run service `marker` (e.g. "trainer")."""
    return [pid for pid in children_of(supervisor_pid) if _argv(pid)[1:4] == [b"-m", b"services.cli", marker.encode()]]


def service_pid(supervisor_pid: int, marker: str) -> int:
    """The pid of the one child of `tandem run` that runs service `marker`."""
    found = service_pids(supervisor_pid, marker)
    assert len(found) == 1, (marker, found)
    return found[0]


def replacement_pid(supervisor_pid: int, marker: str, *, old: int) -> int | None:
    """The pid of a restarted service once the supervisor has spawned it (None until then)."""
    found = [pid for pid in service_pids(supervisor_pid, marker) if pid != old]
    return found[0] if found else None


def redis_pid(supervisor_pid: int) -> int:
    found = [pid for pid in children_of(supervisor_pid) if b"redis-server" in b"".join(_argv(pid)[:1])]
    assert len(found) == 1, found
    return found[0]


def rollout_pid(supervisor_pid: int, replica: int) -> int:
    found = [
        pid
        for pid in children_of(supervisor_pid)
        if _argv(pid)[3:4] == [b"rollout"] and _argv(pid)[-1:] == [str(replica).encode()]
    ]
    assert len(found) == 1, found
    return found[0]


def _argv(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    except OSError:
        return []


def wait_for(predicate, *, what: str, timeout_s: float = 120.0, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise TimeoutError(f"timed out waiting for {what}")


def freeze_mid_train(trainer_pid: int, cfg: dict, *, timeout_s: float = 120.0) -> list[str]:
    """SIGSTOPs the trainer at a moment it holds delivered-but-unacknowledged entries (it is inside a Train:
    entries are acknowledged only after the optimizer step). A stopped process cannot ack, so once the
    entries are still pending after the stop, a kill -9 is certain to land mid-step. Returns their ids."""
    client = connect(cfg["redis"]["url"], password=cfg["redis"]["password"])
    stream = stream_key(cfg["redis"]["stream_prefix"], cfg["run_name"])
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if int(client.xpending(stream, "actor")["pending"]) > 0:
                os.kill(trainer_pid, signal.SIGSTOP)
                rows = client.xpending_range(stream, "actor", min="-", max="+", count=100)
                if rows:
                    return [cast(bytes, r["message_id"]).decode() for r in rows]  # a binary client's
                os.kill(trainer_pid, signal.SIGCONT)  # the step finished in between: catch the next one
            time.sleep(0.005)
    finally:
        client.close()
    raise TimeoutError("the trainer was never caught holding unacknowledged entries")


def wait_running(run_dir: Path, *, rollout_id: int, timeout_s: float = 180.0):
    """The coordinator's status once it is running at `rollout_id` or later. The channel retries connecting
    every 0.2 s: these runs last seconds, longer than gRPC's default reconnect backoff grows to."""
    cfg = resolved_config_when_written(run_dir, timeout_s)
    s = cfg["services"]
    target = f"{s['coordinator']['host']}:{s['coordinator']['port']}"
    options = [
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 200),
    ]
    with grpc.insecure_channel(target, options=options) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)

        def status():
            try:
                got = stub.GetStatus(common_pb2.Empty(), timeout=2)
            except grpc.RpcError:
                return None
            return got if got.state == "running" and got.rollout_id >= rollout_id else None

        return wait_for(status, what=f"the run at rollout {rollout_id}", timeout_s=timeout_s, every_s=0.02)


def resolved_config_when_written(run_dir: Path, timeout_s: float = 120.0) -> dict:
    path = run_dir / "config.yaml"
    wait_for(
        lambda: path.exists() and resolved_config(run_dir)["services"]["coordinator"]["port"],
        what=f"{path}",
        timeout_s=timeout_s,
    )
    return resolved_config(run_dir)


def final_checkpoint_state(run_dir: Path) -> tuple[dict, dict]:
    """(trainer state, coordinator RunState) of the newest checkpoint."""
    trainer = json.loads((checkpoints(run_dir)[-1] / "tandem_state.json").read_text())
    return trainer, json.loads(trainer["extra_state"]["coordinator"])


def buffer_leftovers(run_dir: Path) -> tuple[int, int]:
    """(entries in the stream, entries pending in the actor group) in the run's Redis data, read back by a
    fresh redis-server from the run's AOF after the run ended."""
    cfg = resolved_config(run_dir)
    return aof_leftovers(
        run_dir / "redis",
        stream=stream_key(cfg["redis"]["stream_prefix"], cfg["run_name"]),
        password=cfg["redis"]["password"],
        log_path=run_dir / "redis-inspect.log",
    )


def aof_leftovers(data_dir: Path, *, stream: str, password: str | None, log_path: Path) -> tuple[int, int]:
    """(entries in `stream`, entries pending in its actor group) of the AOF in `data_dir`."""
    with EmbeddedRedis(data_dir, appendonly=True, password=password, log_path=str(log_path)) as server:
        client = connect(f"redis://{server.host}:{server.port}/0", password=password)
        try:
            if not client.exists(stream):
                return 0, 0
            return int(client.xlen(stream)), int(client.xpending(stream, "actor")["pending"])
        finally:
            client.close()


def assert_every_sample_trained_once(run_dir: Path, num_rollout: int) -> dict:
    """The run's books balance (`assert_books_balance`), read from its checkpoints and its Redis data."""
    trainer, state = final_checkpoint_state(run_dir)
    assert_books_balance(trainer, state, num_rollout=num_rollout, leftovers=buffer_leftovers(run_dir))
    return state


def assert_books_balance(
    trainer: dict, state: dict, *, num_rollout: int, leftovers: tuple[int, int], batch_samples: int = BATCH_SAMPLES
) -> None:
    """Every rollout id was trained by exactly one optimizer step of the surviving lineage, trained +
    dropped-as-stale = generated, the trainer's own counter agrees, nothing is left in the buffer. `trainer`
    and `state`: the newest checkpoint's tandem_state.json and the coordinator RunState in it; `leftovers`:
    (entries in the stream, entries pending in the actor group)."""
    assert state["next_rollout_id"] == num_rollout
    assert state["samples_generated"] == num_rollout * batch_samples
    assert state["samples_trained"] + state["samples_dropped_stale"] == state["samples_generated"]
    assert trainer["step"] == num_rollout, trainer["step"]  # one optimizer step per rollout id
    assert trainer["samples_trained"] == state["samples_trained"]
    assert sorted(set(r for _e, r in trainer["trained_entries"])) == list(range(num_rollout))
    assert leftovers == (0, 0), leftovers


class Services:
    """A trainer and a rollout process started like `tandem run` starts them; either can be killed and
    started again on the same port."""

    def __init__(self, run_dir: Path, redis_url: str, overrides: list[str]):
        config = load_config(EXAMPLE, overrides)
        self.config = resolve_for_local_run(config, redis_url=redis_url).model_copy(
            update={"run_name": f"sync-{run_dir.name}"}
        )
        self.run_dir = run_dir
        write_resolved_config(self.config, run_dir)
        self.procs = {"trainer": self._start("trainer", "--role", "actor"), "rollout": self._start("rollout")}
        self.trainer, _, rollouts = make_clients(self.config)
        self.pool = RolloutPool(rollouts)
        self.rollout = rollouts[0]
        self.wait_healthy()

    def _start(self, service: str, *args: str) -> subprocess.Popen:
        with open(self.run_dir / f"{service}.log", "ab") as log:  # the child keeps its own copy of the fd
            return subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "services.cli",
                    service,
                    str(self.run_dir / "config.yaml"),
                    "--run-dir",
                    str(self.run_dir),
                    *args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )

    def wait_healthy(self) -> None:
        for client in (self.trainer, self.rollout):
            client.wait_healthy(180)

    def kill(self, name: str) -> None:
        os.kill(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait()

    def restart(self, name: str) -> None:
        self.procs[name] = self._start("trainer", "--role", "actor") if name == "trainer" else self._start("rollout")
        self.wait_healthy()

    def close(self) -> None:
        self.pool.close()
        self.trainer.close()
        for proc in self.procs.values():
            proc.terminate()
            proc.wait(timeout=30)
