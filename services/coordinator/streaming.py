"""loop.mode streaming: groups stream from the engines to the buffer, and a step trains the first rollout_batch_size
that are done.

Every prompt is its own Generate (one group of n samples, one buffer entry written when all of them are done), sent
to the least busy replica; up to `loop.groups_in_flight` groups are generating or done and waiting, over all
replicas (at most a step's worth waiting), so the engines always have work (with rollout.continuous_batching the
native engine decodes the concurrent groups as one batch) and the buffer never holds more entries than that. A step
takes the groups in the order they finished. Prompts are drawn from the data cursor as they are sent, never past the
run's last step.

The books: every group drawn and not trained is `outstanding` (a checkpoint records it: its place in the data order,
and its entry once done). A resume reuses the recorded entries still buffered and generates every other recorded
group again (the same prompt and group id), and entries no checkpoint recorded are deleted, so a group is trained
once, whether it was half-generated, done or trained after the checkpoint when the run stopped.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Executor
from dataclasses import replace

from services.contracts.config import TandemConfig
from services.contracts.rollout_calls import GenerateRequest, GenerateResult
from services.contracts.sampling_spec import SamplingSpec
from services.coordinator.seams import Clock, GenerationResult, PromptSource, RolloutPoolApi
from services.coordinator.state import StreamGroup
from services.telemetry.tracing import inject_context

log = logging.getLogger(__name__)


class GroupStream:
    def __init__(
        self, *, config: TandemConfig, pool: RolloutPoolApi, data: PromptSource, executor: Executor, clock: Clock
    ):
        self.pool, self.data, self.executor, self.clock = pool, data, executor, clock
        self.n_samples = config.rollout.n_samples_per_prompt
        self.batch_size = config.rollout.rollout_batch_size
        self.limit = config.streaming_groups_in_flight
        self.sampling = SamplingSpec.from_config(config.rollout.sampling)
        self._cv = threading.Condition()
        self._drawn: deque[StreamGroup] = deque()  # not sent yet
        self._running: dict[int, StreamGroup] = {}  # by group id
        self._done: deque[tuple[StreamGroup, GenerateResult]] = deque()  # in the order they finished
        self._failure: BaseException | None = None
        self.needed = 0  # groups the rest of the run trains (set by the loop, counted down by take)

    # ---- the books ------------------------------------------------------------------------------------

    def restore(self, groups: tuple[StreamGroup, ...]) -> None:
        """A resume: recorded groups with an entry (still buffered) wait for a step as they are; the others are
        generated again."""
        again = [g for g in groups if not g.entry_id]
        with self._cv:  # a reused group's counts: its samples (its tokens are in the entry, not read here)
            self._done.extend((g, _reused(g, samples=self.n_samples)) for g in groups if g.entry_id)
            self._drawn.extend(again)
        if groups:
            log.info(
                "resuming %d groups: %d buffered entries reused, %d generated again",
                len(groups),
                len(groups) - len(again),
                len(again),
            )

    def outstanding(self, *, wait: bool = False) -> tuple[StreamGroup, ...]:
        """Every group drawn and not trained, in group id order (`wait`: once none is generating)."""
        with self._cv:
            if wait:
                self._cv.wait_for(lambda: not self._running or self._failure is not None)
            groups = [*self._drawn, *self._running.values(), *(g for g, _ in self._done)]
        return tuple(sorted(groups, key=lambda g: g.group_id))

    # ---- drawing and sending --------------------------------------------------------------------------

    def fill(self) -> None:
        """Draws what the run's remaining steps need, and sends groups while fewer than the limit are out and fewer
        than a step's worth are done and waiting (deeper, the waiting ones would only age: with fast generation
        every group would sit out a whole step more, one version staler)."""
        with self._cv:
            have = len(self._drawn) + len(self._running) + len(self._done)
            while len(self._running) + len(self._done) < self.limit and len(self._done) < self.batch_size:
                if not self._drawn:  # drawn as they are sent: a checkpoint records few groups not sent yet
                    if have >= self.needed:
                        break
                    have += self._draw()
                group = self._drawn.popleft()
                self._running[group.group_id] = group
                self.executor.submit(self._generate, group, inject_context())

    def _draw(self) -> int:
        batch = self.data.next_batch()
        epoch, first = batch.cursor_after.epoch, batch.cursor_after.offset - len(batch.prompts)
        self._drawn.extend(
            StreamGroup(group_id=g, epoch=epoch, offset=first + k) for k, g in enumerate(batch.group_ids)
        )
        return len(batch.prompts)

    def _generate(self, group: StreamGroup, trace_context: dict[str, str]) -> None:
        record = self.data.record_at(group.epoch, group.offset)
        request = GenerateRequest(
            rollout_id=group.group_id,
            n_samples_per_prompt=self.n_samples,
            sampling=self.sampling.params(),
            trace_context=trace_context,
            prompts=(record.to_input(group.group_id),),
        )
        try:
            reply = self.pool.generate_one(request)
        except BaseException as exc:  # noqa: BLE001 - handed to the step waiting for groups
            with self._cv:
                self._failure = self._failure or exc
                self._cv.notify_all()
            return
        with self._cv:
            self._running.pop(group.group_id)
            self._done.append((replace(group, entry_id=reply.entry_id, weight_version=reply.weight_version), reply))
            self._cv.notify_all()

    # ---- a step's groups ------------------------------------------------------------------------------

    def take(self, rollout_id: int) -> GenerationResult:
        """The first rollout_batch_size groups done (waiting for them); more are sent as they leave room."""
        start = self.clock.monotonic()
        taken: list[tuple[StreamGroup, GenerateResult]] = []
        while len(taken) < self.batch_size:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._done) or self._failure is not None)
                if self._failure is not None:
                    raise self._failure
                while self._done and len(taken) < self.batch_size:
                    taken.append(self._done.popleft())
                    self.needed -= 1
            self.fill()
        responses = tuple(reply for _, reply in taken)
        return GenerationResult(
            rollout_id=rollout_id,
            entry_ids=tuple(g.entry_id for g, _ in taken),
            responses=responses,
            seconds=self.clock.monotonic() - start,
        )


def _reused(group: StreamGroup, *, samples: int) -> GenerateResult:
    """What a resume knows of a recorded group's entry: its sample count and version (its tokens are in the entry,
    not read here)."""
    return GenerateResult(
        entry_id=group.entry_id,
        num_samples=samples,
        num_prompt_tokens=0,
        num_response_tokens=0,
        weight_version=group.weight_version,
        generate_time_s=0.0,
        reward_time_s=0.0,
        put_time_s=0.0,
        metrics={},
        producer="",
        num_groups=1,
    )
