"""The multi-turn rollout: engine turns alternate with environment steps, in rounds over all live episodes.

Round t: one `engine.generate` call over every episode still running (its prompt is the original prompt, the
reset observation, and every earlier turn and observation), then every live episode's `step` concurrently.
An episode ends when its environment says done, after `max_turns` turns, or when the next observation would
leave no room in the engine's context (verl's ToolAgentLoop rule: an episode never ends on an observation, so
its last response token is a policy token). Round by round keeps the engine's batch wide; the engine call runs
on a worker thread, so an async environment's own tasks keep running meanwhile; a slow async step delays its
round, not each episode in turn.

When the prompt is a chat, each observation is a turn of the conversation, rendered with the chat template: the
end of the policy's turn, the observation's message, the next assistant header (services/rollout/chat_template.py). Only
those tokens are encoded; the context grows by appending ids, so what the engine generated is never re-encoded.

One episode becomes one sample: response = turns and observations in order, loss_mask 1 on policy tokens and 0
on observation tokens, rollout log-probs the engine's on policy tokens and 0.0 on observation tokens (the
trainer weighs masked tokens 0 in every loss and metric), reward = the sum of the step rewards.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.contracts.chat_messages import ChatMessage
from services.contracts.config import TandemConfig
from services.contracts.errors import FailedPrecondition
from services.contracts.sampling_spec import SamplingSpec
from services.rollout.chat_template import ChatTemplateError
from services.rollout.engines.engine_errors import EngineUnavailable
from services.rollout.engines.interface import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Engine, SampleOutput
from services.rollout.environments import (
    Action,
    EnvironmentFailure,
    EnvironmentPlugin,
    EpisodeSample,
    as_step_result,
    call_environment,
    observation_ids,
    observation_message,
)
from services.rollout.rewards import resolve_reward
from services.rollout.samples import Resolve, SampleRequest, Scored, Scorer, refuse_aborted
from services.rollout.sync_bridge import run_coroutine
from services.rollout.tokenizer import Texts
from services.telemetry import tracing

# How an episode ended. On the wire: done -> stop; max_turns and context -> length (it was cut); abort -> abort.
END_DONE, END_MAX_TURNS, END_CONTEXT, END_ABORT = "done", "max_turns", "context", "abort"
_WIRE_FINISH = {
    END_DONE: FINISH_STOP,
    END_MAX_TURNS: FINISH_LENGTH,
    END_CONTEXT: FINISH_LENGTH,
    END_ABORT: FINISH_ABORT,
}
_TURN_SEED_STRIDE = 0x9E37_79B9_7F4A_7C15  # turn t > 0 samples with seed + t x this (mod 2^63)


@dataclass(frozen=True)
class Episode:
    """One finished episode, as the batch holds it."""

    prompt_ids: tuple[int, ...]  # the request's prompt + the reset observation
    output: SampleOutput  # token_ids: the whole response; finish_reason: the wire's (see _WIRE_FINISH)
    loss_mask: tuple[int, ...]  # 1 policy token, 0 observation token
    reward: float  # sum of the step rewards
    turns: int
    end: str  # one of END_*


@dataclass(frozen=True)
class EpisodeBatch:
    episodes: list[Episode]
    engine_s: float  # in engine.generate, summed over rounds
    environment_s: float  # in reset and step calls (a round's run concurrently), summed over rounds


@dataclass
class _Clock:
    seconds: dict[str, float] = field(default_factory=lambda: {"engine": 0.0, "environment": 0.0})

    @contextlib.contextmanager
    def timing(self, part: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[part] += time.monotonic() - start


class ChatTurns(Protocol):
    """Renders a chat episode's prompt and observations (services.rollout.tokenizer.Texts)."""

    @property
    def observation_role(self) -> str: ...

    def chat_prompt_ids(self, messages: Sequence[ChatMessage]) -> list[int]: ...

    def observation_ids(self, message: ChatMessage, *, turn: Sequence[int], turn_ended: bool) -> list[int]: ...


@dataclass
class _Running:
    env: Any
    context: list[int]
    prompt_len: int
    chat: bool = False  # the prompt is a chat: observations are rendered as its turns
    versions: list[int] = field(default_factory=list)  # each turn's version when it started
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)  # an observation token: the policy token's before it
    reward: float = 0.0
    end: str | None = None

    def add(
        self, ids: Sequence[int], log_probs: Sequence[float] | None, token_versions: Sequence[int] | None = None
    ) -> None:
        """A turn (its log-probs and token versions), or an observation (None, None)."""
        self.context += ids
        self.tokens += ids
        self.mask += [1 if log_probs is not None else 0] * len(ids)
        self.log_probs += list(log_probs) if log_probs is not None else [0.0] * len(ids)
        before = self.token_versions[-1] if self.token_versions else min(self.versions, default=0)
        self.token_versions += list(token_versions) if token_versions is not None else [before] * len(ids)

    def finish(self, *, version: int) -> Episode:
        assert self.end is not None, "every episode ends by the last round"
        end = self.end
        return Episode(
            prompt_ids=tuple(self.context[: self.prompt_len]),
            loss_mask=tuple(self.mask),
            output=SampleOutput(
                token_ids=tuple(self.tokens),
                log_probs=tuple(self.log_probs),
                finish_reason=_WIRE_FINISH[end],
                weight_version=min(self.token_versions or self.versions, default=version),
                token_versions=tuple(self.token_versions),
            ),
            reward=self.reward,
            turns=len(self.versions),
            end=end,
        )


