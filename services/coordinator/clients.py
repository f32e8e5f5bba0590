"""gRPC implementations of TrainerApi and RolloutApi: each call under its deadline from the config, every failure a
ServiceCallError naming the service, the call and the status."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc

from services.contracts.config import ServiceAddress, ServicesConfig, TandemConfig
from services.contracts.gen.tandem.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from services.contracts.rollout_calls import (
    EvaluateRequest,
    EvaluateResult,
    GenerateRequest,
    GenerateResult,
    PrepareResult,
    PromptInput,
    ReceiveRequest,
    ReceiveResult,
    RolloutStatus,
)
from services.contracts.trainer_calls import (
    LoadResult,
    PublishResult,
    SaveRequest,
    SaveResult,
    TrainerStatus,
    TrainRequest,
    TrainResult,
    WeightSyncRequest,
)
from services.coordinator.call_errors import ServiceCallError, TrainerStateLost
from services.rpc.grpc_util import open_channel, wait_healthy

Reply = TypeVar("Reply")


@dataclass(frozen=True)
class Deadlines:
    """The deadline of each kind of call, in seconds, and the config key it comes from."""

    step_s: float  # Train, Save, Load, Generate, Evaluate: loop.step_timeout_s
    weights_s: float  # the prepare phase of a weight sync: weights.timeout_s
    control_s: float  # GetState, Resume: services.timeouts.control_s
    probe_s: float  # GetState of a replica that failed: services.timeouts.probe_s
    memory_s: float  # Offload/Onload, ReleaseMemory/ResumeMemory: services.timeouts.memory_s

    @classmethod
    def from_config(cls, config: TandemConfig) -> Deadlines:
        t = config.services.timeouts
        return cls(
            step_s=config.loop.step_timeout_s,
            weights_s=config.weights.timeout_s,
            control_s=t.control_s,
            probe_s=t.probe_s,
            memory_s=t.memory_s,
        )

    @property
    def transfer_s(self) -> float:
        """A transfer's services give up after weights.timeout_s themselves; the caller waits one control deadline
        longer, so that their error (naming the phase and the peer) arrives instead of a bare DEADLINE_EXCEEDED."""
        return self.weights_s + self.control_s


def train_request_proto(request: TrainRequest) -> trainer_pb2.TrainRequest:
    return trainer_pb2.TrainRequest(
        rollout_id=request.rollout_id,
        entry_ids=request.entry_ids,
        num_batches=request.num_batches,
        max_staleness=request.max_staleness,
        use_critic_values=request.use_critic_values,
        trace_context=request.trace_context,
    )


def train_result_of(r: trainer_pb2.TrainResponse) -> TrainResult:
    return TrainResult(
        rollout_id=r.rollout_id,
        step=r.step,
        metrics=dict(r.metrics),
        entry_ids=tuple(r.entry_ids),
        samples_trained=r.samples_trained,
        samples_dropped_stale=r.samples_dropped_stale,
        samples_filtered=r.samples_filtered,
        time_s=r.time_s,
        replayed=r.replayed,
    )


def save_request_proto(request: SaveRequest) -> trainer_pb2.SaveRequest:
    return trainer_pb2.SaveRequest(
        rollout_id=request.rollout_id, path=request.path, export_hf=request.export_hf, extra_state=request.extra_state
    )


def prompt_proto(p: PromptInput) -> common_pb2.Prompt:
    return common_pb2.Prompt(
        text=p.text,
        token_ids=p.token_ids,
        label=p.label,
        group_id=p.group_id,
        metadata=p.metadata,
        messages=[common_pb2.ChatMessage(role=m.role, content=m.content) for m in p.messages],
    )


def generate_request_proto(request: GenerateRequest) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        rollout_id=request.rollout_id,
        prompts=[prompt_proto(p) for p in request.prompts],
        n_samples_per_prompt=request.n_samples_per_prompt,
        stream=request.stream,
        trace_context=request.trace_context,
        reward=request.reward,
        sampling=request.sampling.to_proto() if request.sampling is not None else None,
    )


def generate_result_of(r: rollout_pb2.GenerateResponse) -> GenerateResult:
    return GenerateResult(
        entry_id=r.entry_id,
        num_samples=r.num_samples,
        num_prompt_tokens=r.num_prompt_tokens,
        num_response_tokens=r.num_response_tokens,
        weight_version=r.weight_version,
        generate_time_s=r.generate_time_s,
        reward_time_s=r.reward_time_s,
        put_time_s=r.put_time_s,
        metrics=dict(r.metrics),
        producer=r.producer,
        num_groups=r.num_groups,
        informative_groups=r.informative_groups,
    )


def rollout_status_of(s: rollout_pb2.RolloutState) -> RolloutStatus:
    return RolloutStatus(
        engine=s.engine,
        model_path=s.model_path,
        weight_version=s.weight_version,
        paused=s.paused,
        memory_released=s.memory_released,
        generated_samples=s.generated_samples,
        device=s.device,
        producer=s.producer,
        in_flight=s.in_flight,
        gpu_memory_reserved_bytes=s.gpu_memory_reserved_bytes,
        gpu_memory_freed_bytes=s.gpu_memory_freed_bytes,
        engine_busy_s=s.engine_busy_s,
    )


class GrpcService:
    def __init__(
        self,
        name: str,
        target: str,
        *,
        services: ServicesConfig,
        deadlines: Deadlines,
        wait_for_ready: bool = False,
        process: str = "",
    ):
        self.name = name
        self.process = process or name  # its log: RUN_DIR/logs/<process>.log
        self.target = target
        self.deadlines = deadlines
        self.wait_for_ready = wait_for_ready  # calls wait, within their deadline, for a service that restarts
        self._tls_ca = services.tls_ca
        self._health_check_s = services.timeouts.health_check_s
        self.channel = open_channel(
            target, max_message_mb=services.max_message_mb, tls_ca=services.tls_ca, auth_token=services.auth_token
        )

    def wait_healthy(self, timeout_s: float) -> None:
        wait_healthy(self.target, timeout_s=timeout_s, tls_ca=self._tls_ca, check_timeout_s=self._health_check_s)

    def _call(
        self,
        method: Callable[..., Reply],
        request: object,
        *,
        timeout_s: float,
        what: str,
        wait_for_ready: bool = False,
    ) -> Reply:
        try:
            return method(request, timeout=timeout_s, wait_for_ready=wait_for_ready)
        except grpc.RpcError as exc:
            raise ServiceCallError.from_rpc(self.name, what, exc, process=self.process) from exc

    def close(self) -> None:
        self.channel.close()


class GrpcTrainer(GrpcService):
    def __init__(self, name: str, target: str, *, services: ServicesConfig, deadlines: Deadlines):
        super().__init__(name, target, services=services, deadlines=deadlines)
        self.stub = trainer_pb2_grpc.TrainerStub(self.channel)
        # The trainer's optimizer step after the last Train or Load (None = not known yet): a reply that does not
        # follow on from it comes from a trainer that lost its state.
        self.last_step: int | None = None

    def train(self, request: TrainRequest) -> TrainResult:
        reply = train_result_of(
            self._call(
                self.stub.Train,
                train_request_proto(request),
                timeout_s=self.deadlines.step_s,
                what=f"Train({request.rollout_id})",
            )
        )
        expected = None if self.last_step is None else self.last_step + (1 if reply.samples_trained else 0)
        if not reply.replayed and expected is not None and reply.step != expected:
            raise TrainerStateLost(
                f"{self.name} answered Train({request.rollout_id}) at optimizer step {reply.step}, "
                f"expected {expected}: it restarted and lost its state; restart the coordinator "
                "to resume from the last checkpoint",
                service=self.process,
                call=f"Train({request.rollout_id})",
            )
        self.last_step = reply.step
        return reply

    def save(self, request: SaveRequest) -> SaveResult:
        r = self._call(self.stub.Save, save_request_proto(request), timeout_s=self.deadlines.step_s, what="Save")
        return SaveResult(path=r.path, hf_path=r.hf_path, step=r.step, time_s=r.time_s)

    def load(self) -> LoadResult:
        r = self._call(self.stub.Load, trainer_pb2.LoadRequest(), timeout_s=self.deadlines.step_s, what="Load")
        self.last_step = r.step if r.loaded else None
        return LoadResult(
            loaded=r.loaded,
            path=r.path,
            rollout_id=r.rollout_id,
            step=r.step,
            weight_version=r.weight_version,
            extra_state=dict(r.extra_state),
        )

    def prepare_weight_sync(self, request: WeightSyncRequest) -> common_pb2.WeightSyncPlan:
        proto = trainer_pb2.PrepareWeightSyncRequest(
            version=request.version,
            transport=request.transport,
            engine_world_size=request.engine_world_size,
            verify=request.verify,
            verify_by_bucket=request.verify_by_bucket,
        )
        return self._call(
            self.stub.PrepareWeightSync,
            proto,
            timeout_s=self.deadlines.weights_s,
            what=f"PrepareWeightSync(v{request.version})",
        )

    def publish_weights(self, version: int) -> PublishResult:
        r = self._call(
            self.stub.PublishWeights,
            trainer_pb2.PublishWeightsRequest(version=version),
            timeout_s=self.deadlines.transfer_s,
            what=f"PublishWeights(v{version})",
        )
        return PublishResult(version=r.version, bytes_sent=r.bytes_sent, time_s=r.time_s)

    def offload(self) -> None:
        self._call(self.stub.Offload, common_pb2.Empty(), timeout_s=self.deadlines.memory_s, what="Offload")

    def onload(self) -> None:
        self._call(self.stub.Onload, common_pb2.Empty(), timeout_s=self.deadlines.memory_s, what="Onload")

    def get_state(self) -> TrainerStatus:
        s = self._call(self.stub.GetState, common_pb2.Empty(), timeout_s=self.deadlines.control_s, what="GetState")
        return TrainerStatus(
            role="critic" if s.role == "critic" else "actor",
            step=s.step,
            last_rollout_id=s.last_rollout_id,
            weight_version=s.weight_version,
            world_size=s.world_size,
            zero_stage=s.zero_stage,
            offloaded=s.offloaded,
            device=s.device,
            samples_trained=s.samples_trained,
            gpu_memory_reserved_bytes=s.gpu_memory_reserved_bytes,
        )


class GrpcRollout(GrpcService):
    """One replica. Its control calls wait for a replica that restarts when `wait_for_ready` (services.max_restarts
    > 0); Generate and the probe do not: the pool retries a share elsewhere instead."""

    def __init__(
        self,
        name: str,
        target: str,
        *,
        services: ServicesConfig,
        deadlines: Deadlines,
        wait_for_ready: bool = False,
        process: str = "",
    ):
        super().__init__(
            name, target, services=services, deadlines=deadlines, wait_for_ready=wait_for_ready, process=process
        )
        self.stub = rollout_pb2_grpc.RolloutStub(self.channel)

    def generate(self, request: GenerateRequest) -> GenerateResult:
        return generate_result_of(
            self._call(
                self.stub.Generate,
                generate_request_proto(request),
                timeout_s=self.deadlines.step_s,
                what=f"Generate({request.rollout_id})",
            )
        )

    def evaluate(self, request: EvaluateRequest) -> EvaluateResult:
        proto = rollout_pb2.EvaluateRequest(
            name=request.name,
            prompts=[prompt_proto(p) for p in request.prompts],
            n_samples_per_prompt=request.n_samples_per_prompt,
            reward=request.reward,
            sampling=request.sampling.to_proto() if request.sampling is not None else None,
        )
        r = self._call(
            self.stub.Evaluate,
            proto,
            timeout_s=self.deadlines.step_s,
            what="Evaluate",
            wait_for_ready=self.wait_for_ready,
        )
        return EvaluateResult(metrics=dict(r.metrics), weight_version=r.weight_version, time_s=r.time_s)

    def prepare_weight_sync(self, *, version: int, pause_mode: str) -> PrepareResult:
        r = self._call(
            self.stub.PrepareWeightSync,
            rollout_pb2.PrepareReceiveRequest(version=version, pause_mode=pause_mode),
            timeout_s=self.deadlines.weights_s,
            what=f"PrepareWeightSync(v{version})",
            wait_for_ready=self.wait_for_ready,
        )
        return PrepareResult(ready=r.ready, engine_ranks=r.engine_ranks)

    def receive_weights(self, request: ReceiveRequest) -> ReceiveResult:
        r = self._call(
            self.stub.ReceiveWeights,
            rollout_pb2.ReceiveWeightsRequest(plan=request.plan, rank_offset=request.rank_offset),
            timeout_s=self.deadlines.transfer_s,
            what=f"ReceiveWeights(v{request.plan.version})",
        )
        return ReceiveResult(
            version=r.version,
            checksums=dict(r.checksums),
            bytes_received=r.bytes_received,
            time_s=r.time_s,
            bucket_checksums=tuple(r.bucket_checksums),
            checksum_s=r.checksum_s,
        )

    def resume(self) -> None:
        self._call(
            self.stub.Resume,
            common_pb2.Empty(),
            timeout_s=self.deadlines.control_s,
            what="Resume",
            wait_for_ready=self.wait_for_ready,
        )

    def release_memory(self, tags: Sequence[str]) -> None:
        self._call(
            self.stub.ReleaseMemory,
            rollout_pb2.MemoryRequest(tags=list(tags)),
            timeout_s=self.deadlines.memory_s,
            what="ReleaseMemory",
            wait_for_ready=self.wait_for_ready,
        )

    def resume_memory(self, tags: Sequence[str]) -> None:
        self._call(
            self.stub.ResumeMemory,
            rollout_pb2.MemoryRequest(tags=list(tags)),
            timeout_s=self.deadlines.memory_s,
            what="ResumeMemory",
            wait_for_ready=self.wait_for_ready,
        )

    def get_state(self) -> RolloutStatus:
        return rollout_status_of(
            self._call(
                self.stub.GetState,
                common_pb2.Empty(),
                timeout_s=self.deadlines.control_s,
                what="GetState",
                wait_for_ready=self.wait_for_ready,
            )
        )

    def probe(self) -> RolloutStatus:
        return rollout_status_of(
            self._call(self.stub.GetState, common_pb2.Empty(), timeout_s=self.deadlines.probe_s, what="GetState")
        )


def make_clients(config: TandemConfig) -> tuple[GrpcTrainer, GrpcTrainer | None, list[GrpcRollout]]:
    """The actor, the critic (None without one) and the rollout replicas of config.services."""
    services, deadlines = config.services, Deadlines.from_config(config)

    def target(addr: ServiceAddress) -> str:
        if addr.port == 0:
            raise ValueError(
                f"service address {addr.host}:0 has no port: set it in services.* (tandem run picks free ports itself)"
            )
        return addr.target

    actor = GrpcTrainer("trainer", target(services.trainer), services=services, deadlines=deadlines)
    critic = (
        GrpcTrainer("critic", target(services.critic), services=services, deadlines=deadlines)
        if config.algorithm.uses_critic
        else None
    )
    rollouts = [
        GrpcRollout(
            f"rollout[{i}]",
            target(a),
            services=services,
            deadlines=deadlines,
            wait_for_ready=services.max_restarts > 0,
            process=f"rollout-{i}",
        )
        for i, a in enumerate(services.rollout)
    ]
    return actor, critic, rollouts
