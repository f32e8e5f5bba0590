"""Starting a step's generation: the prompts come from the data cursor (or a resume reuses the generation the
checkpoint recorded), the rollout pool generates on a thread beside the loop, and with dynamic sampling further
rounds follow on that thread (dynamic.py)."""

from __future__ import annotations

import logging
from concurrent.futures import Executor, Future
from dataclasses import replace
from functools import partial

from services.contracts.config import TandemConfig
from services.contracts.sampling_spec import SamplingSpec
from services.coordinator.data import PromptBatch
from services.coordinator.dynamic import run_rounds
from services.coordinator.seams import Clock, GenerationResult, InFlight, PromptSource, RolloutPoolApi
from services.coordinator.state import GeneratedBatch
from services.telemetry.tracing import StepSpans, inject_context

log = logging.getLogger(__name__)


class Generator:
    def __init__(
        self,
        *,
        config: TandemConfig,
        pool: RolloutPoolApi,
        data: PromptSource,
        executor: Executor,
        spans: StepSpans,
        clock: Clock,
    ):
        self.config, self.pool, self.data, self.executor = config, pool, data, executor
        self.spans, self.clock = spans, clock

    def start(self, rollout_id: int, *, pending: tuple[GeneratedBatch, ...], weight_version: int) -> InFlight:
        """After a resume, a generation recorded in the checkpoint is reused instead of generated again."""
        mode = self.config.loop.mode
        for p in pending:
            if p.rollout_id == rollout_id:
                self.data.cursor = p.cursor_after
                log.info("reusing %d buffered entries of rollout %d from the checkpoint", len(p.entry_ids), rollout_id)
                self.spans.open(rollout_id, weight_version=weight_version, mode=mode, reused=True)
                return _reused(p)
        before = self.data.cursor
        batch = self.data.next_batch()
        # The step's own trace starts here; the generation's thread inherits it, so Generate runs under rl.loop.
        with self.spans.started(rollout_id, weight_version=weight_version, mode=mode):
            generate = partial(
                self._generate,
                rollout_id=rollout_id,
                trace_context=inject_context(),
                sampling=SamplingSpec.from_config(self.config.rollout.sampling),
            )
            dynamic = self.config.rollout.dynamic_sampling
            if dynamic.enabled:  # further rounds draw prompts on the generation thread (dynamic.py says why)
                future = self.executor.submit(
                    run_rounds,
                    rollout_id=rollout_id,
                    first=batch,
                    generate=generate,
                    next_batch=self.data.next_batch,
                    max_rounds=dynamic.max_rounds,
                    target_groups=self.config.rollout.rollout_batch_size,
                    clock=self.clock,
                )
            else:
                future = self.executor.submit(generate, batch)
        return InFlight(rollout_id, future, cursor_before=before, cursor_after=batch.cursor_after)

    def _generate(
        self, batch: PromptBatch, *, rollout_id: int, sampling: SamplingSpec, trace_context: dict[str, str]
    ) -> GenerationResult:
        prompts = [p.to_input(g) for p, g in zip(batch.prompts, batch.group_ids, strict=True)]
        result = self.pool.generate(
            rollout_id=rollout_id,
            prompts=prompts,
            sampling=sampling,
            n_samples=self.config.rollout.n_samples_per_prompt,
            trace_context=trace_context,
        )
        return replace(result, cursor_after=batch.cursor_after, epoch_end=batch.epoch_end)


def _reused(batch: GeneratedBatch) -> InFlight:
    """A generation recorded in the checkpoint whose entries are still buffered: finished already."""
    done: Future[GenerationResult] = Future()
    done.set_result(
        GenerationResult(
            rollout_id=batch.rollout_id,
            entry_ids=batch.entry_ids,
            responses=(),
            seconds=0.0,
            recorded_metrics=batch.metrics,
        )
    )
    return InFlight(batch.rollout_id, done, cursor_before=batch.cursor_before, cursor_after=batch.cursor_after)