@dataclass(frozen=True)
class MultiTurnRollout:
    """Runs episodes of `plugin` against `engine`. `encode` tokenizes observation text (no special tokens),
    `decode` a turn's tokens (special tokens removed)."""

    engine: Engine
    plugin: EnvironmentPlugin
    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    max_turns: int
    step_timeout_s: float
    vocab_size: int | None = None
    wait_timeout_s: float | None = None
    chat: ChatTurns | None = None  # renders observations of episodes whose prompt is a chat

    def run(self, samples: Sequence[EpisodeSample], sampling: SamplingSpec) -> EpisodeBatch:
        """One episode per sample, in order."""
        return run_coroutine(self._run(samples, sampling))

    async def _run(self, samples: Sequence[EpisodeSample], sampling: SamplingSpec) -> EpisodeBatch:
        clock = _Clock()
        with clock.timing("environment"):
            episodes = await self._reset(samples)
        for turn in range(self.max_turns):
            live = [i for i, e in enumerate(episodes) if e.end is None]
            if not live:
                break
            with clock.timing("engine"):
                outputs = await asyncio.to_thread(
                    self.engine.generate,
                    [episodes[i].context for i in live],
                    turn_sampling(sampling, turn),
                    wait_timeout_s=self.wait_timeout_s,
                )
            if any(o.finish_reason == FINISH_ABORT for o in outputs):
                for i in live:  # pause(abort): the request ends now, nothing of it is written
                    episodes[i].end = END_ABORT
                break
            for i, out in zip(live, outputs, strict=True):
                episodes[i].versions.append(out.weight_version)
                episodes[i].add(out.token_ids, out.log_probs, out.versions)
            actions = [
                Action(
                    text=self.decode(out.token_ids),
                    token_ids=tuple(out.token_ids),
                    finish_reason=out.finish_reason,
                    turn=turn,
                    last_turn=turn + 1 >= self.max_turns,
                )
                for out in outputs
            ]
            with clock.timing("environment"):
                results = await asyncio.gather(
                    *(self._step(episodes[i], i, a) for i, a in zip(live, actions, strict=True))
                )
            for i, action, (observation, reward, done) in zip(live, actions, results, strict=True):
                self._advance(episodes[i], i, observation=observation, reward=reward, done=done, action=action)
        version = self.engine.weight_version
        return EpisodeBatch(
            episodes=[e.finish(version=version) for e in episodes],
            engine_s=clock.seconds["engine"],
            environment_s=clock.seconds["environment"],
        )

    async def _reset(self, samples: Sequence[EpisodeSample]) -> list[_Running]:
        envs = [self.plugin.make() for _ in samples]
        observations = await asyncio.gather(
            *(
                call_environment(env, "reset", s, spec=self.plugin.spec, episode=i, timeout_s=self.step_timeout_s)
                for i, (env, s) in enumerate(zip(envs, samples, strict=True))
            )
        )
        episodes = []
        for i, (env, s, obs) in enumerate(zip(envs, samples, observations, strict=True)):
            chat = bool(s.messages) and self.chat is not None
            context = self._reset_prompt(s, obs, i) if chat else [*s.prompt_ids, *self._ids(obs, i)]
            running = _Running(env=env, context=context, prompt_len=len(context), chat=chat)
            if len(context) >= self.engine.max_context_length:
                running.end = END_CONTEXT  # the reset observation filled the context: no turn fits
            episodes.append(running)
        return episodes

    async def _step(self, episode: _Running, index: int, action: Action) -> tuple[Any, float, bool]:
        raw = await call_environment(
            episode.env, "step", action, spec=self.plugin.spec, episode=index, timeout_s=self.step_timeout_s
        )
        return as_step_result(raw, spec=self.plugin.spec, episode=index)

    def _advance(
        self, episode: _Running, index: int, *, observation: Any, reward: float, done: bool, action: Action
    ) -> None:
        episode.reward += reward
        if done:
            episode.end = END_DONE
            return
        if action.turn + 1 >= self.max_turns:
            episode.end = END_MAX_TURNS
            return
        ids = self._turn_ids(observation, index, action) if episode.chat else self._ids(observation, index)
        if len(episode.context) + len(ids) >= self.engine.max_context_length:
            episode.end = END_CONTEXT  # the observation would leave no room for the next turn
            return
        episode.add(ids, None)

    def _ids(self, observation: Any, index: int) -> list[int]:
        return observation_ids(
            observation, encode=self.encode, vocab_size=self.vocab_size, spec=self.plugin.spec, episode=index
        )

    def _reset_prompt(self, sample: EpisodeSample, observation: Any, index: int) -> list[int]:
        """A chat's prompt: as the request encoded it, or re-rendered with the reset observation as its last message
        (nothing is generated yet, so nothing is re-encoded)."""
        assert self.chat is not None
        message = self._message(observation, index)
        if message is None:
            return [*sample.prompt_ids, *self._ids(observation, index)]  # token ids (or nothing) as they are
        with self._template_errors(index):
            return self.chat.chat_prompt_ids([*sample.messages, message])

    def _turn_ids(self, observation: Any, index: int, action: Action) -> list[int]:
        assert self.chat is not None
        message = self._message(observation, index)
        if message is None:
            return self._ids(observation, index)
        with self._template_errors(index):
            return self.chat.observation_ids(
                message, turn=action.token_ids, turn_ended=action.finish_reason == FINISH_STOP
            )

    def _message(self, observation: Any, index: int) -> ChatMessage | None:
        assert self.chat is not None
        return observation_message(observation, role=self.chat.observation_role, spec=self.plugin.spec, episode=index)

    @contextlib.contextmanager
    def _template_errors(self, index: int) -> Iterator[None]:
        try:
            yield
        except ChatTemplateError as exc:
            raise EnvironmentFailure(
                f"environment {self.plugin.spec}: the observation of episode {index}: {exc}"
            ) from None


