"""`RolloutService`: prompts in, scored samples out to the Redis buffer.

Plain Python (the gRPC servicer in server.py is a thin adapter, tests drive this class directly). The
service keeps no data cursor: every Generate carries its prompts, so a replica can be restarted or
replaced freely. A Generate repeated with the same rollout id and prompts (a client retry) returns the
recorded result instead of writing a second batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.buffer.stream import stream_key
from services.contracts import runfacts
from services.contracts.config import TandemConfig
from services.contracts.dapo import informative_groups
from services.contracts.rollout_calls import EvaluateResult, GenerateResult, PromptInput, ReceiveResult
from services.contracts.sampling_spec import SamplingSpec, prompt_max_new_tokens
from services.contracts.wire import build_batch
from services.rollout.chat_template import ChatTemplate, ChatTemplateError
from services.rollout.engines.engine_errors import EngineUnavailable
from services.rollout.engines.engine_registry import engine_kind
from services.rollout.engines.interface import (
    FINISH_ABORT,
    Engine,
    EngineState,
    SampleOutput,
)
from services.rollout.environment_registry import resolve_environment
from services.rollout.environments import EpisodeSample
from services.rollout.metrics import batch_metrics, eval_metrics, shaped_rewards
from services.rollout.multi_turn import MultiTurnRollout, episode_metrics
from services.rollout.rewards import RewardFunction, resolve_reward
from services.rollout.tokenizer import Texts, end_of_generation_ids, load_tokenizer
from services.rollout.writer import BatchWriter
from services.rpc.grpc_util import FailedPrecondition
from services.telemetry import tracing
from services.tensors.devices import cuda_peak_metrics, limit_cpu_threads

if TYPE_CHECKING:
    import redis
    from opentelemetry import trace
    from transformers import PreTrainedTokenizerBase

    from services.contracts.weight_plan import WeightSyncPlan
    from services.weights.front_ends import WeightReceiver

log = logging.getLogger(__name__)

_RECENT_RESULTS = 32


class CallerGone(TimeoutError):
    """The client's deadline passed or it cancelled: the batch is not written (nobody would train on it)."""


@dataclass(frozen=True)
class ModelInputs:
    """Prompts as the model reads them: token ids, and text (a chat's as the template rendered it)."""

    ids: list[list[int]]
    texts: list[str]


@dataclass(frozen=True)
class ServiceState:
    engine: EngineState
    producer: str


@dataclass(frozen=True)
class _Scored:
    prompt_ids: list[list[int]]
    outputs: list[SampleOutput]
    rewards: list[float]
    responses: list[str]
    generate_s: float
    reward_s: float
    loss_masks: list[list[int]] | None = None  # None: every response token is the policy's
    metrics: dict[str, float] = field(default_factory=dict)


def build_engine(config: TandemConfig, texts: Texts | None = None) -> Engine:
    """The configured engine; it ends samples on every id of `end_of_generation_ids` (generation config, config and
    the tokenizer of `texts`), and the native one matches stop strings with `texts` (SGLang with its own copy of the
    tokenizer)."""
    eos = end_of_generation_ids(config.model.path, texts.tokenizer if texts is not None else None)
    return engine_kind(config.rollout.engine).build(config, eos, texts)


def check_request_size(what: str, prompts: int, n: int | None, default: int, *, limit: int) -> None:
    """Refuses a request before any work: its samples are allocated at once, so a huge one is an outage."""
    total = prompts * (n or default)
    if total > limit:
        raise ValueError(
            f"{what}: {prompts} prompts x {n or default} samples = {total} samples, more than "
            f"rollout.max_request_samples ({limit})"
        )


def mix_seed(seed: int | None, rollout_id: int) -> int | None:
    """A per-step seed, so a fixed config seed does not replay one random stream every step."""
    if seed is None:
        return None
    return (seed * 1_000_003 + rollout_id * 7_919 + 1) & 0x7FFF_FFFF_FFFF_FFFF


