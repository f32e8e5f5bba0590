"""`RolloutService`: prompts in, scored samples out to the Redis buffer.

Plain Python (the gRPC servicer in server.py is a thin adapter, tests drive this class directly). It takes its parts
from one builder (builder.build_rollout -> RolloutParts) and sequences them; each job has its module:
  prompts.py          a request's checks, its prompts as the model reads them
  samples.py          the sample source: sampling and scoring (multi_turn.EpisodeSource under an environment)
  batches.py          the scored samples as a rollout batch, and the Generate answer
  recent_calls.py     the retry ledger: a repeated Generate gets the first one's result
  evaluation.py       Evaluate
  weight_receipt.py   pause for a weight update, take part in it
The service keeps no data cursor: every Generate carries its prompts, so a replica can be restarted or replaced
freely.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.contracts.rollout_calls import EvaluateResult, GenerateResult, PromptInput, ReceiveResult
from services.contracts.sampling_spec import SamplingSpec
from services.rollout.batches import generate_result, rollout_batch
from services.rollout.builder import RolloutParts
from services.rollout.engines.interface import EngineState
from services.rollout.evaluation import evaluate
from services.rollout.prompts import check_group_ids, check_request_size, validated_inputs
from services.rollout.samples import SampleRequest, mix_seed
from services.telemetry import tracing

if TYPE_CHECKING:
    from services.contracts.weight_plan import WeightSyncPlan

__all__ = ["CallerGone", "PromptInput", "RolloutService", "ServiceState"]

log = logging.getLogger(__name__)


class CallerGone(TimeoutError):
    """The client's deadline passed or it cancelled: the batch is not written (nobody would train on it)."""


@dataclass(frozen=True)
class ServiceState:
    engine: EngineState
    producer: str