def turn_sampling(sampling: SamplingSpec, turn: int) -> SamplingSpec:
    """Turn 0 samples exactly as a single-turn request would; later turns draw from other random streams."""
    if turn == 0 or sampling.seed is None:
        return sampling
    return sampling.with_seed((sampling.seed + turn * _TURN_SEED_STRIDE) & 0x7FFF_FFFF_FFFF_FFFF)


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Per-batch numbers of the episodes (the coordinator prefixes them with `rollout/`)."""
    n = len(episodes)
    tokens = sum(len(e.loss_mask) for e in episodes)
    observed = sum(len(e.loss_mask) - sum(e.loss_mask) for e in episodes)
    out = {
        "env_turns_mean": sum(e.turns for e in episodes) / n,
        "env_observation_token_frac": observed / tokens if tokens else 0.0,
    }
    for end in (END_DONE, END_MAX_TURNS, END_CONTEXT):
        out[f"env_end_{end}_frac"] = sum(e.end == end for e in episodes) / n
    return out


class EpisodeSource:
    """The sample source of a run with rollout.environment (samples.SampleSource): n episodes per prompt, each
    scored by its environment (plus the reward function under rollout.episode_reward env_plus_reward)."""

    def __init__(
        self,
        config: TandemConfig,
        *,
        engine: Engine,
        texts: Texts,
        environment: EnvironmentPlugin,
        default_reward: Scorer,
        resolve: Resolve = resolve_reward,
    ):
        self.config, self.engine, self.texts = config, engine, texts
        self.environment, self.default_reward, self.resolve = environment, default_reward, resolve

    def reward_for(self, spec: str | None) -> Scorer:
        """A request's reward, else the configured one; with the environment scoring alone none may be named."""
        if spec and self.config.rollout.episode_reward == "env":
            raise ValueError(
                f"the request names reward {spec!r}, but rollout.episode_reward is env: the "
                f"environment {self.environment.spec} scores each episode alone (set "
                "rollout.episode_reward: env_plus_reward to add a reward function)"
            )
        return self.resolve(spec) if spec else self.default_reward

    def metadata(self) -> Mapping[str, str]:
        ro = self.config.rollout
        return {
            "environment": self.environment.spec,
            "max_turns": str(ro.max_turns),
            "episode_reward": ro.episode_reward,
        }

    def sample(self, request: SampleRequest) -> Scored:
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
            for p, ids, text in zip(request.prompts, request.inputs.ids, request.inputs.texts, strict=True)
            for j in range(request.n)
        ]
        try:
            played = self._rollout().run(samples, request.sampling)
        except EngineUnavailable as exc:
            raise FailedPrecondition(str(exc)) from exc
        outputs = [e.output for e in played.episodes]
        refuse_aborted(outputs, request.rollout_id)
        tokens = sum(len(o.token_ids) for o in outputs)
        tracing.set_attributes(request.span, tokens=tokens, environment=self.environment.spec)
        responses = [self.texts.decode(o.token_ids) for o in outputs]
        rewards = [e.reward for e in played.episodes]
        t = time.monotonic()
        if self.config.rollout.episode_reward == "env_plus_reward":
            scores = request.reward.score(
                prompts=[s.prompt for s in samples],
                responses=responses,
                labels=[s.label for s in samples],
                metadatas=[dict(s.metadata) for s in samples],
            )
            rewards = [a + b for a, b in zip(rewards, scores, strict=True)]
        return Scored(
            prompt_ids=[list(e.prompt_ids) for e in played.episodes],
            outputs=outputs,
            rewards=rewards,
            responses=responses,
            generate_s=played.engine_s,
            reward_s=played.environment_s + time.monotonic() - t,
            loss_masks=[list(e.loss_mask) for e in played.episodes],
            metrics={**episode_metrics(played.episodes), "env_time_s": played.environment_s},
        )

    def _rollout(self) -> MultiTurnRollout:
        ro = self.config.rollout
        return MultiTurnRollout(
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
