"""Agents play a Generate's prompts through the endpoint: `rollout.agent: module:function` runs here, one call per
episode; `rollout.agent: external` leaves the episodes to a separate process that claims them and posts rewards.

An episode is opened per prompt x n. It ends when the agent function returns (its reward, or None to have
rollout.reward score the last answer), when an external agent posts its reward, or fails: the function raised, it
ran past rollout.agent_timeout_s, an external agent gave it up or never posted a reward in time. A failed episode
is left out of the batch, logged with its reason and counted (agent_failed_episodes); the batch forms from the
others, and only when every episode failed does the Generate fail, naming the first reasons. Each episode's samples
enter exactly one batch: the Generate that opened it writes them, and the episode is closed (its id refused) after.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.contracts.agents_config import AGENT_EXTERNAL
from services.contracts.config import TandemConfig
from services.contracts.rollout_calls import PromptInput
from services.contracts.sampling_spec import SamplingSpec
from services.contracts.untyped import JsonValue
from services.rollout.agents.app import build_app
from services.rollout.agents.batcher import EngineBatcher
from services.rollout.agents.endpoint import OpenAIEndpoint
from services.rollout.agents.episodes import FINISHED, AgentRow, Episode, EpisodeStore
from services.rollout.agents.failures import AgentsFailed
from services.rollout.agents.server import EndpointServer
from services.rollout.agents.tool_calls import resolve_tool_parser
from services.rollout.engines.interface import Engine, SampleOutput
from services.rollout.rewards import load_attribute
from services.rollout.tokenizer import Texts

log = logging.getLogger(__name__)
AgentFunction = Callable[[Any, AgentRow], Awaitable[float | None]]


class AgentSpecError(ValueError):
    """rollout.agent names nothing loadable, or not an async function."""


def resolve_agent(spec: str) -> AgentFunction:
    fn = load_attribute(spec, kind="rollout.agent", error=AgentSpecError)
    if not inspect.iscoroutinefunction(fn):
        raise AgentSpecError(
            f"rollout.agent {spec!r} must be an async function (async def f(client, row)), got {type(fn).__name__}"
        )
    return fn


@dataclass(frozen=True)
class PlayedEpisode:
    """A finished episode's samples (several when its history was rewritten), or a failed one's reason."""

    row: AgentRow
    samples: tuple[tuple[tuple[int, ...], SampleOutput, tuple[int, ...]], ...]  # prompt ids, output, loss mask
    reward: float | None  # None: rollout.reward scores `answer`
    answer: str  # the last assistant message's text
    turns: int
    rewritten: int
    reused_turns: int
    error: str = ""


@dataclass(frozen=True)
class AgentBatch:
    episodes: list[PlayedEpisode]
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def finished(self) -> list[PlayedEpisode]:
        return [e for e in self.episodes if not e.error]


class AgentRollout:
    """The endpoint of one rollout service (its server, episodes, engine batcher) and the agents it runs."""

    def __init__(self, config: TandemConfig, *, texts: Texts, engine: Engine, replica: int):
        ro = config.rollout
        api = ro.openai_api
        self.config = config
        self.parser_name, parser = resolve_tool_parser(api.tool_parser, texts.tokenizer)
        self.agent = resolve_agent(ro.agent) if ro.agent not in (None, AGENT_EXTERNAL) else None
        self.external = ro.agent == AGENT_EXTERNAL
        self.token = config.services.auth_token
        self.store = EpisodeStore()
        self.batcher = EngineBatcher(
            engine, wait_timeout_s=config.loop.step_timeout_s, max_pending=api.max_pending_requests
        )
        self.endpoint = OpenAIEndpoint(
            texts=texts,
            engine=engine,
            batcher=self.batcher,
            store=self.store,
            tool_parser=parser,
            default_sampling=SamplingSpec.from_config(ro.sampling).with_seed(None),
        )
        app = build_app(self.endpoint, token=self.token, base_url=lambda: self.server.url)
        self.server = EndpointServer(
            app, port=api.port + replica if api.port else 0, start_timeout_s=config.services.timeouts.probe_s
        )
        log.info("OpenAI-compatible endpoint at %s/v1 (tool calls: %s)", self.server.url, self.parser_name)

    @property
    def plays(self) -> bool:
        """Generate's samples are agent episodes (rollout.agent is set)."""
        return self.agent is not None or self.external

    def base_url(self, episode: Episode) -> str:
        return f"{self.server.url}/episodes/{episode.id}/v1"

    def play(self, prompts: Sequence[PromptInput], texts: Sequence[str], n: int, sampling: SamplingSpec) -> AgentBatch:
        """n episodes per prompt, in order; returns when each has finished or failed."""
        timeout_s = self.config.rollout.agent_timeout_s
        start = time.monotonic()
        episodes = [
            self.store.open(_row(p, text, j), sampling, timeout_s=timeout_s, claimed=not self.external)
            for p, text in zip(prompts, texts, strict=True)
            for j in range(n)
        ]
        try:
            if self.agent is not None:
                asyncio.run(self._run_agents(self.agent, episodes, timeout_s))
            else:
                for e in episodes:
                    e.finished.wait(max(0.0, e.deadline - time.monotonic()))
            for e in episodes:
                e.fail(
                    f"no reward within rollout.agent_timeout_s ({timeout_s:g} s)"
                    + ("" if e.claimed else "; no external agent claimed it")
                )
            played = [_played(e) for e in episodes]
        finally:
            self.store.close(episodes)
        for p in played:
            if p.error:
                log.error("agent episode (group %d, sample %d) failed: %s", p.row.group_id, p.row.sample_index, p.error)
        if all(p.error for p in played):
            reasons = "; ".join(dict.fromkeys(p.error for p in played))
            raise AgentsFailed(f"all {len(played)} agent episodes failed, so no batch formed: {reasons[:2000]}")
        return AgentBatch(episodes=played, seconds=time.monotonic() - start, metrics=agent_metrics(played))

    async def _run_agents(self, agent: AgentFunction, episodes: Sequence[Episode], timeout_s: float) -> None:
        import httpx
        import openai

        limits = httpx.Limits(max_connections=len(episodes), max_keepalive_connections=64)
        async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as http:
            await asyncio.gather(*(self._run_one(agent, e, openai, http) for e in episodes))

    async def _run_one(self, agent: AgentFunction, episode: Episode, openai: JsonValue, http: JsonValue) -> None:
        client = openai.AsyncOpenAI(
            base_url=self.base_url(episode), api_key=self.token or "unused", max_retries=0, http_client=http
        )
        assert episode.row is not None
        try:
            reward = await asyncio.wait_for(agent(client, episode.row), max(0.0, episode.deadline - time.monotonic()))
        except TimeoutError:
            episode.fail(
                f"the agent did not return within rollout.agent_timeout_s ({self.config.rollout.agent_timeout_s:g} s)"
            )
            return
        except Exception as exc:  # noqa: BLE001 - the agent's own error, reported with its episode
            episode.fail(f"the agent raised {type(exc).__name__}: {exc}")
            return
        if reward is not None and (not isinstance(reward, (int, float)) or isinstance(reward, bool)):
            episode.fail(f"the agent returned {type(reward).__name__} {reward!r}; return a number, or None")
            return
        try:
            episode.finish(float(reward) if reward is not None else float("nan"))
        except ValueError as exc:
            episode.fail(str(exc))

    def close(self) -> None:
        self.server.stop(self.config.services.timeouts.shutdown_s / 3)
        self.batcher.close()


