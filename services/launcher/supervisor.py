"""`tandem run`: every service as a child process on this machine, plus an embedded redis-server.

Start order: redis → trainer(s) → the reward service (when the config has a reward: section) → rollout replicas →
coordinator, each awaited through grpc.health.
Logs go to RUN_DIR/logs/<service>.log. If any child dies, everything is stopped and the run fails with
the child's name and the tail of its log; Ctrl-C asks the coordinator for a graceful Stop (a second Ctrl-C
terminates). Children, the embedded redis-server included, get PR_SET_PDEATHSIG (services/launcher/procs.py), so
none outlives the supervisor, even a supervisor killed with kill -9.

With services.max_restarts > 0 a dead child is restarted instead (that many restarts per run, in total):
a rollout replica alone (the coordinator retries its work elsewhere and re-syncs it); the reward service alone
(the rollouts ask it again within reward.max_wait_s); the embedded
redis-server on its port and data directory (AOF); a coordinator that failed, which resumes from the last
checkpoint; a trainer together with the coordinator, which is killed first so it can neither drive the new
trainer nor save a checkpoint mixing the two, and then resumes from the last checkpoint. A child that dies or
hangs while it is being started again costs one more restart and is started again. A coordinator that exits
with ExitCode.PERMANENT (3) failed on an error a restart would repeat: it is not restarted (docs/reliability.md).

A failed run ends in one block, its last lines (services/contracts/failure.py): the record the coordinator wrote
(RUN_DIR/failure.json), or one for a child that died without writing one; tracebacks stay in the logs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from services.contracts.config import TandemConfig
from services.contracts.config_loading import config_from_dict, write_resolved_config
from services.contracts.exits import ExitCode
from services.contracts.failure import FailureRecord, clear_failure, read_failure
from services.contracts.files import write_json_atomic
from services.contracts.gen.tandem.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from services.contracts.runfacts import RUN_MARKER
from services.launcher.procs import dies_with_parent
from services.launcher.redis_server import EmbeddedRedis
from services.rpc.grpc_util import ensure_port_free, open_channel, wait_healthy
from services.rpc.ports import free_port

if TYPE_CHECKING:
    from services.launcher.progress import ProgressView

log = logging.getLogger("tandem.run")

WATCH_POLL_S = 0.2  # how often watch() looks at its children


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    log_path: Path
    args: list[str] | None = None

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float) -> None:
        """SIGTERM, and SIGKILL to its group after `timeout_s` (services.timeouts.shutdown_s)."""
        if not self.alive():
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


class _StartFailed(Exception):
    """A restarted child died, or never became healthy, while it started."""

    def __init__(self, child: Child, reason: str):
        super().__init__(f"{child.name} {reason}")
        self.child, self.reason = child, reason


def resolve_for_local_run(config: TandemConfig, *, redis_url: str) -> TandemConfig:
    """Fills in what a local run decides at start: the redis URL and free ports for port-0 services."""
    data = config.model_dump(mode="json")
    data["redis"]["url"] = redis_url
    # engines accept weights only from this run's actor (plans and CUDA IPC handles name it)
    data["weights"]["trainer_id"] = data["weights"]["trainer_id"] or f"{data['run_name']}/actor"
    s = data["services"]
    for name in ("coordinator", "trainer", "critic", "reward"):
        if s[name]["port"] == 0:
            s[name]["port"] = free_port(s["bind_host"] if s["bind_host"] != "0.0.0.0" else "127.0.0.1")
    for replica in s["rollout"]:
        if replica["port"] == 0:
            replica["port"] = free_port()
    return config_from_dict(data, source="resolved config")


def _let_go(child: Child) -> None:
    """Opens a gated child's start gate (`tandem coordinator --start-gate`); one that already died is left to the
    health wait that follows."""
    stdin = child.process.stdin
    assert stdin is not None, f"{child.name} was not started gated"
    with contextlib.suppress(BrokenPipeError, OSError):
        stdin.write(b"go\n")
        stdin.flush()
    with contextlib.suppress(BrokenPipeError, OSError):
        stdin.close()


class LocalRun:
    def __init__(self, config: TandemConfig, *, run_dir: Path, progress: bool):
        self.config = config
        self.run_dir = run_dir
        self.progress = progress
        self.children: list[Child] = []
        self.redis: EmbeddedRedis | None = None
        self.config_file = run_dir / "config.yaml"
        self.interrupts = 0
        self.restarts_left = config.services.max_restarts
        self.view: ProgressView | None = None
        self.failure: FailureRecord | None = None  # what ended the run, shown as its last lines

    def _spawn(self, name: str, args: list[str], *, gated: bool = False) -> Child:
        """`gated`: the child waits for `_let_go` after loading its code (a respawn is never gated)."""
        if name == "coordinator":
            clear_failure(self.run_dir)  # what it writes when it fails is about this start, not an earlier one
        log_path = self.run_dir / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TANDEM_SERVICE": name}
        argv = [*args, "--start-gate"] if gated else args
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                dies_with_parent(argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.PIPE if gated else subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        child = Child(name=name, process=proc, log_path=log_path, args=args)
        self.children.append(child)
        return child

    def _respawn(self, child: Child) -> Child:
        """The same command again (same ports: they are in the resolved config)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.process.pid, signal.SIGKILL)  # leftovers of its group (torchrun ranks)
        child.process.wait()
        self.children.remove(child)
        assert child.args is not None
        return self._spawn(child.name, child.args)

    def _target_of(self, child: Child) -> str:
        s = self.config.services
        if child.name.startswith("rollout-"):
            return s.rollout[int(child.name.split("-")[1])].target
        return {"trainer": s.trainer, "critic": s.critic, "coordinator": s.coordinator, "reward": s.reward}[
            child.name
        ].target

    def _service_args(self, service: str, *extra: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "services.cli",
            service,
            str(self.config_file),
            "--run-dir",
            str(self.run_dir),
            *extra,
        ]

    def _trainer_args(self, role: str) -> list[str]:
        ranks = self.config.trainer.num_ranks
        if ranks == 1:
            return self._service_args("trainer", "--role", role)
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(ranks),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
        ]
        return [
            *launcher,
            "-m",
            "services.cli",
            "trainer",
            str(self.config_file),
            "--run-dir",
            str(self.run_dir),
            "--role",
            role,
        ]

    def _await(self, child: Child, target: str, *, may_exit: bool = False) -> None:
        """Waits until the child is healthy. It exiting first raises, unless may_exit, or it is a coordinator
        that finished (0) or failed for good (ExitCode.PERMANENT): watch() reports those."""

        def exited() -> str | None:
            if child.alive():
                return None
            return f"{child.name} exited with {child.process.returncode}:\n{child.log_tail()}"

        try:
            wait_healthy(
                target,
                timeout_s=self.config.loop.startup_timeout_s,
                tls_ca=self.config.services.tls_ca,
                should_abort=exited,
                check_timeout_s=self.config.services.timeouts.health_check_s,
            )
        except RuntimeError:
            code = child.process.returncode
            if not (may_exit or code == 0 or (child.name == "coordinator" and code == ExitCode.PERMANENT)):
                raise

    def _check_fixed_ports(self) -> None:
        """A fixed port some other process holds (another run on the same ports) fails the run before anything
        starts: a health check there would be answered by the other process."""
        s = self.config.services
        addresses = [
            s.trainer,
            *([s.critic] if self.config.algorithm.uses_critic else []),
            *([s.reward] if self.config.reward is not None else []),
            *s.rollout,
            s.coordinator,
        ]
        for address in addresses:
            if address.port:
                ensure_port_free(s.bind_host, address.port)

    def start(self) -> None:
        self._check_fixed_ports()
        if self.config.redis.url:
            redis_url = self.config.redis.url
        else:
            self.redis = EmbeddedRedis(
                self.run_dir / "redis",
                appendonly=self.config.redis.appendonly,
                appendfsync=self.config.redis.appendfsync,
                password=self.config.redis.password,
            ).start(self.config.loop.startup_timeout_s)
            redis_url = f"redis://{self.redis.host}:{self.redis.port}/0"  # the password travels as redis.password
        self.config = resolve_for_local_run(self.config, redis_url=redis_url)
        write_resolved_config(self.config, self.run_dir)  # owner-only: it may hold the token and passwords
        s = self.config.services
        write_run_marker(self.run_dir, coordinator=s.coordinator.target)
        log.info(
            "coordinator control API: %s (from another shell: tandem ctl --run-dir %s status)",
            s.coordinator.target,
            self.run_dir,
        )
        waits = [(self._spawn("trainer", self._trainer_args("actor")), s.trainer.target)]
        if self.config.reward is not None:  # before the rollouts, whose batches wait for its scores
            waits.append((self._spawn("reward", self._service_args("reward")), s.reward.target))
        if self.config.algorithm.uses_critic:
            waits.append((self._spawn("critic", self._trainer_args("critic")), s.critic.target))
        for i, addr in enumerate(s.rollout):
            waits.append((self._spawn(f"rollout-{i}", self._service_args("rollout", "--replica", str(i))), addr.target))
        # The coordinator loads its code beside the others but starts only once they are healthy: a service that
        # dies before that is a failed start, one that dies later is restarted (services.max_restarts).
        coordinator = self._spawn("coordinator", self._service_args("coordinator"), gated=True)
        for child, target in waits:
            self._await(child, target)
            log.info("%s is healthy at %s", child.name, target)
        _let_go(coordinator)
        # a coordinator dying as it starts (a service died under it) is restarted by watch() when allowed
        self._await(coordinator, s.coordinator.target, may_exit=True)

    def coordinator_child(self) -> Child:
        return next(c for c in self.children if c.name == "coordinator")

    def watch(self) -> int:
        """Shows progress from WatchEvents until the coordinator finishes; a dead child fails the run, or is
        restarted while services.max_restarts allows."""
        from services.launcher.progress import ProgressView

        view = self.view = ProgressView(enabled=self.progress)
        threading.Thread(target=self._stream_events, args=(view,), daemon=True).start()
        with view:
            while True:
                coordinator = self.coordinator_child()
                dead = [c for c in self.children if not c.alive() and c is not coordinator]
                if self.redis is not None and not self.redis.alive():
                    if not self._restart_redis():
                        view.stop()
                        return ExitCode.FAILED
                elif dead:
                    if not self._restart(dead[0]):
                        view.stop()
                        return ExitCode.FAILED
                elif not coordinator.alive():
                    code = coordinator.process.returncode
                    if code in (0, ExitCode.PERMANENT) or self.interrupts or not self._restart(coordinator):
                        break
                time.sleep(WATCH_POLL_S)
        coordinator = self.coordinator_child()
        code = coordinator.process.returncode
        if code != 0:
            self.failure = read_failure(self.run_dir) or self._exited(coordinator)
        return code

    def _exited(self, child: Child, reason: str = "") -> FailureRecord:
        """The record of a child that died without writing one (a crash, a signal): its log tail is logged too."""
        reason = reason or f"exited with {child.process.returncode}"
        log.error("%s %s. Last lines of %s:\n%s", child.name, reason, child.log_path, child.log_tail())
        return FailureRecord(
            service=child.name,
            kind="EXITED",
            what=f"{child.name} {reason}",
            kept=self._kept(),
            exit_code=ExitCode.FAILED,
        )

    def _kept(self) -> str:
        from services.contracts.checkpoints import latest_checkpoint

        latest = latest_checkpoint(self.config, run_dir=self.run_dir)
        return str(latest) if latest is not None else ""

    def _why(self, child: Child, lines: int) -> str:
        """Why a child died, for the restart's log line: the coordinator's own record, else the tail of its log."""
        record = read_failure(self.run_dir) if child.name == "coordinator" else None
        if record is not None:
            return f"{record.service} answered {record.call or 'it'} with {record.kind}: {record.what}"
        return f"Last lines of {child.log_path}:\n{child.log_tail(lines)}"

    def _restart(self, child: Child) -> bool:
        """Restarts a dead child (see the module docstring), and again whatever dies or hangs while it comes
        back, one restart each, as long as services.max_restarts allows. False when none is left."""
        dead, reason, starting = child, f"exited with {child.process.returncode}", False
        while self._take_restart(dead, reason, starting=starting):
            try:
                self._bring_back(stop_coordinator=dead.name in ("trainer", "critic"))
                log.info("%s restarted", child.name)
                return True
            except _StartFailed as failed:
                dead, reason, starting = failed.child, failed.reason, True
        return False

    def _take_restart(self, child: Child, reason: str, *, starting: bool) -> bool:
        if self.restarts_left <= 0 or self.interrupts:
            if child.name != "coordinator" or starting:  # watch() reports a coordinator that failed running
                limit = self.config.services.max_restarts
                why = (
                    "Ctrl-C"
                    if self.interrupts
                    else (
                        f"services.max_restarts {limit} used up"
                        if limit
                        else "restarts are off: services.max_restarts is 0"
                    )
                )
                self.failure = self._exited(child, f"{reason}; stopping the run ({why})")
            return False
        self.restarts_left -= 1
        used = self.config.services.max_restarts - self.restarts_left
        log.warning(
            "%s %s; restarting it (restart %d of services.max_restarts %d). %s",
            child.name,
            reason,
            used,
            self.config.services.max_restarts,
            self._why(child, 8),
        )
        return True

    def _bring_back(self, *, stop_coordinator: bool) -> None:
        """Starts every dead child again, the coordinator last; raises _StartFailed naming one that did not
        come up."""
        if self.redis is not None and not self.redis.alive() and not self._restart_redis():
            raise _StartFailed(self.coordinator_child(), "could not run without redis-server")
        coordinator = self.coordinator_child()
        if stop_coordinator and coordinator.alive():
            log.warning("stopping the coordinator too (kill -9): it resumes from the last checkpoint")
            os.killpg(coordinator.process.pid, signal.SIGKILL)
            coordinator.process.wait()
        for child in [c for c in self.children if c is not coordinator and not c.alive()]:
            self._start_again(child)
        if not coordinator.alive() and coordinator.process.returncode not in (0, ExitCode.PERMANENT):
            self._start_again(coordinator)
            threading.Thread(target=self._stream_events, args=(self.view,), daemon=True).start()

    def _start_again(self, child: Child) -> None:
        new = self._respawn(child)
        try:
            self._await(new, self._target_of(new))
        except RuntimeError:
            raise _StartFailed(new, f"exited with {new.process.returncode} while starting") from None
        except TimeoutError:
            os.killpg(new.process.pid, signal.SIGKILL)
            new.process.wait()
            raise _StartFailed(
                new,
                f"was not healthy within loop.startup_timeout_s "
                f"({self.config.loop.startup_timeout_s:.0f}s) while starting",
            ) from None

    def _restart_redis(self) -> bool:
        assert self.redis is not None
        code = self.redis.process.returncode if self.redis.process is not None else None
        if self.restarts_left <= 0:
            self.failure = FailureRecord(
                service="redis-server",
                kind="EXITED",
                what=f"redis-server exited with {code}",
                kept=self._kept(),
                exit_code=ExitCode.FAILED,
            )
            return False
        self.restarts_left -= 1
        log.warning(
            "redis-server exited with %s; restarting it on port %d (appendonly %s)",
            code,
            self.redis.port,
            self.redis.appendonly,
        )
        self.redis.start(self.config.loop.startup_timeout_s)
        return True

    def _stream_events(self, view: ProgressView) -> None:
        s = self.config.services
        try:
            with open_channel(s.coordinator.target, tls_ca=s.tls_ca, auth_token=s.auth_token) as channel:
                stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                status = stub.GetStatus(common_pb2.Empty(), timeout=s.timeouts.control_s)
                view.set_total(status.num_rollout, start=status.rollout_id)
                for event in stub.WatchEvents(coordinator_pb2.WatchRequest(include_history=True)):
                    if not view.total:  # asked before the coordinator's start-up knew it (0 until then)
                        status = stub.GetStatus(common_pb2.Empty(), timeout=s.timeouts.control_s)
                        view.set_total(status.num_rollout, start=status.rollout_id)
                    view.on_event(event)
        except grpc.RpcError:
            pass  # the coordinator went away; watch() notices and reports

    def request_stop(self) -> None:
        self.interrupts += 1
        if self.interrupts > 1:
            raise KeyboardInterrupt
        log.info("Ctrl-C: asking the coordinator to stop after this step (again to terminate)")
        s = self.config.services
        try:
            with open_channel(s.coordinator.target, tls_ca=s.tls_ca, auth_token=s.auth_token) as channel:
                # wait_for_ready: a channel in reconnect backoff (a coordinator that has just started) fails at
                # once otherwise, and a Ctrl-C then terminates instead of stopping gracefully
                coordinator_pb2_grpc.CoordinatorStub(channel).Stop(
                    common_pb2.Empty(), timeout=s.timeouts.control_s, wait_for_ready=True
                )
        except grpc.RpcError as exc:
            log.warning("could not reach the coordinator (%s); terminating", exc.code().name)
            raise KeyboardInterrupt from None

    def shutdown(self) -> None:
        grace = self.config.services.timeouts.shutdown_s
        for child in reversed(self.children):  # coordinator first, then rollouts, then trainers
            child.stop(grace)
        if self.redis is not None:
            self.redis.stop(grace)
        (self.run_dir / RUN_MARKER).unlink(missing_ok=True)


