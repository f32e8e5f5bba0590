"""Clients the coordinator uses to drive trainers and rollout replicas: deadlines on every call, retries
of a replica's share of prompts on another replica when one fails."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from services.contracts.config import ServiceAddress, ServicesConfig
from services.contracts.gen.tandem.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from services.rpc.grpc_util import open_channel, wait_healthy

log = logging.getLogger(__name__)

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL,
             grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN}


# Statuses of errors that a restart would only repeat (a reward function that raises, a full disk, bad data): the
# coordinator then exits with ExitCode.PERMANENT and `tandem run` does not restart it.
PERMANENT_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED})


class ServiceCallError(RuntimeError):
    """A call to a service failed; the message names the service, the call and the status."""

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code

    @classmethod
    def from_rpc(cls, service: str, call: str, exc: grpc.RpcError) -> ServiceCallError:
        return cls(describe_rpc_error(service, call, exc), code=exc.code())

    @property
    def permanent(self) -> bool:
        return self.code in PERMANENT_CODES


class TrainerStateLost(ServiceCallError):
    """The trainer's optimizer step does not follow on from the last one we saw: it restarted (or someone else
    trained it) and no longer holds the state this coordinator's run state describes."""


def describe_rpc_error(service: str, call: str, exc: grpc.RpcError) -> str:
    hint = " (the limit is services.max_message_mb on both sides)" \
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else ""
    return f"{service} {call} failed: {exc.code().name}: {exc.details()}{hint}"


@dataclass
class ServiceClient:
    name: str
    target: str
    services: ServicesConfig
    channel: grpc.Channel = field(init=False)

    def __post_init__(self) -> None:
        self.channel = open_channel(self.target, max_message_mb=self.services.max_message_mb,
                                    tls_ca=self.services.tls_ca, auth_token=self.services.auth_token)

    def wait_healthy(self, timeout_s: float) -> None:
        wait_healthy(self.target, timeout_s=timeout_s, tls_ca=self.services.tls_ca)

    def call(self, method, request, *, timeout_s: float, what: str,  # type: ignore[no-untyped-def]
             wait_for_ready: bool = False):
        try:
            return method(request, timeout=timeout_s, wait_for_ready=wait_for_ready)
        except grpc.RpcError as exc:
            raise ServiceCallError.from_rpc(self.name, what, exc) from exc

    def close(self) -> None:
        self.channel.close()


class TrainerClient(ServiceClient):
    # The trainer's optimizer step after the last Train or Load (None = not known yet): a reply that does not
    # follow on from it comes from a trainer that lost its state.
    last_step: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.stub = trainer_pb2_grpc.TrainerStub(self.channel)

    def train(self, request: trainer_pb2.TrainRequest, *, timeout_s: float) -> trainer_pb2.TrainResponse:
        # Train is idempotent per rollout_id, so a lost reply can be retried safely.
        for attempt in range(3):
            try:
                reply = self.stub.Train(request, timeout=timeout_s)
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == 2:
                    raise ServiceCallError.from_rpc(self.name, f"Train({request.rollout_id})", exc) from exc
                time.sleep(1.0 + attempt)
        expected = None if self.last_step is None else self.last_step + (1 if reply.samples_trained else 0)
        if not reply.replayed and expected is not None and reply.step != expected:
            raise TrainerStateLost(f"{self.name} answered Train({request.rollout_id}) at optimizer step {reply.step}, "
                                   f"expected {expected}: it restarted and lost its state; restart the coordinator "
                                   "to resume from the last checkpoint")
        self.last_step = reply.step
        return reply


class RolloutClient(ServiceClient):
    def __post_init__(self) -> None:
        super().__post_init__()
        self.stub = rollout_pb2_grpc.RolloutStub(self.channel)


@dataclass(frozen=True)
class GenerationResult:
    rollout_id: int
    entry_ids: tuple[str, ...]
    responses: tuple[rollout_pb2.GenerateResponse, ...]
    seconds: float
    recorded_metrics: dict[str, float] | None = None   # set when reused from a checkpoint


def split_evenly(n: int, parts: int) -> list[range]:
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(range(start, start + size))
        start += size
    return [r for r in out if len(r)]


