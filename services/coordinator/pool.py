"""All rollout replicas of a run: a step's prompts split among them, a failed share retried on the next replica,
control calls made on every replica at once."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from services.contracts.rollout_calls import (
    EvaluateRequest,
    GenerateRequest,
    GenerateResult,
    PrepareResult,
    PromptInput,
)
from services.contracts.sampling_spec import SamplingSpec
from services.coordinator.call_errors import ServiceCallError
from services.coordinator.retry import NO_RETRY, RetryPolicy
from services.coordinator.seams import Clock, GenerationResult, RolloutApi, SystemClock
from services.coordinator.stepmetrics import weighted_mean

log = logging.getLogger(__name__)

T = TypeVar("T")


def split_evenly(n: int, parts: int) -> list[range]:
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(range(start, start + size))
        start += size
    return [r for r in out if len(r)]


class RolloutPool:
    """A step's prompts are split among the replicas; a replica that fails has its share retried on the next
    replica, as `retry` allows (loop.max_retries).

    A replica that failed a call may have restarted with its initial weights, so it gets no share until it
    shows the synced weight version again (GetState) or the next weight sync reaches it. A reply generated
    with older weights than were synced when it was asked (a restart nobody saw) is discarded and retried."""

    def __init__(
        self,
        replicas: Sequence[RolloutApi],
        *,
        retry: RetryPolicy = NO_RETRY,
        discard: Callable[[list[str]], int] | None = None,
        clock: Clock | None = None,
    ):
        self.replicas = list(replicas)
        self.retry = retry
        self.discard = discard  # deletes buffer entries nobody will train
        self.clock = clock or SystemClock()
        self.expected_version: int | None = None  # weight version of the last successful sync
        self._suspect: set[int] = set()  # replicas that failed since the last sync
        self._busy = [0] * len(self.replicas)  # generate_one calls in flight per replica
        self._lock = threading.Lock()
        self.executor = ThreadPoolExecutor(max_workers=max(4, 2 * len(self.replicas)), thread_name_prefix="rollout")

    @property
    def size(self) -> int:
        return len(self.replicas)

    # ---- every replica at once ------------------------------------------------------------------------

    def each(self, call: Callable[[RolloutApi], T]) -> list[T]:
        """`call` on every replica concurrently; raises the first failure."""
        futures = [self.executor.submit(call, r) for r in self.replicas]
        return [f.result() for f in futures]

    def wait_healthy(self, timeout_s: float) -> None:
        for replica in self.replicas:
            replica.wait_healthy(timeout_s)

    def prepare_weight_sync(self, *, version: int, pause_mode: str) -> list[PrepareResult]:
        return self.each(lambda r: r.prepare_weight_sync(version=version, pause_mode=pause_mode))

    def resume(self) -> None:
        self.each(lambda r: r.resume())

    def release_memory(self) -> None:
        self.each(lambda r: r.release_memory(()))  # no tags: everything

    def resume_memory(self, tags: Sequence[str]) -> None:
        self.each(lambda r: r.resume_memory(tags))

    def gpu_memory(self) -> tuple[int, int]:
        """(GPU bytes the replicas hold, GPU bytes their last ReleaseMemory gave back), summed over replicas."""
        states = self.each(lambda r: r.get_state())
        return sum(s.gpu_memory_reserved_bytes for s in states), sum(s.gpu_memory_freed_bytes for s in states)

    def evaluate(self, prompts: list[PromptInput], *, n_samples: int, sampling: SamplingSpec) -> dict[str, float]:
        """Every replica evaluates a share of the prompts; their metrics are averaged, weighted by share."""
        shares = [prompts[i :: self.size] for i in range(self.size)]
        futures = [
            self.executor.submit(
                r.evaluate,
                EvaluateRequest(
                    name="eval", prompts=tuple(share), n_samples_per_prompt=n_samples, sampling=sampling.params()
                ),
            )
            for r, share in zip(self.replicas, shares, strict=True)
        ]
        return weighted_mean([dict(f.result().metrics) for f in futures], [len(s) for s in shares])

    def weights_synced(self, version: int) -> None:
        with self._lock:
            self.expected_version = version
            self._suspect.clear()

    # ---- generation -------------------------------------------------------------------------------------

    def generate(
        self,
        *,
        rollout_id: int,
        prompts: list[PromptInput],
        n_samples: int,
        sampling: SamplingSpec,
        trace_context: dict[str, str],
    ) -> GenerationResult:
        start = self.clock.monotonic()
        shares = split_evenly(len(prompts), self.size)
        futures = [
            self.executor.submit(
                self._generate_share,
                first=i,
                request=GenerateRequest(
                    rollout_id=rollout_id,
                    prompts=tuple(prompts[j] for j in share),
                    n_samples_per_prompt=n_samples,
                    sampling=sampling.params(),
                    trace_context=trace_context,
                ),
            )
            for i, share in enumerate(shares)
        ]
        responses = tuple(f.result() for f in futures)
        return GenerationResult(
            rollout_id=rollout_id,
            entry_ids=tuple(r.entry_id for r in responses),
            responses=responses,
            seconds=self.clock.monotonic() - start,
        )

    def generate_one(self, request: GenerateRequest) -> GenerateResult:
        """One Generate (loop.mode streaming: one group) on the replica with the fewest of these in flight."""
        with self._lock:
            first = min(range(self.size), key=lambda i: (self._busy[i], i))
            self._busy[first] += 1
        try:
            return self._generate_share(first=first, request=request)
        finally:
            with self._lock:
                self._busy[first] -= 1

    def _generate_share(self, *, first: int, request: GenerateRequest) -> GenerateResult:
        errors: list[str] = []
        last: ServiceCallError | None = None
        expected = self.expected_version
        start = self.clock.monotonic()
        for attempt in range(self.retry.attempts):
            index = (first + attempt) % self.size
            replica = self.replicas[index]
            if not self._usable(index, expected):
                errors.append(f"{replica.name} skipped: it failed earlier and does not hold weight version {expected}")
                continue
            try:
                reply = replica.generate(request)
            except ServiceCallError as exc:
                errors.append(str(exc))
                last = exc
                code = exc.code
                if code not in self.retry.retryable:  # e.g. a reward function that raises: another replica would too
                    break
                self._suspect_of(index)
                if not self.retry.retries(code, failures=attempt + 1, elapsed_s=self.clock.monotonic() - start):
                    break
                log.warning("%s; retrying on another replica", errors[-1])
                self.clock.sleep(self.retry.pause_s(attempt + 1))
                continue
            if expected is None or reply.weight_version >= expected:
                return reply
            errors.append(
                f"{replica.name} generated Generate({request.rollout_id}) with weight version "
                f"{reply.weight_version}, older than the synced {expected} (it restarted): batch "
                f"{reply.entry_id} discarded"
            )
            log.warning("%s", errors[-1])
            self._suspect_of(index)
            if self.discard is not None:
                self.discard([reply.entry_id])
        if last is not None and errors == [str(last)]:
            raise last  # the one answer, with its service, call, details and hint
        raise ServiceCallError(
            "; ".join(errors),
            code=last.code if last else None,
            service=last.service if last else "",
            call=last.call if last else "",
            hint=last.hint if last else "",
        )

    def _suspect_of(self, index: int) -> None:
        with self._lock:
            self._suspect.add(index)

    def _usable(self, index: int, expected: int | None) -> bool:
        with self._lock:
            if index not in self._suspect or expected is None:
                return True
        try:
            state = self.replicas[index].probe()
        except ServiceCallError:
            return False
        if state.weight_version < expected:
            return False
        with self._lock:
            self._suspect.discard(index)
        return True

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        for replica in self.replicas:
            replica.close()