class RolloutService:
    def __init__(self, parts: RolloutParts):
        self.parts = parts
        self.config, self.replica, self.producer = parts.config, parts.replica, parts.producer
        self.engine, self.texts = parts.engine, parts.texts
        self._started = time.monotonic()

    # ---- Generate ----------------------------------------------------------------------------------

    def generate(
        self,
        *,
        rollout_id: int,
        prompts: Sequence[PromptInput],
        n_samples_per_prompt: int | None = None,
        sampling: SamplingSpec | None = None,
        trace_context: dict[str, str] | None = None,
        stream: str | None = None,
        reward: str | None = None,
        caller_active: Callable[[], bool] | None = None,
    ) -> GenerateResult:
        """Samples n per prompt, scores them, writes one batch entry and returns its id and counts. A retry (the
        same stream, rollout id and groups) gets the first call's result."""
        what = f"Generate(rollout_id={rollout_id})"
        if not prompts:
            raise ValueError(f"{what}: no prompts given")
        if rollout_id < 0:
            raise ValueError(f"Generate: rollout_id must be >= 0, got {rollout_id}")
        ro = self.config.rollout
        check_request_size(
            what, len(prompts), n_samples_per_prompt, ro.n_samples_per_prompt, limit=ro.max_request_samples
        )
        check_group_ids(what, prompts)
        n = n_samples_per_prompt or ro.n_samples_per_prompt
        if n < 1:
            raise ValueError(f"n_samples_per_prompt must be >= 1, got {n}")
        stream = stream or self.parts.stream
        return self.parts.recent.run(
            (stream, rollout_id, tuple(p.group_id for p in prompts)),
            lambda: self._generate(
                rollout_id=rollout_id,
                prompts=prompts,
                n=n,
                sampling=sampling or SamplingSpec.from_config(ro.sampling),
                trace_context=trace_context,
                stream=stream,
                reward=reward,
                caller_active=caller_active,
            ),
        )

    def _generate(
        self,
        *,
        rollout_id: int,
        prompts: Sequence[PromptInput],
        n: int,
        sampling: SamplingSpec,
        trace_context: dict[str, str] | None,
        stream: str,
        reward: str | None,
        caller_active: Callable[[], bool] | None,
    ) -> GenerateResult:
        sampling = sampling.with_seed(mix_seed(sampling.seed, rollout_id))
        source, engine = self.parts.source, self.engine
        scorer = source.reward_for(reward)
        inputs = validated_inputs(self.texts, engine, prompts)
        with tracing.span(
            "rl.sample",
            parent=trace_context or None,
            rollout_id=rollout_id,
            weight_version=engine.weight_version,
            prompts=len(prompts),
            samples=len(prompts) * n,
            replica=self.replica,
        ) as sp:
            request = SampleRequest(prompts, inputs, n, sampling, scorer, rollout_id, sp)
            scored = source.sample(request)
            shaped = rollout_batch(
                scored,
                request,
                metadata={
                    "reward": scorer.spec,
                    "engine": engine.name,
                    "n_samples_per_prompt": str(n),
                    "temperature": str(sampling.temperature),
                    **source.metadata(),
                },
                producer=self.producer,
                logprob_space=engine.logprob_space,
                overlong_penalty=self.config.rollout.overlong_penalty,
            )
            if caller_active is not None and not caller_active():
                raise CallerGone(
                    f"Generate(rollout_id={rollout_id}): the caller went away during generation; no batch was written"
                )
            t = time.monotonic()
            entry_id = self.parts.writer.put(shaped.batch, stream=stream, trace_context=tracing.inject_context())
            put_s = time.monotonic() - t
            # weight_version: the version generation actually started with
            tracing.set_attributes(sp, entry_id=entry_id, weight_version=shaped.batch.policy_version)
        return generate_result(
            shaped,
            scored,
            entry_id=entry_id,
            put_s=put_s,
            n=n,
            num_groups=len(prompts),
            min_std=self.config.rollout.dynamic_sampling.min_std,
            producer=self.producer,
        )

    # ---- Evaluate ----------------------------------------------------------------------------------

    def evaluate(
        self,
        *,
        name: str = "eval",
        prompts: Sequence[PromptInput],
        n_samples_per_prompt: int | None = None,
        sampling: SamplingSpec | None = None,
        reward: str | None = None,
        pass_threshold: float = 1.0,
    ) -> EvaluateResult:
        """Greedy (or n-sample) generation over an eval set; metrics under `<name>/` (evaluation.py)."""
        return evaluate(
            self.parts,
            name=name,
            prompts=prompts,
            n_samples_per_prompt=n_samples_per_prompt,
            sampling=sampling,
            reward=reward,
            pass_threshold=pass_threshold,
        )

    # ---- weights, pause, memory, state -------------------------------------------------------------

    def prepare_weight_sync(self, *, version: int, pause_mode: str = "drain") -> tuple[bool, int]:
        """Pauses generation for the update (the coordinator calls Resume afterwards)."""
        return self.parts.weights.prepare(version=version, pause_mode=pause_mode)

    def receive_weights(self, plan: WeightSyncPlan, rank_offset: int) -> ReceiveResult:
        """Takes part in the transfer the trainer announced in `plan`, in place into the engine's weights."""
        plan = self.parts.weights.checked_plan(plan, rank_offset)
        self.parts.recent.clear()  # new weights: a later Generate with a known key is a new request, not a retry
        return self.parts.weights.receive(plan, rank_offset)

    def pause(self, mode: str = "drain") -> None:
        self.engine.pause(mode or "drain", timeout_s=self.config.weights.timeout_s)

    def resume(self) -> None:
        self.engine.resume()

    def release_memory(self, tags: Sequence[str] = ()) -> None:
        self.parts.weights.release()
        self.engine.release_memory(tuple(tags))

    def resume_memory(self, tags: Sequence[str] = ()) -> None:
        self.engine.resume_memory(tuple(tags))

    def get_state(self) -> ServiceState:
        return ServiceState(engine=self.engine.get_state(), producer=self.producer)

    def close(self) -> None:
        busy, up = self.engine.get_state().busy_s, time.monotonic() - self._started
        log.info("engine busy %.1f s of %.1f s since start (%.0f%%)", busy, up, 100 * busy / up if up > 0 else 0.0)
        self.parts.weights.close()
        self.parts.writer.close()
        self.engine.close()
