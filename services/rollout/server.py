"""The rollout service's gRPC server: a thin adapter over `RolloutService`, and `main` for the CLI.

    tandem rollout CONFIG --replica N [--set redis.url=redis://...] [--set 'services.rollout=[{port: 50061}]']

Binds `services.bind_host:services.rollout[N].port` (0 = a free port) only after the model is loaded, so
health SERVING means ready; prints `TANDEM_READY rollout <port>`; stops gracefully on SIGTERM / SIGINT.
A start-up problem (missing model directory, unknown reward, bad replica index) is one line on stderr
and exit code 2.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import grpc

from services.contracts.config import TandemConfig
from services.contracts.convert import from_message, to_message
from services.contracts.exits import ExitCode
from services.contracts.gen.tandem.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.contracts.rollout_calls import (
    EvaluateRequest,
    GenerateRequest,
    MemoryRequest,
    PauseRequest,
    PrepareRequest,
    ReceiveRequest,
)
from services.rollout.builder import build_rollout
from services.rollout.service import RolloutService
from services.rpc.grpc_util import ServerOptions, map_errors, start_server
from services.rpc.shutdown import StopSignals, begin_stop, exit_now
from services.telemetry import tracing
from services.telemetry.process_age import process_age_s

log = logging.getLogger(__name__)


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    """Thin adapter: each call's message as its dataclass into RolloutService, the dataclass it returns back as the
    reply message (contracts/convert.py); errors become status codes."""

    def __init__(self, service: RolloutService):
        self.service = service

    @map_errors
    def Generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> rollout_pb2.GenerateResponse:
        result = self.service.generate(from_message(request, GenerateRequest), caller_active=context.is_active)
        return to_message(result, rollout_pb2.GenerateResponse)

    @map_errors
    def Evaluate(
        self, request: rollout_pb2.EvaluateRequest, context: grpc.ServicerContext
    ) -> rollout_pb2.EvaluateResponse:
        return to_message(self.service.evaluate(from_message(request, EvaluateRequest)), rollout_pb2.EvaluateResponse)

    @map_errors
    def PrepareWeightSync(
        self, request: rollout_pb2.PrepareReceiveRequest, context: grpc.ServicerContext
    ) -> rollout_pb2.PrepareReceiveResponse:
        result = self.service.prepare_weight_sync(from_message(request, PrepareRequest))
        return to_message(result, rollout_pb2.PrepareReceiveResponse)

    @map_errors
    def ReceiveWeights(
        self, request: rollout_pb2.ReceiveWeightsRequest, context: grpc.ServicerContext
    ) -> rollout_pb2.ReceiveWeightsResponse:
        result = self.service.receive_weights(from_message(request, ReceiveRequest))
        return to_message(result, rollout_pb2.ReceiveWeightsResponse)

    @map_errors
    def Pause(self, request: rollout_pb2.PauseRequest, context: grpc.ServicerContext) -> common_pb2.Ack:
        return to_message(self.service.pause(from_message(request, PauseRequest)), common_pb2.Ack)

    @map_errors
    def Resume(self, request: common_pb2.Empty, context: grpc.ServicerContext) -> common_pb2.Ack:
        return to_message(self.service.resume(), common_pb2.Ack)

    @map_errors
    def ReleaseMemory(self, request: rollout_pb2.MemoryRequest, context: grpc.ServicerContext) -> common_pb2.Ack:
        return to_message(self.service.release_memory(from_message(request, MemoryRequest)), common_pb2.Ack)

    @map_errors
    def ResumeMemory(self, request: rollout_pb2.MemoryRequest, context: grpc.ServicerContext) -> common_pb2.Ack:
        return to_message(self.service.resume_memory(from_message(request, MemoryRequest)), common_pb2.Ack)

    @map_errors
    def GetState(self, request: common_pb2.Empty, context: grpc.ServicerContext) -> rollout_pb2.RolloutState:
        return to_message(self.service.status(), rollout_pb2.RolloutState)


def generate_calls(config: TandemConfig) -> int:
    """Generate calls one replica may hold at once beyond the usual: loop.mode streaming sends one per group (all of
    them to one replica, at worst)."""
    return config.streaming_groups_in_flight if config.loop.mode == "streaming" else 0


def startup_problem(config: TandemConfig, replica: int) -> str | None:
    """Cheap checks before loading anything, each a one-line reason."""
    if not 0 <= replica < len(config.services.rollout):
        return f"--replica {replica} is out of range: services.rollout lists {len(config.services.rollout)} address(es)"
    model = Path(config.model.path)
    if not (model / "config.json").is_file():
        what = "does not exist" if not model.exists() else "has no config.json (not a Hugging Face model directory)"
        return (
            f"model.path {model} {what}; create a random-init model with `tandem init-model {model} "
            "--preset tiny` or pass --init-model to `tandem run`"
        )
    from services.rollout.reward_mix import check_rule_terms
    from services.rollout.rewards import RewardSpecError

    for key, spec in (("rollout.reward", config.rollout.reward), ("rollout.eval_reward", config.rollout.eval_reward)):
        try:
            if spec:
                check_rule_terms(spec)
        except RewardSpecError as exc:
            return f"{key}: {exc}"
    if config.rollout.environment:
        from services.rollout.environment_registry import resolve_environment
        from services.rollout.environments import EnvironmentSpecError

        try:
            resolve_environment(config.rollout.environment)
        except EnvironmentSpecError as exc:
            return f"rollout.environment: {exc}"
    return None


def main(config: TandemConfig, *, run_dir: Path, replica: int) -> int:
    name = f"rollout-{replica}"
    tracing.setup_logging(name, config.tracing.log_level, str(run_dir / "logs" / f"{name}.log"))
    problem = startup_problem(config, replica)
    if problem:
        print(f"tandem rollout: {problem}", file=sys.stderr, flush=True)
        return ExitCode.BAD_INPUT
    tracing.setup_tracing(
        "tandem-rollout",
        exporter=config.tracing.exporter,
        instance=name,
        file_path=config.tracing.file_path or str(run_dir / "traces.jsonl"),
    )
    try:
        service = RolloutService(build_rollout(config, replica=replica))
    except (OSError, ValueError, NotImplementedError) as exc:
        print(
            f"tandem rollout: could not start: {type(exc).__name__}: {exc}".replace("\n", " "),
            file=sys.stderr,
            flush=True,
        )
        return ExitCode.BAD_INPUT
    if service.agents is not None:  # where `tandem ctl episodes --run-dir` finds the agent endpoint
        from services.rollout.agents.episodes_client import write_endpoint_file

        write_endpoint_file(run_dir, replica, service.agents.server.url)
    svc = config.services
    server = start_server(
        [(rollout_pb2_grpc.add_RolloutServicer_to_server, RolloutServicer(service), "tandem.v1.Rollout")],
        ServerOptions(
            bind_host=svc.bind_host,
            port=svc.rollout[replica].port,
            max_message_mb=svc.max_message_mb,
            auth_token=svc.auth_token,
            tls_cert=svc.tls_cert,
            tls_key=svc.tls_key,
            max_workers=ServerOptions.max_workers + generate_calls(config),
        ),
    )
    stop = StopSignals()
    log.info("%s ready %.1fs after its process started", name, process_age_s())
    log.info(
        "%s serving on %s:%d (engine %s, model %s, device %s)",
        name,
        svc.bind_host,
        server.port,
        service.engine.name,
        config.model.path,
        service.get_state().engine.device,
    )
    print(f"TANDEM_READY rollout {server.port}", flush=True)
    signum = stop.wait()
    begin_stop(name=name, signum=signum, shutdown_s=svc.timeouts.shutdown_s, code=ExitCode.OK)
    # calls in flight get a third of the graceful-stop budget; closing the engine gets the rest
    server.stop(grace_s=svc.timeouts.shutdown_s / 3)
    service.close()
    tracing.shutdown_tracing()
    exit_now(ExitCode.OK)
    return ExitCode.OK
