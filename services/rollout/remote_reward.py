"""Scores from the reward service (`service:NAME` in rollout.reward): `RemoteReward`, over one `ScoreBatcher` per
model and replica.

The batcher is what makes scoring overlap generation: every Generate call hands its samples over as soon as its
groups are done (in loop.mode streaming one group per call, so the groups that finish first are scored while the
engine still decodes the others), and the batcher's senders pack the samples waiting, from any number of calls, into
Score calls of at most `reward.max_batch_tokens` tokens, `reward.max_calls_in_flight` of them at once. Each call is a
span (`rl.reward_call`, linked to the Generate calls it serves) with the time its samples queued.

A reward service that is down or slow (UNAVAILABLE, DEADLINE_EXCEEDED of a call of `reward.call_timeout_s`) is asked
again until `reward.max_wait_s` has passed since the samples were handed over; then the Generate fails with
RewardUnavailable naming the service (UNAVAILABLE: the coordinator retries it, and the run fails naming it when the
retries run out). Scores are only ever attached to the samples they were computed for, and a batch is written only
once every sample has its score: no sample is trained without its reward, and none is lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from services.contracts.chat_messages import ChatMessage
from services.contracts.reward_calls import RewardSample, ScoreRequest, ScoreResult
from services.contracts.reward_config import RewardServiceConfig
from services.contracts.untyped import JsonValue
from services.rollout.rewards import DetailedReward, RewardError, RewardScores, RewardUnavailable
from services.telemetry import tracing

log = logging.getLogger(__name__)


VERDICT_CHARS = 400  # of a call's first verdicts kept on its span


class ScoreCallFailed(Exception):
    """A Score call failed. `transient`: the service is down or slow (worth asking again)."""

    def __init__(self, message: str, *, transient: bool):
        super().__init__(message)
        self.transient = transient


class ScoreClient(Protocol):
    """The reward service's Score call (rollout/reward_client.py; tests use fakes of it)."""

    @property
    def target(self) -> str: ...

    def score(self, request: ScoreRequest, *, timeout_s: float) -> ScoreResult:
        """Raises ScoreCallFailed."""


@dataclass(frozen=True)
class SampleScore:
    score: float
    sub_scores: dict[str, float]
    parse_failed: bool
    queue_s: float  # from hand-over to the call that scored it
    call_s: float  # that call's round trip (retries included)


@dataclass
class _Pending:
    sample: RewardSample
    tokens: int
    future: Future[SampleScore]
    carrier: dict[str, str]
    handed_over: float = field(default_factory=time.monotonic)


class ScoreBatcher:
    """Packs the samples handed over by concurrent callers into Score calls for one model (module docstring)."""

    RETRY_PAUSE_S = 0.25  # between two tries of a service that is down (its restart takes seconds)

    def __init__(self, client: ScoreClient, model: str, config: RewardServiceConfig):
        self.client, self.model, self.config = client, model, config
        self._waiting: deque[_Pending] = deque()  # in hand-over order
        self._ready = threading.Condition()
        self._started = False

    def submit(self, samples: Sequence[RewardSample], tokens: Sequence[int]) -> list[Future[SampleScore]]:
        carrier = tracing.inject_context()
        items = [_Pending(s, max(1, t), Future(), carrier) for s, t in zip(samples, tokens, strict=True)]
        with self._ready:
            if not self._started:
                self._started = True
                for i in range(self.config.max_calls_in_flight):
                    name = f"reward {self.model} sender {i}"
                    threading.Thread(target=self._send_forever, name=name, daemon=True).start()
            self._waiting.extend(items)
            self._ready.notify_all()
        return [i.future for i in items]

    def _take(self) -> list[_Pending]:
        """The oldest waiting samples, in order, while the call stays within max_batch_tokens (at least one)."""
        with self._ready:
            self._ready.wait_for(lambda: bool(self._waiting))
            batch = [self._waiting.popleft()]
            budget = self.config.max_batch_tokens - batch[0].tokens
            while self._waiting and self._waiting[0].tokens <= budget:
                budget -= self._waiting[0].tokens
                batch.append(self._waiting.popleft())
            return batch

    def _send_forever(self) -> None:
        while True:
            batch = self._take()
            try:
                self._send(batch)
            except BaseException as exc:  # noqa: BLE001 - every caller waiting on this batch hears of it
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(exc)

    def _send(self, batch: list[_Pending]) -> None:
        sent = time.monotonic()
        queue_s = [sent - i.handed_over for i in batch]
        tokens = sum(i.tokens for i in batch)
        with tracing.span(
            "rl.reward_call",
            parent=batch[0].carrier,
            links_from=[i.carrier for i in batch],
            model=self.model,
            service=self.client.target,
            samples=len(batch),
            tokens=tokens,
            queue_s=max(queue_s),
        ) as sp:
            result, attempts = self._call_within_deadline(batch)
            # a judge's first verdicts, as it wrote them: what a parse failure or an odd score looked like
            verdicts = " | ".join(result.verdicts[:4])[:VERDICT_CHARS] or None
            tracing.set_attributes(sp, attempts=attempts, parse_failures=result.parse_failures, verdicts=verdicts)
        call_s = time.monotonic() - sent
        for k, item in enumerate(batch):
            item.future.set_result(
                SampleScore(
                    score=result.scores[k],
                    sub_scores={name: sub.values[k] for name, sub in result.sub_scores.items()},
                    parse_failed=bool(result.parse_failed and result.parse_failed[k]),
                    queue_s=queue_s[k],
                    call_s=call_s,
                )
            )

    def _call_within_deadline(self, batch: list[_Pending]) -> tuple[ScoreResult, int]:
        request = ScoreRequest(
            model=self.model, samples=tuple(i.sample for i in batch), trace_context=tracing.inject_context()
        )
        deadline = min(i.handed_over for i in batch) + self.config.max_wait_s
        attempts = 0
        while True:
            attempts += 1
            left = deadline - time.monotonic()
            try:
                result = self.client.score(request, timeout_s=max(0.1, min(self.config.call_timeout_s, left)))
            except ScoreCallFailed as exc:
                if not exc.transient:
                    raise RewardError(
                        f"the reward service at {self.client.target} refused Score({self.model}): {exc}",
                        hint="check reward.models and the reward service's log",
                    ) from None
                if time.monotonic() + self.RETRY_PAUSE_S >= deadline:
                    raise RewardUnavailable(
                        f"the reward service at {self.client.target} (model {self.model}) did not score "
                        f"{len(batch)} samples within reward.max_wait_s ({self.config.max_wait_s:g}s, "
                        f"{attempts} tries): {exc}"
                    ) from None
                log.warning("reward service %s: %s; asking again (try %d)", self.client.target, exc, attempts + 1)
                time.sleep(self.RETRY_PAUSE_S)
                continue
            if len(result.scores) != len(batch):
                raise RewardError(
                    f"the reward service at {self.client.target} returned {len(result.scores)} scores for "
                    f"{len(batch)} samples of Score({self.model})"
                )
            return result, attempts


