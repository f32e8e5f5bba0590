"""gRPC implementations of TrainerApi and RolloutApi: each call under its deadline from the config, every failure a
ServiceCallError naming the service, the call and the status."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypedDict, TypeVar

import grpc
from google.protobuf.message import Message

from services.contracts.common_calls import Ack, Empty
from services.contracts.config import ServiceAddress, ServicesConfig, TandemConfig
from services.contracts.convert import from_message
from services.contracts.gen.tandem.v1 import rollout_pb2_grpc, trainer_pb2_grpc
from services.contracts.rollout_calls import (
    EvaluateRequest,
    EvaluateResult,
    GenerateRequest,
    GenerateResult,
    MemoryRequest,
    PrepareRequest,
    PrepareResult,
    ReceiveRequest,
    ReceiveResult,
    RolloutStatus,
)
from services.contracts.trainer_calls import (
    LoadRequest,
    LoadResult,
    PublishRequest,
    PublishResult,
    SaveRequest,
    SaveResult,
    TrainerStatus,
    TrainRequest,
    TrainResult,
    WeightSyncRequest,
)
from services.contracts.weight_plan import WeightSyncPlan
from services.coordinator.call_errors import ServiceCallError, TrainerStateLost
from services.rpc.grpc_util import open_channel, wait_healthy
from services.rpc.messages import message_of

Reply = TypeVar("Reply")


class _CallOptions(TypedDict):
    timeout_s: float
    what: str
    wait_for_ready: bool


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
        method: Callable[..., Message],
        request: object,
        reply: type[Reply],
        *,
        timeout_s: float,
        what: str,
        wait_for_ready: bool = False,
    ) -> Reply:
        """`request` (a dataclass) as its message, the answer as the dataclass `reply`."""
        try:
            answer = method(message_of(request), timeout=timeout_s, wait_for_ready=wait_for_ready)
        except grpc.RpcError as exc:
            raise ServiceCallError.from_rpc(self.name, what, exc, process=self.process) from exc
        return from_message(answer, reply)

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
        what = f"Train({request.rollout_id})"
        reply = self._call(self.stub.Train, request, TrainResult, timeout_s=self.deadlines.step_s, what=what)
        expected = None if self.last_step is None else self.last_step + (1 if reply.samples_trained else 0)
        if not reply.replayed and expected is not None and reply.step != expected:
            raise TrainerStateLost(
                f"{self.name} answered Train({request.rollout_id}) at optimizer step {reply.step}, "
                f"expected {expected}: it restarted and lost its state; restart the coordinator "
                "to resume from the last checkpoint",
                service=self.process,
                call=what,
            )
        self.last_step = reply.step
        return reply

    def save(self, request: SaveRequest) -> SaveResult:
        return self._call(self.stub.Save, request, SaveResult, timeout_s=self.deadlines.step_s, what="Save")

    def load(self) -> LoadResult:
        result = self._call(self.stub.Load, LoadRequest(), LoadResult, timeout_s=self.deadlines.step_s, what="Load")
        self.last_step = result.step if result.loaded else None
        return result

    def prepare_weight_sync(self, request: WeightSyncRequest) -> WeightSyncPlan:
        what = f"PrepareWeightSync(v{request.version})"
        return self._call(
            self.stub.PrepareWeightSync, request, WeightSyncPlan, timeout_s=self.deadlines.weights_s, what=what
        )

    def publish_weights(self, version: int) -> PublishResult:
        request, what = PublishRequest(version=version), f"PublishWeights(v{version})"
        return self._call(
            self.stub.PublishWeights, request, PublishResult, timeout_s=self.deadlines.transfer_s, what=what
        )

    def offload(self) -> None:
        self._call(self.stub.Offload, Empty(), Ack, timeout_s=self.deadlines.memory_s, what="Offload")

    def onload(self) -> None:
        self._call(self.stub.Onload, Empty(), Ack, timeout_s=self.deadlines.memory_s, what="Onload")

    def get_state(self) -> TrainerStatus:
        return self._call(
            self.stub.GetState, Empty(), TrainerStatus, timeout_s=self.deadlines.control_s, what="GetState"
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
        what = f"Generate({request.rollout_id})"
        return self._call(self.stub.Generate, request, GenerateResult, timeout_s=self.deadlines.step_s, what=what)

    def evaluate(self, request: EvaluateRequest) -> EvaluateResult:
        return self._call(
            self.stub.Evaluate,
            request,
            EvaluateResult,
            timeout_s=self.deadlines.step_s,
            what="Evaluate",
            wait_for_ready=self.wait_for_ready,
        )

    def prepare_weight_sync(self, *, version: int, pause_mode: str) -> PrepareResult:
        return self._call(
            self.stub.PrepareWeightSync,
            PrepareRequest(version=version, pause_mode=pause_mode),
            PrepareResult,
            timeout_s=self.deadlines.weights_s,
            what=f"PrepareWeightSync(v{version})",
            wait_for_ready=self.wait_for_ready,
        )

    def receive_weights(self, request: ReceiveRequest) -> ReceiveResult:
        what = f"ReceiveWeights(v{request.plan.version})"
        return self._call(
            self.stub.ReceiveWeights, request, ReceiveResult, timeout_s=self.deadlines.transfer_s, what=what
        )

    def resume(self) -> None:
        self._call(self.stub.Resume, Empty(), Ack, **self._control("Resume", self.deadlines.control_s))

    def release_memory(self, tags: Sequence[str]) -> None:
        request = MemoryRequest(tags=tuple(tags))
        self._call(self.stub.ReleaseMemory, request, Ack, **self._control("ReleaseMemory", self.deadlines.memory_s))

    def resume_memory(self, tags: Sequence[str]) -> None:
        request = MemoryRequest(tags=tuple(tags))
        self._call(self.stub.ResumeMemory, request, Ack, **self._control("ResumeMemory", self.deadlines.memory_s))

    def get_state(self) -> RolloutStatus:
        control = self._control("GetState", self.deadlines.control_s)
        return self._call(self.stub.GetState, Empty(), RolloutStatus, **control)

    def _control(self, what: str, timeout_s: float) -> _CallOptions:
        """A control call waits, within its deadline, for a replica that restarts (when wait_for_ready)."""
        return {"timeout_s": timeout_s, "what": what, "wait_for_ready": self.wait_for_ready}

    def probe(self) -> RolloutStatus:
        return self._call(self.stub.GetState, Empty(), RolloutStatus, timeout_s=self.deadlines.probe_s, what="GetState")


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
