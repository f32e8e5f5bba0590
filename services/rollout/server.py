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

from services.contracts.chat_messages import ChatMessage
from services.contracts.config import TandemConfig
from services.contracts.exits import ExitCode
from services.contracts.gen.tandem.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.contracts.sampling_spec import SamplingSpec
from services.rollout.builder import build_rollout
from services.rollout.service import PromptInput, RolloutService
from services.rpc.grpc_util import ServerOptions, map_errors, start_server
from services.rpc.shutdown import StopSignals, begin_stop, exit_now
from services.telemetry import tracing
from services.telemetry.process_age import process_age_s
from services.tensors.devices import cuda_reserved_bytes

log = logging.getLogger(__name__)


def prompt_from_proto(p: common_pb2.Prompt) -> PromptInput:
    return PromptInput(
        text=p.text,
        token_ids=tuple(p.token_ids),
        label=p.label,
        group_id=p.group_id,
        metadata=dict(p.metadata),
        messages=tuple(ChatMessage(role=m.role, content=m.content) for m in p.messages),
    )


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, service: RolloutService):
        self.service = service
        self.config = service.config

    @map_errors
    def Generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> rollout_pb2.GenerateResponse:
        default = SamplingSpec.from_config(self.config.rollout.sampling)
        sampling = SamplingSpec.from_proto(request.sampling, default=default) if request.HasField("sampling") else None
        r = self.service.generate(
            rollout_id=request.rollout_id,
            prompts=[prompt_from_proto(p) for p in request.prompts],
            n_samples_per_prompt=request.n_samples_per_prompt or None,
            sampling=sampling,
            trace_context=dict(request.trace_context),
            stream=request.stream or None,
            reward=request.reward or None,
            caller_active=context.is_active,
        )
        return rollout_pb2.GenerateResponse(
            entry_id=r.entry_id,
            num_samples=r.num_samples,
            num_prompt_tokens=r.num_prompt_tokens,
            num_response_tokens=r.num_response_tokens,
            weight_version=r.weight_version,
            generate_time_s=r.generate_time_s,
            reward_time_s=r.reward_time_s,
            put_time_s=r.put_time_s,
            metrics=r.metrics,
            producer=r.producer,
            num_groups=r.num_groups,
            informative_groups=r.informative_groups,
        )

    @map_errors
    def Evaluate(
        self, request: rollout_pb2.EvaluateRequest, context: grpc.ServicerContext
    ) -> rollout_pb2.EvaluateResponse:
        sampling = (
            SamplingSpec.from_proto(
                request.sampling, default=SamplingSpec.from_config(self.config.rollout.eval_sampling)
            )
            if request.HasField("sampling")
            else None
        )
        r = self.service.evaluate(
            name=request.name or "eval",
            prompts=[prompt_from_proto(p) for p in request.prompts],
            n_samples_per_prompt=request.n_samples_per_prompt or None,
            sampling=sampling,
            reward=request.reward or None,
        )
        return rollout_pb2.EvaluateResponse(metrics=r.metrics, weight_version=r.weight_version, time_s=r.time_s)

    @map_errors
    def PrepareWeightSync(
        self, request: rollout_pb2.PrepareReceiveRequest, context: grpc.ServicerContext
    ) -> rollout_pb2.PrepareReceiveResponse:
        ready, ranks = self.service.prepare_weight_sync(version=request.version, pause_mode=request.pause_mode)
        return rollout_pb2.PrepareReceiveResponse(ready=ready, engine_ranks=ranks)

    @map_errors
    def ReceiveWeights(
        self, request: rollout_pb2.ReceiveWeightsRequest, context: grpc.ServicerContext
    ) -> rollout_pb2.ReceiveWeightsResponse:
        r = self.service.receive_weights(request.plan, request.rank_offset)
        return rollout_pb2.ReceiveWeightsResponse(
            version=r.version,
            checksums=r.checksums,
            bytes_received=r.bytes_received,
            time_s=r.time_s,
            bucket_checksums=r.bucket_checksums,
            checksum_s=r.checksum_s,
        )

    @map_errors
    def Pause(self, request: rollout_pb2.PauseRequest, context: grpc.ServicerContext) -> common_pb2.Ack:
        self.service.pause(request.mode or "drain")
        return common_pb2.Ack(ok=True, message=f"paused ({request.mode or 'drain'})")

    @map_errors
    def Resume(self, request: common_pb2.Empty, context: grpc.ServicerContext) -> common_pb2.Ack:
        self.service.resume()
        return common_pb2.Ack(ok=True, message="resumed")

    @map_errors
    def ReleaseMemory(self, request: rollout_pb2.MemoryRequest, context: grpc.ServicerContext) -> common_pb2.Ack:
        self.service.release_memory(tuple(request.tags))
        return common_pb2.Ack(ok=True, message=f"released {', '.join(request.tags) or 'all'}")

    @map_errors
    def ResumeMemory(self, request: rollout_pb2.MemoryRequest, context: grpc.ServicerContext) -> common_pb2.Ack:
        self.service.resume_memory(tuple(request.tags))
        return common_pb2.Ack(ok=True, message=f"resumed {', '.join(request.tags) or 'all'}")

    @map_errors
    def GetState(self, request: common_pb2.Empty, context: grpc.ServicerContext) -> rollout_pb2.RolloutState:
        s = self.service.get_state()
        e = s.engine
        return rollout_pb2.RolloutState(
            engine=e.engine,
            model_path=e.model_path,
            weight_version=e.weight_version,
            paused=e.paused,
            memory_released=bool(e.released_memory),
            generated_samples=e.generated_samples,
            device=e.device,
            producer=s.producer,
            in_flight=e.in_flight,
            gpu_memory_reserved_bytes=cuda_reserved_bytes(),
            gpu_memory_freed_bytes=e.memory_freed_bytes,
            engine_busy_s=e.busy_s,
        )


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
    from services.rollout.rewards import RewardSpecError, resolve_reward

    try:
        resolve_reward(config.rollout.reward)
    except RewardSpecError as exc:
        return f"rollout.reward: {exc}"
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