class RolloutService:
    def __init__(
        self,
        config: TandemConfig,
        *,
        replica: int = 0,
        engine: Engine | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        redis_client: redis.Redis | None = None,
    ):
        self.config = config
        self.replica = replica
        self.producer = f"rollout-{replica}"
        self._started = time.monotonic()
        self.default_reward = resolve_reward(config.rollout.reward)  # a bad spec fails the start
        self.environment = resolve_environment(config.rollout.environment) if config.rollout.environment else None
        tokenizer = (
            tokenizer if tokenizer is not None else load_tokenizer(config.model.tokenizer_path or config.model.path)
        )
        self.texts = Texts(tokenizer, ChatTemplate.from_config(tokenizer, config))
        started = time.monotonic()
        self.engine = engine if engine is not None else build_engine(config, self.texts)
        log.info("startup: %s engine ready in %.2fs", self.engine.name, time.monotonic() - started)
        if self.engine.compute_device is not None:
            limit_cpu_threads(config.rollout.cpu_threads, self.engine.compute_device)
        self.stream = stream_key(config.redis.stream_prefix, config.run_name)
        self.groups = ("actor", "critic") if config.algorithm.uses_critic else ("actor",)
        self.writer = BatchWriter(config, producer=self.producer, groups=self.groups, client=redis_client)
        self._receiver: WeightReceiver | None = None  # made on the first weight sync
        self._lock = threading.Lock()
        self._recent: OrderedDict[tuple[Any, ...], Future[GenerateResult]] = OrderedDict()

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
        """Samples n per prompt, scores them, writes one batch entry and returns its id and counts."""
        if not prompts:
            raise ValueError(f"Generate(rollout_id={rollout_id}): no prompts given")
        if rollout_id < 0:
            raise ValueError(f"Generate: rollout_id must be >= 0, got {rollout_id}")
        check_request_size(
            f"Generate(rollout_id={rollout_id})",
            len(prompts),
            n_samples_per_prompt,
            self.config.rollout.n_samples_per_prompt,
            limit=self.config.rollout.max_request_samples,
        )
        group_ids = [p.group_id for p in prompts]
        if len(set(group_ids)) != len(group_ids):
            dup = next(g for g in group_ids if group_ids.count(g) > 1)
            raise ValueError(
                f"Generate(rollout_id={rollout_id}): several prompts share group_id {dup}; "
                "each prompt needs its own group id"
            )
        key = (stream or self.stream, rollout_id, tuple(group_ids))
        while True:
            with self._lock:
                earlier = self._recent.get(key)
                if earlier is None or (earlier.done() and earlier.exception() is not None):
                    mine: Future[GenerateResult] = Future()
                    self._recent[key] = mine
                    while len(self._recent) > _RECENT_RESULTS:
                        self._recent.popitem(last=False)
                    break
            try:
                return earlier.result()  # a retry of a call in flight or done: same entry
            except Exception:  # noqa: BLE001 - that attempt failed; compute afresh
                continue
        try:
            result = self._generate(
                rollout_id=rollout_id,
                prompts=prompts,
                n=n_samples_per_prompt,
                sampling=sampling,
                trace_context=trace_context,
                stream=stream or self.stream,
                reward=reward,
                caller_active=caller_active,
            )
        except BaseException as exc:
            mine.set_exception(exc)
            raise
        mine.set_result(result)
        return result

    def _generate(
        self,
        *,
        rollout_id: int,
        prompts: Sequence[PromptInput],
        n: int | None,
        sampling: SamplingSpec | None,
        trace_context: dict[str, str] | None,
        stream: str,
        reward: str | None,
        caller_active: Callable[[], bool] | None,
    ) -> GenerateResult:
        ro = self.config.rollout
        n = n or ro.n_samples_per_prompt
        if n < 1:
            raise ValueError(f"n_samples_per_prompt must be >= 1, got {n}")
        if sampling is None:
            sampling = SamplingSpec.from_config(ro.sampling)
        sampling = sampling.with_seed(mix_seed(sampling.seed, rollout_id))
        reward_fn = self._reward_fn(reward)
        inputs = self.model_inputs(prompts)
        version = self.engine.weight_version
        with tracing.span(
            "rl.sample",
            parent=trace_context or None,
            rollout_id=rollout_id,
            weight_version=version,
            prompts=len(prompts),
            samples=len(prompts) * n,
            replica=self.replica,
        ) as sp:
            scored = self._sample_and_score(
                prompts=prompts,
                inputs=inputs,
                n=n,
                sampling=sampling,
                reward_fn=reward_fn,
                rollout_id=rollout_id,
                span_=sp,
            )
            rewards, shaping = shaped_rewards(
                scored.outputs, scored.rewards, ro.overlong_penalty, max_new_tokens=sampling.max_new_tokens
            )
            batch = build_batch(
                rollout_id=rollout_id,
                policy_version=min(o.weight_version for o in scored.outputs),
                prompts=scored.prompt_ids,
                responses=[list(o.token_ids) for o in scored.outputs],
                log_probs=[list(o.log_probs) for o in scored.outputs],
                rewards=rewards,
                group_ids=[p.group_id for p in prompts for _ in range(n)],
                finish_reasons=[o.finish_reason for o in scored.outputs],
                sampling=sampling,
                sample_versions=[o.weight_version for o in scored.outputs],
                loss_masks=scored.loss_masks,
                token_versions=[list(o.versions) for o in scored.outputs],
                labels=[p.label for p in prompts for _ in range(n)],
                metadata={
                    "reward": reward_fn.spec,
                    "engine": self.engine.name,
                    "n_samples_per_prompt": str(n),
                    "temperature": str(sampling.temperature),
                    **self._environment_metadata(),
                },
                producer=self.producer,
                logprob_space=self.engine.logprob_space,
            )
            if caller_active is not None and not caller_active():
                raise CallerGone(
                    f"Generate(rollout_id={rollout_id}): the caller went away during generation; no batch was written"
                )
            t = time.monotonic()
            entry_id = self.writer.put(batch, stream=stream, trace_context=tracing.inject_context())
            put_s = time.monotonic() - t
            # weight_version: the version generation actually started with
            tracing.set_attributes(sp, entry_id=entry_id, weight_version=batch.policy_version)
        return GenerateResult(
            entry_id=entry_id,
            num_samples=batch.num_samples,
            num_prompt_tokens=int(batch.prompt_lengths.sum()),
            num_response_tokens=batch.num_response_tokens,
            weight_version=batch.policy_version,
            generate_time_s=scored.generate_s,
            reward_time_s=scored.reward_s,
            put_time_s=put_s,
            metrics={
                **batch_metrics(scored.outputs, rewards, n=n, generate_s=scored.generate_s),
                **shaping,
                **scored.metrics,
                **cuda_peak_metrics(),
            },
            producer=self.producer,
            num_groups=len(prompts),
            informative_groups=len(
                informative_groups(batch.rewards, batch.group_ids, min_std=ro.dynamic_sampling.min_std)
            ),
        )

    def _sample_and_score(
        self,
        *,
        prompts: Sequence[PromptInput],
        inputs: ModelInputs,
        n: int,
        sampling: SamplingSpec,
        reward_fn: RewardFunction,
        rollout_id: int,
        span_: trace.Span,
    ) -> _Scored:
        if self.environment is not None:
            return self._play_and_score(
                prompts=prompts,
                inputs=inputs,
                n=n,
                sampling=sampling,
                reward_fn=reward_fn,
                rollout_id=rollout_id,
                span_=span_,
            )
        expanded = [ids for ids in inputs.ids for _ in range(n)]
        caps = [prompt_max_new_tokens(dict(p.metadata), where=f"prompt of group {p.group_id}") for p in prompts]
        t = time.monotonic()
        try:
            outputs = self.engine.generate(
                expanded,
                sampling,
                wait_timeout_s=self.config.loop.step_timeout_s,
                max_new_tokens=None
                if all(c is None for c in caps)
                else [c or sampling.max_new_tokens for c in caps for _ in range(n)],
            )
        except EngineUnavailable as exc:
            raise FailedPrecondition(str(exc)) from exc
        generate_s = time.monotonic() - t
        _refuse_aborted(outputs, rollout_id)
        tokens = sum(len(o.token_ids) for o in outputs)
        tracing.set_attributes(span_, tokens=tokens)
        responses = [self.texts.decode(o.token_ids) for o in outputs]
        t = time.monotonic()
        with tracing.span(
            "rl.reward",
            rollout_id=rollout_id,
            weight_version=outputs[0].weight_version,
            tokens=tokens,
            reward=reward_fn.spec,
            samples=len(outputs),
        ):
            rewards = reward_fn.score(
                prompts=[s for s in inputs.texts for _ in range(n)],
                responses=responses,
                labels=[p.label for p in prompts for _ in range(n)],
                metadatas=[p.reward_metadata() for p in prompts for _ in range(n)],
                timeout_s=runfacts.reward_timeout_s(self.config),
            )
        return _Scored(
            prompt_ids=expanded,
            outputs=outputs,
            rewards=rewards,
            responses=responses,
            generate_s=generate_s,
            reward_s=time.monotonic() - t,
        )

    def _play_and_score(
        self,
        *,
        prompts: Sequence[PromptInput],
        inputs: ModelInputs,
        n: int,
        sampling: SamplingSpec,
        reward_fn: RewardFunction,
        rollout_id: int,
        span_: trace.Span,
    ) -> _Scored:
        """Multi-turn episodes (services.rollout.multi_turn): n per prompt, scored by the environment."""
        ro = self.config.rollout
        assert self.environment is not None
        samples = [
            EpisodeSample(
                prompt=text,
                prompt_ids=tuple(ids),
                label=p.label,
                metadata=p.reward_metadata(),
                group_id=p.group_id,
                sample_index=j,
                messages=p.messages,
            )
            for p, ids, text in zip(prompts, inputs.ids, inputs.texts, strict=True)
            for j in range(n)
        ]
        rollout = MultiTurnRollout(
            engine=self.engine,
            plugin=self.environment,
            encode=self.texts.encode_text,
            decode=self.texts.decode,
            max_turns=ro.max_turns,
            step_timeout_s=ro.environment_timeout_s,
            vocab_size=self.texts.vocab_size,
            wait_timeout_s=self.config.loop.step_timeout_s,
            chat=self.texts,
        )
        try:
            played = rollout.run(samples, sampling)
        except EngineUnavailable as exc:
            raise FailedPrecondition(str(exc)) from exc
        outputs = [e.output for e in played.episodes]
        _refuse_aborted(outputs, rollout_id)
        tracing.set_attributes(span_, tokens=sum(len(o.token_ids) for o in outputs), environment=self.environment.spec)
        responses = [self.texts.decode(o.token_ids) for o in outputs]
        rewards = [e.reward for e in played.episodes]
        t = time.monotonic()
        if ro.episode_reward == "env_plus_reward":
            scores = reward_fn.score(
                prompts=[s.prompt for s in samples],
                responses=responses,
                labels=[s.label for s in samples],
                metadatas=[dict(s.metadata) for s in samples],
            )
            rewards = [a + b for a, b in zip(rewards, scores, strict=True)]
        return _Scored(
            prompt_ids=[list(e.prompt_ids) for e in played.episodes],
            outputs=outputs,
            rewards=rewards,
            responses=responses,
            generate_s=played.engine_s,
            reward_s=played.environment_s + time.monotonic() - t,
            loss_masks=[list(e.loss_mask) for e in played.episodes],
            metrics={**episode_metrics(played.episodes), "env_time_s": played.environment_s},
        )

    def _environment_metadata(self) -> dict[str, str]:
        if self.environment is None:
            return {}
        ro = self.config.rollout
        return {
            "environment": self.environment.spec,
            "max_turns": str(ro.max_turns),
            "episode_reward": ro.episode_reward,
        }

    def _reward_fn(self, reward: str | None) -> RewardFunction:
        """A request's reward, else the configured one. With an environment scoring alone, none is asked for."""
        if reward and self.environment is not None and self.config.rollout.episode_reward == "env":
            raise ValueError(
                f"the request names reward {reward!r}, but rollout.episode_reward is env: the "
                f"environment {self.environment.spec} scores each episode alone (set "
                "rollout.episode_reward: env_plus_reward to add a reward function)"
            )
        return resolve_reward(reward) if reward else self.default_reward

    # ---- prompts and text --------------------------------------------------------------------------

    def model_inputs(self, prompts: Sequence[PromptInput]) -> ModelInputs:
        inputs = model_inputs(self.texts, prompts)
        self.engine.validate_prompts(inputs.ids)
        return inputs

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
        """Greedy (or n-sample) generation over an eval set; metrics under `<name>/`. A sample passes when
        its reward reaches `pass_threshold`; pass@k uses the unbiased estimator over n samples."""
        if not prompts:
            raise ValueError(f"Evaluate({name!r}): no prompts given")
        check_request_size(
            f"Evaluate({name!r})",
            len(prompts),
            n_samples_per_prompt,
            self.config.rollout.eval_n_samples_per_prompt,
            limit=self.config.rollout.max_request_samples,
        )
        start = time.monotonic()
        name = name or "eval"
        n = n_samples_per_prompt or self.config.rollout.eval_n_samples_per_prompt
        if n < 1:
            raise ValueError(f"n_samples_per_prompt must be >= 1, got {n}")
        sampling = sampling or SamplingSpec.from_config(self.config.rollout.eval_sampling)
        reward_fn = self._reward_fn(reward)
        inputs = self.model_inputs(prompts)
        with tracing.span(
            "rl.eval.generate",
            eval_name=name,
            weight_version=self.engine.weight_version,
            prompts=len(prompts),
            replica=self.replica,
        ) as sp:
            scored = self._sample_and_score(
                prompts=prompts, inputs=inputs, n=n, sampling=sampling, reward_fn=reward_fn, rollout_id=-1, span_=sp
            )
        metrics = eval_metrics(scored.outputs, scored.rewards, n=n, prefix=name, pass_threshold=pass_threshold)
        metrics.update({f"{name}/{key}": value for key, value in scored.metrics.items()})
        return EvaluateResult(
            metrics=metrics, weight_version=scored.outputs[0].weight_version, time_s=time.monotonic() - start
        )

    # ---- weights, pause, memory, state -------------------------------------------------------------

    def prepare_weight_sync(self, *, version: int, pause_mode: str = "drain") -> tuple[bool, int]:
        """Pauses generation for the update (the coordinator calls Resume afterwards)."""
        self.engine.pause(pause_mode or "drain", timeout_s=self.config.weights.timeout_s)
        log.info("paused (%s) for weight update to version %d", pause_mode or "drain", version)
        return True, self.engine.engine_ranks

    def receive_weights(self, plan: WeightSyncPlan, rank_offset: int) -> ReceiveResult:
        """Takes part in the transfer the trainer announced in `plan`, in place into the engine's weights."""
        if rank_offset < 0:
            raise ValueError(f"ReceiveWeights: rank_offset must be >= 0, got {rank_offset}")
        accepted = self.config.weights.trainer_id
        if accepted and plan.trainer_id != accepted:  # refused before this engine contacts any address in it
            raise PermissionError(
                f"ReceiveWeights v{plan.version}: trainer {plan.trainer_id!r} is not the accepted "
                f"trainer {accepted!r} (weights.trainer_id)"
            )
        limit = self.config.weights.timeout_s
        if not 0 < plan.timeout_s <= limit:  # a caller must not hold this engine longer than the config allows
            clamped = type(plan)()
            clamped.CopyFrom(plan)
            clamped.timeout_s = limit
            plan = clamped
        with self._lock:
            self._recent.clear()  # new weights: a later Generate with a known key is a new request, not a retry
        with tracing.span(
            "rl.sync", weight_version=plan.version, transport=plan.transport, side="rollout", replica=self.replica
        ):
            try:
                stats = self.engine.receive_weights(plan, rank_offset=rank_offset, receiver=self._weight_receiver())
            except EngineUnavailable as exc:
                raise FailedPrecondition(str(exc)) from exc
        return ReceiveResult(
            version=self.engine.weight_version,
            checksums=dict(stats.checksums),
            bytes_received=stats.bytes,
            time_s=stats.seconds,
            bucket_checksums=stats.bucket_checksums,
            checksum_s=stats.checksum_seconds,
        )

    def _weight_receiver(self) -> WeightReceiver:
        if self._receiver is None:
            from services.weights import WeightReceiver

            self._receiver = WeightReceiver(
                accepted_trainer_id=self.config.weights.trainer_id,
                timeout_s=self.config.weights.timeout_s,
                refuse_timeout_s=self.config.services.timeouts.probe_s,
            )
        return self._receiver

    def pause(self, mode: str = "drain") -> None:
        self.engine.pause(mode or "drain", timeout_s=self.config.weights.timeout_s)

    def resume(self) -> None:
        self.engine.resume()

    def release_memory(self, tags: Sequence[str] = ()) -> None:
        if self._receiver is not None:
            self._receiver.release()  # a kept mapping would keep the trainer's freed buffers on the GPU
        self.engine.release_memory(tuple(tags))

    def resume_memory(self, tags: Sequence[str] = ()) -> None:
        self.engine.resume_memory(tuple(tags))

    def get_state(self) -> ServiceState:
        return ServiceState(engine=self.engine.get_state(), producer=self.producer)

    def close(self) -> None:
        busy, up = self.engine.get_state().busy_s, time.monotonic() - self._started
        log.info("engine busy %.1f s of %.1f s since start (%.0f%%)", busy, up, 100 * busy / up if up > 0 else 0.0)
        if self._receiver is not None:
            self._receiver.close()
        self.writer.close()
        self.engine.close()