class RolloutPool:
    """All rollout replicas of a run. A step's prompts are split among them; a replica that fails has its
    share retried on the next replica (up to max_retries times).

    A replica that failed a call may have restarted with its initial weights, so it gets no share until it
    shows the synced weight version again (GetState) or the next weight sync reaches it. A reply generated
    with older weights than were synced when it was asked (a restart nobody saw) is discarded and retried.
    With `wait_for_restarts` (services.max_restarts > 0) broadcasts such as a sync's PrepareWeightSync wait,
    within their deadline, for a replica that is down to come back instead of failing at once."""

    def __init__(self, clients: list[RolloutClient], *, max_retries: int, timeout_s: float,
                 wait_for_restarts: bool = False, discard: Callable[[list[str]], int] | None = None):
        self.clients = clients
        self.max_retries = max_retries
        self.timeout_s = timeout_s
        self.wait_for_restarts = wait_for_restarts
        self.discard = discard            # deletes buffer entries nobody will train
        self.expected_version: int | None = None   # weight version of the last successful sync
        self._suspect: set[int] = set()   # replicas that failed since the last sync
        self._lock = threading.Lock()
        self.executor = ThreadPoolExecutor(max_workers=max(4, 2 * len(clients)), thread_name_prefix="rollout")

    def weights_synced(self, version: int) -> None:
        with self._lock:
            self.expected_version = version
            self._suspect.clear()

    def _usable(self, index: int, expected: int | None) -> bool:
        with self._lock:
            if index not in self._suspect or expected is None:
                return True
        client = self.clients[index]
        try:
            state = client.stub.GetState(common_pb2.Empty(), timeout=5.0)
        except grpc.RpcError:
            return False
        if state.weight_version < expected:
            return False
        with self._lock:
            self._suspect.discard(index)
        return True

    def generate_async(self, *, rollout_id: int, prompts: list[common_pb2.Prompt], n_samples: int,
                       sampling: common_pb2.SamplingParams, trace_context: dict[str, str]) -> Future[GenerationResult]:
        return self.executor.submit(self.generate, rollout_id=rollout_id, prompts=prompts, n_samples=n_samples,
                                    sampling=sampling, trace_context=trace_context)

    def generate(self, *, rollout_id: int, prompts: list[common_pb2.Prompt], n_samples: int,
                 sampling: common_pb2.SamplingParams, trace_context: dict[str, str]) -> GenerationResult:
        start = time.monotonic()
        shares = split_evenly(len(prompts), len(self.clients))
        futures = [self.executor.submit(self._generate_share, replica=i, rollout_id=rollout_id,
                                        prompts=[prompts[j] for j in share], n_samples=n_samples,
                                        sampling=sampling, trace_context=trace_context)
                   for i, share in enumerate(shares)]
        responses = tuple(f.result() for f in futures)
        return GenerationResult(rollout_id=rollout_id, entry_ids=tuple(r.entry_id for r in responses),
                                responses=responses, seconds=time.monotonic() - start)

    def _generate_share(self, *, replica: int, rollout_id: int, prompts: list[common_pb2.Prompt], n_samples: int,
                        sampling: common_pb2.SamplingParams,
                        trace_context: dict[str, str]) -> rollout_pb2.GenerateResponse:
        request = rollout_pb2.GenerateRequest(rollout_id=rollout_id, prompts=prompts, n_samples_per_prompt=n_samples,
                                              sampling=sampling, trace_context=trace_context)
        errors, code = [], None
        expected = self.expected_version
        for attempt in range(self.max_retries + 1):
            index = (replica + attempt) % len(self.clients)
            client = self.clients[index]
            if not self._usable(index, expected):
                errors.append(f"{client.name} skipped: it failed earlier and does not hold weight version {expected}")
                continue
            try:
                reply = client.stub.Generate(request, timeout=self.timeout_s)
            except grpc.RpcError as exc:
                errors.append(describe_rpc_error(client.name, f"Generate({rollout_id})", exc))
                code = exc.code()
                if code not in RETRYABLE:   # e.g. a reward function that raises: another replica would too
                    break
                with self._lock:
                    self._suspect.add(index)
                log.warning("%s; retrying on another replica", errors[-1])
                time.sleep(min(0.5 * (attempt + 1), 2.0))
                continue
            if expected is None or reply.weight_version >= expected:
                return reply
            errors.append(f"{client.name} generated Generate({rollout_id}) with weight version {reply.weight_version}, "
                          f"older than the synced {expected} (it restarted): batch {reply.entry_id} discarded")
            log.warning("%s", errors[-1])
            with self._lock:
                self._suspect.add(index)
            if self.discard is not None:
                self.discard([reply.entry_id])
        raise ServiceCallError("; ".join(errors), code=code)

    def broadcast(self, method_name: str, request, *, timeout_s: float) -> list:  # type: ignore[no-untyped-def]
        """Calls one RPC on every replica concurrently; raises on the first failure."""
        futures = [self.executor.submit(c.call, getattr(c.stub, method_name), request, timeout_s=timeout_s,
                                        what=method_name, wait_for_ready=self.wait_for_restarts) for c in self.clients]
        return [f.result() for f in futures]

    def broadcast_each(self, method_name: str, requests: list, *, timeout_s: float) -> list:  # type: ignore[type-arg]
        """Calls one RPC on every replica concurrently, replica i with requests[i]."""
        futures = [self.executor.submit(c.call, getattr(c.stub, method_name), r, timeout_s=timeout_s,
                                        what=method_name, wait_for_ready=self.wait_for_restarts)
                   for c, r in zip(self.clients, requests)]
        return [f.result() for f in futures]

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        for c in self.clients:
            c.close()


def make_clients(services: ServicesConfig, *, uses_critic: bool) -> tuple[TrainerClient, TrainerClient | None,
                                                                          list[RolloutClient]]:
    def target(addr: ServiceAddress) -> str:
        if addr.port == 0:
            raise ValueError(f"service address {addr.host}:0 has no port: set it in services.* "
                             "(tandem run picks free ports itself)")
        return addr.target

    actor = TrainerClient(name="trainer", target=target(services.trainer), services=services)
    critic = TrainerClient(name="critic", target=target(services.critic), services=services) if uses_critic else None
    rollouts = [RolloutClient(name=f"rollout[{i}]", target=target(a), services=services)
                for i, a in enumerate(services.rollout)]
    return actor, critic, rollouts
