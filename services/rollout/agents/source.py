"""The sample source of rollout.agent (samples.SampleSource, chosen in builder.py): a request's prompts x n played
as agent episodes through the endpoint (runner.py), scored by the agents' own rewards or rollout.reward.

Training takes every sample of each finished episode (several for a rewritten history), grouped by its prompt, so a
group may hold fewer or more than n samples (`Scored.group_ids`); an eval takes one per episode (its last sample),
a failed episode scoring 0, so eval metrics keep n per prompt."""

from __future__ import annotations

import time
from collections.abc import Mapping

from services.contracts import runfacts
from services.contracts.config import TandemConfig
from services.contracts.errors import FailedPrecondition
from services.rollout.agents.failures import AgentsFailed
from services.rollout.agents.runner import AgentRollout, PlayedEpisode
from services.rollout.engines.interface import FINISH_ABORT, SampleOutput
from services.rollout.rewards import resolve_reward
from services.rollout.samples import Resolve, SampleRequest, Scored, Scorer

_NOTHING = SampleOutput(token_ids=(), log_probs=(), finish_reason=FINISH_ABORT, weight_version=0)


class AgentSource:
    def __init__(
        self, config: TandemConfig, *, agents: AgentRollout, default_reward: Scorer, resolve: Resolve = resolve_reward
    ):
        self.config, self.agents, self.default_reward, self.resolve = config, agents, default_reward, resolve

    def reward_for(self, spec: str | None) -> Scorer:
        return self.resolve(spec) if spec else self.default_reward

    def metadata(self) -> Mapping[str, str]:
        ro = self.config.rollout
        return {"agent": ro.agent or "", "tool_parser": self.agents.parser_name}

    def sample(self, request: SampleRequest) -> Scored:
        try:
            played = self.agents.play(request.prompts, request.inputs.texts, request.n, request.sampling)
        except AgentsFailed as exc:
            raise FailedPrecondition(f"rollout_id {request.rollout_id}: {exc}") from exc
        t = time.monotonic()
        rewards = self._rewards(played.finished, request.reward)
        evaluating = request.rollout_id < 0
        kept = played.episodes if evaluating else played.finished
        rows: list[tuple[PlayedEpisode, tuple[tuple[int, ...], SampleOutput, tuple[int, ...]]]] = [
            (e, s) for e in kept for s in ((e.samples[-1:] if evaluating else e.samples) or [((), _NOTHING, ())])
        ]
        return Scored(
            prompt_ids=[list(s[0]) for _, s in rows],
            outputs=[s[1] for _, s in rows],
            rewards=[rewards.get(id(e), 0.0) for e, _ in rows],
            responses=[e.answer for e, _ in rows],
            generate_s=played.seconds,
            reward_s=time.monotonic() - t,
            loss_masks=[list(s[2]) for _, s in rows],
            metrics=played.metrics,
            group_ids=[e.row.group_id for e, _ in rows],
            labels=[e.row.label for e, _ in rows],
        )

    def _rewards(self, finished: list[PlayedEpisode], scorer: Scorer) -> dict[int, float]:
        """Each finished episode's reward: the agent's, or rollout.reward's score of its last answer."""
        unscored = [e for e in finished if e.reward is None]
        scores = (
            scorer.score(
                prompts=[e.row.rendered for e in unscored],
                responses=[e.answer for e in unscored],
                labels=[e.row.label for e in unscored],
                metadatas=[dict(e.row.metadata) for e in unscored],
                timeout_s=runfacts.reward_timeout_s(self.config),
            )
            if unscored
            else []
        )
        by_episode = {id(e): float(s) for e, s in zip(unscored, scores, strict=True)}
        return {id(e): e.reward if e.reward is not None else by_episode[id(e)] for e in finished}
