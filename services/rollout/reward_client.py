"""The rollout's gRPC clients of other services: the reward service's Score (reward_calls dataclasses to tandem.v1
messages and back by the one converter, services/contracts/convert.py)."""

from __future__ import annotations

import threading

import grpc

from services.contracts.config import TandemConfig
from services.contracts.convert import from_message, to_message
from services.contracts.gen.tandem.v1 import reward_pb2, reward_pb2_grpc
from services.contracts.reward_calls import ScoreRequest, ScoreResult
from services.rollout.remote_reward import ScoreCallFailed
from services.rpc.grpc_util import open_channel

# a service restarting, or one that did not answer in time: the batcher asks again within reward.max_wait_s
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


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
            message = to_message(request, reward_pb2.ScoreRequest)
            reply = self._reward_stub().Score(message, timeout=timeout_s, wait_for_ready=True)
        except grpc.RpcError as exc:
            code = exc.code()
            raise ScoreCallFailed(
                f"{code.name}: {exc.details()}",
                transient=code in TRANSIENT,
            ) from None
        return from_message(reply, ScoreResult)