def _row(p: PromptInput, text: str, sample_index: int) -> AgentRow:
    return AgentRow(
        text=p.text,
        rendered=text,
        messages=tuple(m.as_dict() for m in p.messages),
        label=p.label,
        metadata=dict(p.metadata),
        group_id=p.group_id,
        sample_index=sample_index,
    )


def _played(e: Episode) -> PlayedEpisode:
    assert e.row is not None
    answer = e.last_answer
    samples = tuple((s.prompt_ids, s.output, s.loss_mask) for s in e.training_samples(version=0))
    reward = None if e.reward is None or e.reward != e.reward else e.reward  # NaN: the agent returned None
    return PlayedEpisode(
        row=e.row,
        samples=samples if e.status == FINISHED else (),
        reward=reward,
        answer=answer,
        turns=e.turns,
        rewritten=e.rewritten,
        reused_turns=e.reused_turns,
        error="" if e.status == FINISHED else e.error,
    )


def agent_metrics(played: Sequence[PlayedEpisode]) -> dict[str, float]:
    done = [p for p in played if not p.error]
    turns = sum(p.turns for p in done)
    return {
        "agent_episodes": float(len(played)),
        "agent_failed_episodes": float(len(played) - len(done)),
        "agent_turns_mean": turns / len(done) if done else 0.0,
        "agent_samples_per_episode": sum(len(p.samples) for p in done) / len(done) if done else 0.0,
        "agent_rewritten_turns": float(sum(p.rewritten for p in done)),
        "agent_reused_turn_frac": sum(p.reused_turns for p in done) / turns if turns else 0.0,
    }