def run_local(config: TandemConfig, *, run_dir: Path, progress: bool) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_dir.mkdir(parents=True, exist_ok=True)
    run = LocalRun(config, run_dir=run_dir, progress=progress)
    previous = signal.signal(signal.SIGINT, lambda *_: run.request_stop())
    signal.signal(signal.SIGTERM, lambda *_: run.request_stop())
    try:
        run.start()
        code = run.watch()
    except KeyboardInterrupt:
        code = ExitCode.INTERRUPTED
    except (RuntimeError, TimeoutError) as exc:
        log.error("%s", exc)
        code = ExitCode.FAILED
    finally:
        signal.signal(signal.SIGINT, previous)
        run.shutdown()
    _say_where_it_is(run.config, run_dir=run_dir)
    if run.failure is not None:  # the last lines: what went wrong, where, what was kept, what to do, the exit code
        record = replace(run.failure, exit_code=code)
        print(record.render(command="tandem run", run_dir=run_dir), file=sys.stderr, flush=True)
    return code


def _say_where_it_is(config: TandemConfig, *, run_dir: Path) -> None:
    from services.contracts.checkpoints import latest_checkpoint

    latest = latest_checkpoint(config, run_dir=run_dir)
    if latest is not None:
        hf = latest / "hf"
        log.info("last checkpoint: %s%s", latest, f" (Hugging Face model: {hf})" if hf.is_dir() else "")
    log.info("run directory: %s (metrics.jsonl, logs/, checkpoints/)", run_dir)


def write_run_marker(run_dir: Path, *, coordinator: str) -> None:
    write_json_atomic(run_dir / RUN_MARKER, {"pid": os.getpid(), "coordinator": coordinator, "started": time.time()})