def messages_of(metadata: Mapping[str, str]) -> tuple[ChatMessage, ...]:
    """A chat prompt's messages, as reward_metadata carries them (JSON under `messages`)."""
    import json

    text = metadata.get("messages")
    if not text:
        return ()
    try:
        rows: JsonValue = json.loads(text)
    except ValueError:
        return ()
    if not isinstance(rows, list):
        return ()
    return tuple(
        ChatMessage(role=str(r.get("role", "")), content=str(r.get("content", ""))) for r in rows if isinstance(r, dict)
    )


@dataclass(frozen=True)
class RemoteReward(DetailedReward):
    """A model of the reward service as a reward (rewards.Reward)."""

    spec: str
    name: str  # the metric name of the term (the model's)
    batcher: ScoreBatcher
    wait_s: float  # a caller gives up on its futures after this (the batcher's own deadline comes first)

    def score_detailed(
        self,
        *,
        prompts: Sequence[str],
        responses: Sequence[str],
        labels: Sequence[str],
        metadatas: Sequence[dict[str, str]],
        timeout_s: float | None = None,
        tokens: Sequence[int] | None = None,
    ) -> RewardScores:
        """`timeout_s` (rollout.reward_timeout_s) is a rule reward's: the service's deadlines are reward.*."""
        samples = [
            RewardSample(
                prompt=p,
                response=r,
                label=lb,
                messages=messages_of(m),
                metadata={k: v for k, v in m.items() if k != "messages"},
            )
            for p, r, lb, m in zip(prompts, responses, labels, metadatas, strict=True)
        ]
        if not samples:
            return RewardScores(values=[])
        sizes = (
            tokens
            if tokens is not None
            else [(len(p) + len(r)) // 4 + 1 for p, r in zip(prompts, responses, strict=True)]
        )
        futures = self.batcher.submit(samples, sizes)
        results = [f.result(timeout=self.wait_s) for f in futures]
        return RewardScores(values=[r.score for r in results], metrics=remote_metrics(self.name, results))


def remote_metrics(name: str, results: Sequence[SampleScore]) -> dict[str, float]:
    n = len(results)
    out = {
        f"reward/{name}/mean": sum(r.score for r in results) / n,
        f"reward/{name}/parse_failure_frac": sum(r.parse_failed for r in results) / n,
        f"reward/{name}/queue_s": max(r.queue_s for r in results),
        f"reward/{name}/call_s": max(r.call_s for r in results),
    }
    for sub in results[0].sub_scores:
        out[f"reward/{name}/{sub}"] = sum(r.sub_scores.get(sub, 0.0) for r in results) / n
    return out
