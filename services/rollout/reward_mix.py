"""What `rollout.reward` names, as one `Scorer` (samples.py): a rule function (rewards.py), a model of the reward
service (remote_reward.py), or a weighted sum of them (`0.7*math_answer + 0.3*judge:helpfulness`).

A sum scores its terms side by side (a remote term's samples go to the reward service while the rule terms run) and
reports each term's mean as `reward/<term>/mean`, besides what the terms report themselves (a model's sub-scores,
a judge's parse failures, the queue time). `RewardResolver` builds each spec once per service, and one ScoreBatcher
per model, shared by every spec and call that names it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from services.contracts.config import TandemConfig
from services.contracts.reward_spec import RewardSpecError, RewardTerm, parse_reward
from services.rollout.remote_reward import RemoteReward, ScoreBatcher, ScoreClient
from services.rollout.rewards import DetailedReward, RewardScores, resolve_reward
from services.rollout.samples import Scorer


@dataclass(frozen=True)
class WeightedReward(DetailedReward):
    spec: str
    terms: tuple[tuple[RewardTerm, Scorer], ...]

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
        def run(reward: Scorer) -> RewardScores:
            return reward.score_detailed(
                prompts=prompts,
                responses=responses,
                labels=labels,
                metadatas=metadatas,
                timeout_s=timeout_s,
                tokens=tokens,
            )

        with ThreadPoolExecutor(max_workers=len(self.terms), thread_name_prefix="reward term") as pool:
            parts = list(pool.map(run, [reward for _, reward in self.terms]))
        values = [0.0] * len(responses)
        metrics: dict[str, float] = {}
        for (term, _), part in zip(self.terms, parts, strict=True):
            values = [v + term.weight * s for v, s in zip(values, part.values, strict=True)]
            metrics.update(part.metrics)
            if part.values:
                metrics[f"reward/{term.metric_name}/mean"] = sum(part.values) / len(part.values)
        return RewardScores(values=values, metrics=metrics)


def check_rule_terms(spec: str) -> None:
    """Every rule term of a spec resolves (RewardSpecError naming the one that does not); models are the config's
    to check (validate_reward_models) and the reward service's to load."""
    for term in parse_reward(spec):
        if term.model is None:
            resolve_reward(term.spec)


ClientFactory = Callable[[TandemConfig], ScoreClient]


class RewardResolver:
    """Rewards by spec for one rollout service: built once each; one batcher per reward-service model."""

    def __init__(self, config: TandemConfig, *, client_factory: ClientFactory):
        self.config = config
        self._client_factory = client_factory
        self._client: ScoreClient | None = None
        self._batchers: dict[str, ScoreBatcher] = {}
        self._built: dict[str, Scorer] = {}
        self._lock = threading.Lock()

    def resolve(self, spec: str) -> Scorer:
        with self._lock:
            if spec not in self._built:
                self._built[spec] = self._build(spec)
            return self._built[spec]

    def _build(self, spec: str) -> Scorer:
        terms = parse_reward(spec)
        if len(terms) == 1 and terms[0].model is None and terms[0].weight == 1.0:
            return resolve_reward(terms[0].spec)
        return WeightedReward(spec=spec, terms=tuple((t, self._term(t)) for t in terms))

    def _term(self, term: RewardTerm) -> Scorer:
        if term.model is None:
            return resolve_reward(term.spec)
        reward = self.config.reward
        if reward is None or term.model not in reward.models:
            served = ", ".join(reward.models) if reward is not None else "none: the config has no reward: section"
            raise RewardSpecError(f"reward {term.spec}: reward.models has no {term.model!r} (served: {served})")
        if term.model not in self._batchers:
            if self._client is None:
                self._client = self._client_factory(self.config)
            self._batchers[term.model] = ScoreBatcher(self._client, term.model, reward)
        return RemoteReward(
            spec=term.spec,
            name=term.metric_name,
            batcher=self._batchers[term.model],
            wait_s=reward.max_wait_s + reward.call_timeout_s,
        )
