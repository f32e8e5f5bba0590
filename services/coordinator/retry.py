"""The one retry policy of every call the coordinator repeats: Train on a trainer that is restarting, a replica's
share of Generate on the next replica."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from services.coordinator.call_errors import ServiceCallError
from services.coordinator.seams import Clock

log = logging.getLogger(__name__)

T = TypeVar("T")

# A replica that failed with one of these may succeed on the next try (or another replica may).
TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
    }
)


@dataclass(frozen=True)
class RetryPolicy:
    """`attempts` tries in all; after the n-th failure a pause of min(n * backoff_s, max_backoff_s). Only a
    ServiceCallError whose status is in `retryable` is tried again, and no new try starts once `deadline_s`
    has passed since the first began (None: the attempts alone bound it)."""

    attempts: int = 1
    backoff_s: float = 0.0
    max_backoff_s: float = 0.0
    retryable: frozenset[grpc.StatusCode] = frozenset()
    deadline_s: float | None = None

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("RetryPolicy backoffs must be >= 0")

    def pause_s(self, failures: int) -> float:
        return min(self.backoff_s * failures, self.max_backoff_s)

    def retries(self, code: grpc.StatusCode | None, *, failures: int, elapsed_s: float) -> bool:
        """Whether a call that has failed `failures` times, the last with `code`, gets another try."""
        return (
            code in self.retryable
            and failures < self.attempts
            and (self.deadline_s is None or elapsed_s < self.deadline_s)
        )

    def call(self, fn: Callable[[], T], *, clock: Clock) -> T:
        start = clock.monotonic()
        failures = 0
        while True:
            try:
                return fn()
            except ServiceCallError as exc:
                failures += 1
                if not self.retries(exc.code, failures=failures, elapsed_s=clock.monotonic() - start):
                    raise
                log.warning("%s; trying again (%d of %d)", exc, failures + 1, self.attempts)
                clock.sleep(self.pause_s(failures))


# Train is idempotent per rollout_id (a lost reply is replayed), so a trainer that is restarting is simply asked again.
TRAIN_RETRY = RetryPolicy(
    attempts=3, backoff_s=1.0, max_backoff_s=2.0, retryable=frozenset({grpc.StatusCode.UNAVAILABLE})
)


def generate_retry(max_retries: int) -> RetryPolicy:
    """A replica's share of Generate: loop.max_retries more tries, each on the next replica."""
    return RetryPolicy(attempts=max_retries + 1, backoff_s=0.5, max_backoff_s=2.0, retryable=TRANSIENT_CODES)


NO_RETRY = RetryPolicy()
