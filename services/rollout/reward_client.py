"""The rollout's gRPC clients of other services: the reward service's Score (the one place the rollout turns
reward_calls dataclasses into tandem.v1 messages and back)."""

from __future__ import annotations

import threading

import grpc

from services.contracts.config import TandemConfig
from services.contracts.gen.tandem.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from services.contracts.reward_calls import ScoreRequest, ScoreResult
from services.rollout.remote_reward import ScoreCallFailed
from services.rpc.grpc_util import open_channel

# a service restarting, or one that did not answer in time: the batcher asks again within reward.max_wait_s
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def request_to_proto(request: ScoreRequest) -> reward_pb2.ScoreRequest:
    return reward_pb2.ScoreRequest(
        model=request.model,
        samples=[
            reward_pb2.RewardSample(
                prompt=s.prompt,
                messages=[common_pb2.ChatMessage(role=m.role, content=m.content) for m in s.messages],
                response=s.response,
                label=s.label,
                metadata=s.metadata,
            )
            for s in request.samples
        ],
        trace_context=request.trace_context,
    )


def result_from_proto(r: reward_pb2.ScoreResponse) -> ScoreResult:
    return ScoreResult(
        scores=tuple(r.scores),
        sub_scores={k: tuple(v.values) for k, v in r.sub_scores.items()},
        verdicts=tuple(r.verdicts),
        parse_failed=tuple(r.parse_failed),
        time_s=r.time_s,
        queue_s=r.queue_s,
        tokens=r.tokens,
    )


class RewardClient:
    """The reward service at services.reward, over one channel (opened on first use)."""

    def __init__(self, config: TandemConfig):
        s = config.services
        self.target = s.reward.target
        self._open = lambda: open_channel(
            self.target, max_message_mb=s.max_message_mb, tls_ca=s.tls_ca, auth_token=s.auth_token
        )
        self._stub: reward_pb2_grpc.RewardStub | None = None
        self._lock = threading.Lock()

    def _reward_stub(self) -> reward_pb2_grpc.RewardStub:
        with self._lock:
            if self._stub is None:
                self._stub = reward_pb2_grpc.RewardStub(self._open())
            return self._stub

    def score(self, request: ScoreRequest, *, timeout_s: float) -> ScoreResult:
        try:
            # wait_for_ready: a service restarting is waited for (within the deadline) rather than failed at once
            reply = self._reward_stub().Score(request_to_proto(request), timeout=timeout_s, wait_for_ready=True)
        except grpc.RpcError as exc:
            code = exc.code()
            raise ScoreCallFailed(
                f"{code.name}: {exc.details()}",
                transient=code in TRANSIENT,
            ) from None
        return result_from_proto(reply)
