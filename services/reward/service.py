"""`RewardService`: a batch of samples in, a score per sample out, from the model the request names.

Plain Python over RewardParts (server.py is the gRPC adapter; tests drive this class over fakes of the models).
Each model scores one batch at a time: concurrent calls for one model queue for it (the time they wait is the
answer's queue_s), calls for different models run side by side."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from services.contracts.reward_calls import RewardModelState, RewardState, ScoreRequest, ScoreResult
from services.reward.builder import RewardParts
from services.telemetry import tracing


class RewardService:
    def __init__(self, parts: RewardParts):
        self.parts = parts
        self._locks = {name: threading.Lock() for name in parts.models}
        self._scored = dict.fromkeys(parts.models, 0)
        self._failures = dict.fromkeys(parts.models, 0)
        self._books = threading.Lock()

    def score(self, request: ScoreRequest) -> ScoreResult:
        model = self.parts.models.get(request.model)
        if model is None:
            served = ", ".join(sorted(self.parts.models)) or "none"
            raise KeyError(f"Score: no reward model named {request.model!r} (served: {served})")
        n = len(request.samples)
        if n == 0:
            raise ValueError(f"Score({request.model}): no samples given")
        if n > self.parts.max_request_samples:
            raise ValueError(
                f"Score({request.model}): {n} samples, more than rollout.max_request_samples "
                f"({self.parts.max_request_samples})"
            )
        arrived = time.monotonic()
        with tracing.span(
            "rl.reward_model", parent=request.trace_context or None, model=request.model, samples=n, type=model.type
        ) as sp:
            with self._locks[request.model]:
                started = time.monotonic()
                result = model.score(request.samples)
                done = time.monotonic()
            if len(result.scores) != n:
                raise RuntimeError(f"reward model {request.model} returned {len(result.scores)} scores for {n} samples")
            tracing.set_attributes(
                sp, queue_s=started - arrived, tokens=result.tokens, parse_failures=result.parse_failures
            )
        with self._books:
            self._scored[request.model] += n
            self._failures[request.model] += result.parse_failures
        return replace(result, time_s=done - started, queue_s=started - arrived)

    def get_state(self) -> RewardState:
        with self._books:
            return RewardState(
                models=tuple(
                    RewardModelState(
                        name=name,
                        type=m.type,
                        path=m.path,
                        samples_scored=self._scored[name],
                        parse_failures=self._failures[name],
                    )
                    for name, m in self.parts.models.items()
                ),
                device=self.parts.device,
            )
