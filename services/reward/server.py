"""The reward service's gRPC server: a thin adapter over `RewardService`, and `main` for the CLI.

    tandem reward CONFIG [--set services.reward.port=50071]

Binds `services.bind_host:services.reward.port` (0 = a free port) only after every model is loaded, so health
SERVING means ready; prints `TANDEM_READY reward <port>`; stops gracefully on SIGTERM / SIGINT. A start-up problem
(no reward: section, a missing model directory, a bad template or parser) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import grpc

from services.contracts.config import TandemConfig
from services.contracts.convert import from_message, to_message
from services.contracts.exits import ExitCode
from services.contracts.gen.tandem.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from services.contracts.reward_calls import ScoreRequest
from services.reward.builder import build_reward
from services.reward.service import RewardService
from services.rpc.grpc_util import ServerOptions, map_errors, start_server
from services.rpc.shutdown import StopSignals, begin_stop, exit_now
from services.telemetry import tracing
from services.telemetry.process_age import process_age_s

log = logging.getLogger(__name__)


class RewardServicer(reward_pb2_grpc.RewardServicer):
    """Messages to and from RewardService's dataclasses by the one converter (services/contracts/convert.py)."""

    def __init__(self, service: RewardService):
        self.service = service

    @map_errors
    def Score(self, request: reward_pb2.ScoreRequest, context: grpc.ServicerContext) -> reward_pb2.ScoreResponse:
        result = self.service.score(from_message(request, ScoreRequest))
        return to_message(result, reward_pb2.ScoreResponse)

    @map_errors
    def GetState(self, request: common_pb2.Empty, context: grpc.ServicerContext) -> reward_pb2.RewardState:
        return to_message(self.service.get_state(), reward_pb2.RewardState)


def startup_problem(config: TandemConfig) -> str | None:
    """Cheap checks before loading anything, each a one-line reason."""
    if config.reward is None:
        return "the config has no reward: section (reward.models names the models to serve)"
    for name, model in config.reward.models.items():
        path = Path(model.path)
        if not (path / "config.json").is_file():
            what = "does not exist" if not path.exists() else "has no config.json (not a Hugging Face model directory)"
            return f"reward.models.{name}.path {path} {what}"
    return None


def main(config: TandemConfig, *, run_dir: Path) -> int:
    name = "reward"
    tracing.setup_logging(name, config.tracing.log_level, str(run_dir / "logs" / f"{name}.log"))
    problem = startup_problem(config)
    if problem:
        print(f"tandem reward: {problem}", file=sys.stderr, flush=True)
        return ExitCode.BAD_INPUT
    tracing.setup_tracing(
        "tandem-reward",
        exporter=config.tracing.exporter,
        instance=name,
        file_path=config.tracing.file_path or str(run_dir / "traces.jsonl"),
    )
    try:
        service = RewardService(build_reward(config))
    except (OSError, ValueError, NotImplementedError) as exc:
        print(
            f"tandem reward: could not start: {type(exc).__name__}: {exc}".replace("\n", " "),
            file=sys.stderr,
            flush=True,
        )
        return ExitCode.BAD_INPUT
    svc = config.services
    server = start_server(
        [(reward_pb2_grpc.add_RewardServicer_to_server, RewardServicer(service), "tandem.v1.Reward")],
        ServerOptions(
            bind_host=svc.bind_host,
            port=svc.reward.port,
            max_message_mb=svc.max_message_mb,
            auth_token=svc.auth_token,
            tls_cert=svc.tls_cert,
            tls_key=svc.tls_key,
        ),
    )
    stop = StopSignals()
    log.info("%s ready %.1fs after its process started", name, process_age_s())
    log.info(
        "reward serving on %s:%d (models %s, device %s)",
        svc.bind_host,
        server.port,
        ", ".join(f"{n} ({m.type})" for n, m in service.parts.models.items()),
        service.parts.device,
    )
    print(f"TANDEM_READY reward {server.port}", flush=True)
    signum = stop.wait()
    begin_stop(name=name, signum=signum, shutdown_s=svc.timeouts.shutdown_s, code=ExitCode.OK)
    server.stop(grace_s=svc.timeouts.shutdown_s / 3)
    tracing.shutdown_tracing()
    exit_now(ExitCode.OK)
    return ExitCode.OK
