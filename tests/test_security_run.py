"""A full `tandem run` with the security options on: a bearer token and TLS on every gRPC service
(services.auth_token, tls_cert, tls_key, tls_ca; a self-signed certificate made here with openssl) and a
password-protected Redis reached over rediss:// (a real redis-server behind a TLS terminator in this
process). Unauthenticated or plaintext callers are refused, the run itself works, and every port it
opened listens on 127.0.0.1 only."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from reliability_kit import resolved_config_when_written, wait_for
from tandem_runs import REPO, metrics, start_run, stop_run, supervisor_log
from test_grpc_util import listening_addresses

from services.buffer.stream import connect
from services.contracts.gen.tandem.v1 import common_pb2, coordinator_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from services.launcher.redis_server import EmbeddedRedis
from services.rpc.grpc_util import open_channel

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.timeout(300)]
TOKEN, REDIS_PASSWORD = "t0ken-for-tests", "redis-pa55"


def make_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (it is its own CA), made with the openssl command line."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


class TlsTerminator:
    """rediss:// in front of a plain redis-server: TLS on a local port, bytes relayed to the server."""

    def __init__(self, cert: Path, key: Path, backend_port: int):
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert, key)
        self.backend_port = backend_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            secure = self.context.wrap_socket(conn, server_side=True)
        except (ssl.SSLError, OSError):
            conn.close()
            return
        backend = socket.create_connection(("127.0.0.1", self.backend_port))
        threading.Thread(target=_pump, args=(backend, secure), daemon=True).start()
        _pump(secure, backend)

    def close(self) -> None:
        self.listener.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def _ctl(target: str, action: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "ctl", "--addr", target, *extra, action],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=90,
    )


def _refused(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


def test_a_run_with_token_tls_and_a_redis_password_refuses_everyone_else(tmp_path):
    cert, key = make_certificate(tmp_path)
    with EmbeddedRedis(tmp_path / "redis", appendonly=False, password=REDIS_PASSWORD) as redis_server:
        terminator = TlsTerminator(cert, key, redis_server.port)
        url = f"rediss://127.0.0.1:{terminator.port}/0?ssl_ca_certs={cert}&ssl_cert_reqs=required"
        run_dir = tmp_path / "run"
        proc = start_run(
            run_dir,
            "loop.num_rollout=100000",
            "loop.eval_interval=null",
            f"redis.url={url}",
            f"redis.password={REDIS_PASSWORD}",
            f"services.auth_token={TOKEN}",
            f"services.tls_cert={cert}",
            f"services.tls_key={key}",
            f"services.tls_ca={cert}",
        )
        try:
            cfg = resolved_config_when_written(run_dir)
            s = cfg["services"]
            target = f"{s['coordinator']['host']}:{s['coordinator']['port']}"
            wait_for(lambda: _status_ok(target, cert), what="the run to train over TLS with the token")
            _check_refusals(target, f"{s['trainer']['host']}:{s['trainer']['port']}", cert)
            ok = _ctl(target, "status", "--token", TOKEN, "--tls-ca", str(cert))
            assert ok.returncode == 0 and json.loads(ok.stdout)["state"] == "running", ok.stderr
            bad = _ctl(target, "pause", "--tls-ca", str(cert))
            assert bad.returncode == 1 and "UNAUTHENTICATED" in bad.stderr
            ports = [s["coordinator"]["port"], s["trainer"]["port"], *(r["port"] for r in s["rollout"])]
            assert {a for p in ports for a in listening_addresses(p)} == {"127.0.0.1"}
            assert listening_addresses(redis_server.port) == {"127.0.0.1"}
            assert os.stat(run_dir / "config.yaml").st_mode & 0o077 == 0  # it holds the token
            with pytest.raises(Exception, match=r"(?i)auth"):  # Redis without the password: refused
                connect(f"redis://127.0.0.1:{redis_server.port}/0").xlen("x")
            assert _ctl(target, "stop", "--token", TOKEN, "--tls-ca", str(cert)).returncode == 0
            assert proc.wait(timeout=120) == 0, supervisor_log(run_dir)
        finally:
            stop_run(proc)
            terminator.close()
    assert len([r for r in metrics(run_dir) if "perf/step_time_s" in r]) >= 2
    for name in ("coordinator", "trainer", "rollout-0"):
        log = (run_dir / "logs" / f"{name}.log").read_text(errors="replace")
        assert REDIS_PASSWORD not in log and TOKEN not in log


def _status_ok(target: str, cert: Path) -> bool:
    try:
        with open_channel(target, tls_ca=str(cert), auth_token=TOKEN) as channel:
            status = coordinator_pb2_grpc.CoordinatorStub(channel).GetStatus(common_pb2.Empty(), timeout=5)
        return status.state == "running" and status.rollout_id >= 2
    except grpc.RpcError:
        return False


def _check_refusals(target: str, trainer_target: str, cert: Path) -> None:
    with open_channel(target) as plaintext:  # no TLS: the handshake never completes
        err = _refused(lambda: coordinator_pb2_grpc.CoordinatorStub(plaintext).GetStatus(common_pb2.Empty(), timeout=5))
        assert err.code() == grpc.StatusCode.UNAVAILABLE
    for token in (None, "wrong-token"):
        with open_channel(target, tls_ca=str(cert), auth_token=token) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            for rpc in (stub.Stop, stub.Save, stub.Pause):
                err = _refused(lambda rpc=rpc: rpc(common_pb2.Empty(), timeout=10))
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "services.auth_token" in err.details()
        with open_channel(trainer_target, tls_ca=str(cert), auth_token=token) as channel:
            err = _refused(lambda: trainer_pb2_grpc.TrainerStub(channel).Save(trainer_pb2.SaveRequest(), timeout=10))
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _status_ok(target, cert)  # none of it stopped or paused the run
