"""`tandem ctl`: a small client of the coordinator's control API.

Which coordinator: `--addr HOST:PORT`; or `--run-dir DIR`, whose resolved config.yaml names the address
(and the token and CA, when the run uses them); or, with neither, the one `tandem run` under ./runs/ that
is running now; or 127.0.0.1:50051.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict

from services.contracts.config import ConfigError, TimeoutsConfig
from services.contracts.config_loading import load_config
from services.contracts.exits import ExitCode
from services.contracts.gen.tandem.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from services.rpc.grpc_util import open_channel

DEFAULT_ADDR = "127.0.0.1:50051"

ACTIONS = {
    "status": "state, rollout id, weight version, last checkpoint and the last step's metrics",
    "save": "save a checkpoint after the current step (returns at once; the save event says where)",
    "eval": "evaluate the current weights now and print the metrics (waits up to --timeout)",
    "pause": "finish the current step, then wait before the next one",
    "resume": "continue a paused run",
    "stop": "finish the current step, save a final checkpoint and end the run (exit 0)",
    "watch": "a live table of step, eval and save events until the run ends",
}


@dataclass(frozen=True)
class Target:
    addr: str
    token: str | None
    tls_ca: str | None
    control_s: float = TimeoutsConfig().control_s  # the run's services.timeouts.control_s, when its config is known


def find_coordinator(
    *, addr: str | None, run_dir: Path | None, token: str | None, tls_ca: str | None, runs_root: Path = Path("runs")
) -> Target:
    if addr:
        return Target(addr=addr, token=token, tls_ca=tls_ca)
    run_dir = run_dir or _running_run(runs_root)
    if run_dir is None:
        return Target(addr=DEFAULT_ADDR, token=token, tls_ca=tls_ca)
    resolved = run_dir / "config.yaml"
    if not resolved.is_file():
        raise ConfigError(
            f"--run-dir {run_dir}: not a run directory (no config.yaml; `tandem run` writes it "
            "once the run's ports are chosen)"
        )
    services = load_config(resolved).services
    return Target(
        addr=services.coordinator.target,
        token=token or services.auth_token,
        tls_ca=tls_ca or services.tls_ca,
        control_s=services.timeouts.control_s,
    )


def _running_run(runs_root: Path) -> Path | None:
    """The run directory under runs_root whose `tandem run` is alive (its run.json names a live pid)."""
    from services.contracts.runfacts import RUN_MARKER

    live = []
    for marker in sorted(runs_root.glob(f"*/{RUN_MARKER}")):
        try:
            pid = int(json.loads(marker.read_text())["pid"])
            os.kill(pid, 0)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable, or the run is gone (killed before it could remove its marker)
        live.append(marker.parent)
    if len(live) > 1:
        raise ConfigError(
            f"{len(live)} runs are running under {runs_root}/ ({', '.join(p.name for p in live)}): "
            "pick one with --run-dir or --addr"
        )
    return live[0] if live else None


def run_ctl(*, target: Target, action: str, timeout_s: float | None = None) -> int:
    """`timeout_s` None: the run's services.timeouts.control_s."""
    timeout_s = target.control_s if timeout_s is None else timeout_s
    try:
        with open_channel(target.addr, tls_ca=target.tls_ca, auth_token=target.token) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            if action == "watch":
                from services.coordinator.watch import watch_table

                return watch_table(stub)
            method = {
                "status": stub.GetStatus,
                "save": stub.Save,
                "eval": stub.Eval,
                "pause": stub.Pause,
                "resume": stub.Resume,
                "stop": stub.Stop,
            }[action]
            request = coordinator_pb2.EvalRequest(timeout_s=timeout_s) if action == "eval" else common_pb2.Empty()
            reply = method(request, timeout=timeout_s)
    except grpc.RpcError as exc:
        hint = (
            (f" (no coordinator at {target.addr}? a local `tandem run` prints its address; use --run-dir or --addr)")
            if exc.code() == grpc.StatusCode.UNAVAILABLE
            else ""
        )
        print(f"tandem ctl {action}: {exc.code().name}: {exc.details()}{hint}", file=sys.stderr)
        return ExitCode.FAILED
    print(json.dumps(MessageToDict(reply, preserving_proto_field_name=True), indent=2, sort_keys=True))
    return ExitCode.OK
