"""Where a Generate's and an Evaluate's scored samples come from: the plug-in point of the rollout service.

A `SampleSource` turns a request's prompts into n scored samples per prompt (`Scored`). Two ship: `SingleTurn`
(one engine.generate over every prompt x n, then the reward function over the responses) and, when
rollout.environment is set, `multi_turn.EpisodeSource` (engine turns and environment steps, scored by the
environment). A new kind of sample source (an agent loop behind an OpenAI-compatible endpoint, say) implements the
Protocol and is chosen in builder.py; a new kind of reward implements `Scorer`. The service builds the batch and
writes it; a source only samples and scores.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from services.contracts import runfacts
from services.contracts.config import TandemConfig
from services.contracts.errors import FailedPrecondition
from services.contracts.rollout_calls import PromptInput
from services.contracts.sampling_spec import SamplingSpec, prompt_max_new_tokens
from services.rollout.engines.engine_errors import EngineUnavailable
from services.rollout.engines.interface import FINISH_ABORT, Engine, SampleOutput
from services.rollout.prompts import ModelInputs
from services.rollout.rewards import RewardScores, resolve_reward
from services.rollout.tokenizer import Texts
from services.telemetry import tracing

if TYPE_CHECKING:
    from opentelemetry import trace


class Scorer(Protocol):
    """A reward over decoded samples: rewards.RewardFunction (a built-in, a file's function, a package's), a model
    of the reward service (remote_reward.RemoteReward) or a weighted sum of them (reward_mix.WeightedReward)."""

    @property
    def spec(self) -> str: ...

    def score(
        self,
        *,
        prompts: Sequence[str],
        responses: Sequence[str],
        labels: Sequence[str],
        metadatas: Sequence[dict[str, str]],
        timeout_s: float | None = None,
    ) -> list[float]: ...

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
        """`score` with what the reward reports about the batch (metrics); `tokens` per sample batch remote calls."""
        ...


Resolve = Callable[[str], Scorer]  # a reward spec -> its Scorer (reward_mix.RewardResolver.resolve)


@dataclass(frozen=True)
class SampleRequest:
    prompts: Sequence[PromptInput]
    inputs: ModelInputs
    n: int  # samples per prompt
    sampling: SamplingSpec
    reward: Scorer
    rollout_id: int  # -1 for an eval
    span: trace.Span  # the caller's rl.sample / rl.eval.generate span, for token counts


@dataclass(frozen=True)
class Scored:
    """n samples per prompt, in prompt order, with their rewards."""

    prompt_ids: list[list[int]]
    outputs: list[SampleOutput]
    rewards: list[float]
    responses: list[str]
    generate_s: float
    reward_s: float
    loss_masks: list[list[int]] | None = None  # None: every response token is the policy's
    metrics: dict[str, float] = field(default_factory=dict)
    # None: n samples per prompt in order; set where a source's groups vary (agents: a failed episode is left out, a
    # rewritten one is several samples)
    group_ids: list[int] | None = None
    labels: list[str] | None = None


class SampleSource(Protocol):
    def reward_for(self, spec: str | None) -> Scorer:
        """A request's reward (`spec`), else the configured one; ValueError where this source scores alone."""
        ...

    def sample(self, request: SampleRequest) -> Scored: ...

    def metadata(self) -> Mapping[str, str]:
        """What the batch's metadata says about this source (the environment, its turns)."""
        ...


def mix_seed(seed: int | None, rollout_id: int) -> int | None:
    """A per-step seed, so a fixed config seed does not replay one random stream every step."""
    if seed is None:
        return None
    return (seed * 1_000_003 + rollout_id * 7_919 + 1) & 0x7FFF_FFFF_FFFF_FFFF


def refuse_aborted(outputs: Sequence[SampleOutput], rollout_id: int) -> None:
    aborted = sum(o.finish_reason == FINISH_ABORT for o in outputs)
    if aborted:
        raise FailedPrecondition(
            f"rollout_id {rollout_id}: {aborted} of {len(outputs)} samples were aborted by "
            "pause(abort); nothing was written or scored, retry after Resume"
        )


class SingleTurn:
    """One engine call for every prompt x n, then the reward over the decoded responses."""

    def __init__(
        self,
        config: TandemConfig,
        *,
        engine: Engine,
        texts: Texts,
        default_reward: Scorer,
        resolve: Resolve = resolve_reward,
    ):
        self.config, self.engine, self.texts, self.default_reward = config, engine, texts, default_reward
        self.resolve = resolve

    def reward_for(self, spec: str | None) -> Scorer:
        return self.resolve(spec) if spec else self.default_reward

    def metadata(self) -> Mapping[str, str]:
        return {}

    def sample(self, request: SampleRequest) -> Scored:
        n, sampling, prompts = request.n, request.sampling, request.prompts
        expanded = [ids for ids in request.inputs.ids for _ in range(n)]
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
        refuse_aborted(outputs, request.rollout_id)
        tokens = sum(len(o.token_ids) for o in outputs)
        tracing.set_attributes(request.span, tokens=tokens)
        responses = [self.texts.decode(o.token_ids) for o in outputs]
        t = time.monotonic()
        with tracing.span(
            "rl.reward",
            rollout_id=request.rollout_id,
            weight_version=outputs[0].weight_version,
            tokens=tokens,
            reward=request.reward.spec,
            samples=len(outputs),
        ):
            rewards = request.reward.score_detailed(
                prompts=[s for s in request.inputs.texts for _ in range(n)],
                responses=responses,
                labels=[p.label for p in prompts for _ in range(n)],
                metadatas=[p.reward_metadata() for p in prompts for _ in range(n)],
                timeout_s=runfacts.reward_timeout_s(self.config),
                tokens=[len(p) + len(o.token_ids) for p, o in zip(expanded, outputs, strict=True)],
            )
        return Scored(
            prompt_ids=expanded,
            outputs=outputs,
            rewards=rewards.values,
            responses=responses,
            generate_s=generate_s,
            reward_s=time.monotonic() - t,
            metrics=rewards.metrics,
        )