def model_inputs(texts: Texts, prompts: Sequence[PromptInput]) -> ModelInputs:
    """Token ids as given; a chat rendered with the chat template; text with the tokenizer's special tokens. The
    text a reward sees: the prompt's text, a chat's rendering, or the given ids decoded."""
    for i, p in enumerate(prompts):
        if not (p.token_ids or p.messages or p.text):
            raise ValueError(f"prompt {i} (group_id {p.group_id}) is empty: give text, messages or token_ids")
    to_encode = [i for i, p in enumerate(prompts) if not p.token_ids]
    try:
        encoded_texts, encoded_ids = texts.model_inputs([prompts[i] for i in to_encode])
    except ChatTemplateError as exc:
        which = f"prompt {to_encode[exc.index]}: " if exc.index is not None else ""
        raise ValueError(f"{which}{exc}") from None
    ids = [[int(x) for x in p.token_ids] for p in prompts]
    shown = [p.text or (texts.decode(p.token_ids) if p.token_ids else "") for p in prompts]
    for i, text, encoded in zip(to_encode, encoded_texts, encoded_ids, strict=True):
        ids[i], shown[i] = encoded, text
    return ModelInputs(ids=ids, texts=shown)


def _refuse_aborted(outputs: Sequence[SampleOutput], rollout_id: int) -> None:
    aborted = sum(o.finish_reason == FINISH_ABORT for o in outputs)
    if aborted:
        raise FailedPrecondition(
            f"rollout_id {rollout_id}: {aborted} of {len(outputs)} samples were aborted by "
            "pause(abort); nothing was written or scored, retry after Resume"
        )
