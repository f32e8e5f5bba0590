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

from services.contracts.common_calls import Ack
from services.contracts.rollout_calls import (
    EvaluateRequest,
    EvaluateResult,
    GenerateRequest,
    GenerateResult,
    MemoryRequest,
    PauseRequest,
    PrepareRequest,
    PrepareResult,
    PromptInput,
    ReceiveRequest,
    ReceiveResult,
    RolloutStatus,
)
from services.contracts.sampling_spec import SamplingParams, SamplingSpec
from services.rollout.batches import generate_result, rollout_batch
from services.rollout.builder import RolloutParts
from services.rollout.engines.interface import EngineState
from services.rollout.evaluation import evaluate
from services.rollout.prompts import check_group_ids, check_request_size, validated_inputs
from services.rollout.samples import SampleRequest, mix_seed
from services.telemetry import tracing
from services.tensors.devices import cuda_reserved_bytes

if TYPE_CHECKING:
    from services.contracts.config import SamplingConfig

__all__ = ["CallerGone", "PromptInput", "RolloutService", "ServiceState"]

log = logging.getLogger(__name__)


class CallerGone(TimeoutError):
    """The client's deadline passed or it cancelled: the batch is not written (nobody would train on it)."""


@dataclass(frozen=True)
class ServiceState:
    engine: EngineState
    producer: str


def sampling_of(params: SamplingParams | None, config: SamplingConfig) -> SamplingSpec:
    """A request's sampling, its zeros the config section's (None: the section's)."""
    default = SamplingSpec.from_config(config)
    return default if params is None else SamplingSpec.from_params(params, default=default)


class RolloutService:
    def __init__(self, parts: RolloutParts):
        self.parts = parts
        self.config, self.replica, self.producer = parts.config, parts.replica, parts.producer
        self.engine, self.texts = parts.engine, parts.texts
        self.agents = parts.agents  # the OpenAI-compatible endpoint (services/rollout/agents/), or None
        self._started = time.monotonic()

    # ---- Generate ----------------------------------------------------------------------------------

    def generate(self, request: GenerateRequest, *, caller_active: Callable[[], bool] | None = None) -> GenerateResult:
        """Samples n per prompt, scores them, writes one batch entry and returns its id and counts. A retry (the
        same stream, rollout id and groups) gets the first call's result. `caller_active` says whether the caller
        still waits (a batch nobody would train on is not written)."""
        rollout_id, prompts, n_samples_per_prompt = request.rollout_id, request.prompts, request.n_samples_per_prompt
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
        stream = request.stream or self.parts.stream
        sampling = sampling_of(request.sampling, ro.sampling)
        return self.parts.recent.run(
            (stream, rollout_id, tuple(p.group_id for p in prompts)),
            lambda: self._generate(
                rollout_id=rollout_id,
                prompts=prompts,
                n=n,
                sampling=sampling,
                trace_context=request.trace_context,
                stream=stream,
                reward=request.reward or None,
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

    def evaluate(self, request: EvaluateRequest, *, pass_threshold: float = 1.0) -> EvaluateResult:
        """Greedy (or n-sample) generation over an eval set; metrics under `<name>/` (evaluation.py)."""
        return evaluate(
            self.parts,
            name=request.name or "eval",
            prompts=request.prompts,
            n_samples_per_prompt=request.n_samples_per_prompt or None,
            sampling=sampling_of(request.sampling, self.config.rollout.eval_sampling),
            reward=request.reward or None,
            pass_threshold=pass_threshold,
        )

    # ---- weights, pause, memory, state -------------------------------------------------------------

    def prepare_weight_sync(self, request: PrepareRequest) -> PrepareResult:
        """Pauses generation for the update (the coordinator calls Resume afterwards)."""
        return self.parts.weights.prepare(request)

    def receive_weights(self, request: ReceiveRequest) -> ReceiveResult:
        """Takes part in the transfer the trainer announced in the request's plan, in place into the engine's
        weights."""
        plan = self.parts.weights.checked_plan(request.plan, request.rank_offset)
        self.parts.recent.clear()  # new weights: a later Generate with a known key is a new request, not a retry
        return self.parts.weights.receive(plan, request.rank_offset)

    def pause(self, request: PauseRequest) -> Ack:
        mode = request.mode or "drain"
        self.engine.pause(mode, timeout_s=self.config.weights.timeout_s)
        return Ack(message=f"paused ({mode})")

    def resume(self) -> Ack:
        self.engine.resume()
        return Ack(message="resumed")

    def release_memory(self, request: MemoryRequest) -> Ack:
        self.parts.weights.release()
        self.engine.release_memory(request.tags)
        return Ack(message=f"released {', '.join(request.tags) or 'all'}")

    def resume_memory(self, request: MemoryRequest) -> Ack:
        self.engine.resume_memory(request.tags)
        return Ack(message=f"resumed {', '.join(request.tags) or 'all'}")

    def get_state(self) -> ServiceState:
        return ServiceState(engine=self.engine.get_state(), producer=self.producer)

    def status(self) -> RolloutStatus:
        """GetState's answer."""
        e = self.engine.get_state()
        return RolloutStatus(
            engine=e.engine,
            model_path=e.model_path,
            weight_version=e.weight_version,
            paused=e.paused,
            memory_released=bool(e.released_memory),
            generated_samples=e.generated_samples,
            device=e.device,
            producer=self.producer,
            in_flight=e.in_flight,
            gpu_memory_reserved_bytes=cuda_reserved_bytes(),
            gpu_memory_freed_bytes=e.memory_freed_bytes,
            engine_busy_s=e.busy_s,
        )

    def close(self) -> None:
        if self.agents is not None:
            self.agents.close()
        busy, up = self.engine.get_state().busy_s, time.monotonic() - self._started
        log.info("engine busy %.1f s of %.1f s since start (%.0f%%)", busy, up, 100 * busy / up if up > 0 else 0.0)
        self.parts.weights.close()
        self.parts.writer.close()
        self.engine.close()
