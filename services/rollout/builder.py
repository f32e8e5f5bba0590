"""The rollout replica's parts, built once per process: the tokenizer and chat template, the engine, the sample
source, the batch writer, the weight receipt and the retry ledger. `RolloutService` takes the frozen `RolloutParts`
and only sequences them; tests build parts with fakes (tests/test_rollout_unit.py) or pass a ready engine,
tokenizer or Redis client here."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from services.buffer.stream import stream_key
from services.contracts.config import TandemConfig
from services.contracts.rollout_calls import GenerateResult
from services.contracts.wire import RolloutBatchData
from services.rollout.chat_template import ChatTemplate
from services.rollout.engines.engine_registry import engine_kind
from services.rollout.engines.interface import Engine
from services.rollout.environment_registry import resolve_environment
from services.rollout.multi_turn import EpisodeSource
from services.rollout.recent_calls import RecentCalls
from services.rollout.reward_mix import RewardResolver
from services.rollout.samples import Resolve, SampleSource, Scorer, SingleTurn
from services.rollout.tokenizer import Texts, end_of_generation_ids, load_tokenizer
from services.rollout.weight_receipt import WeightReceipt
from services.rollout.writer import BatchWriter
from services.tensors.devices import limit_cpu_threads

if TYPE_CHECKING:
    import redis
    from transformers import PreTrainedTokenizerBase

    from services.rollout.agents.runner import AgentRollout
    from services.rollout.remote_reward import ScoreClient

log = logging.getLogger(__name__)


class BatchSink(Protocol):
    """Where a Generate's batch goes (writer.BatchWriter: the run's Redis stream); returns the entry id."""

    def put(self, batch: RolloutBatchData, *, stream: str, trace_context: dict[str, str]) -> str: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class RolloutParts:
    config: TandemConfig
    replica: int
    producer: str  # the name batches are written under
    stream: str  # the run's stream, for a Generate that names none
    texts: Texts
    engine: Engine
    source: SampleSource
    writer: BatchSink
    weights: WeightReceipt
    recent: RecentCalls[GenerateResult]
    agents: AgentRollout | None = None  # the OpenAI-compatible endpoint (rollout.openai_api), stopped with the service


def build_engine(config: TandemConfig, texts: Texts | None = None) -> Engine:
    """The configured engine; it ends samples on every id of `end_of_generation_ids` (generation config, config and
    the tokenizer of `texts`), and the native one matches stop strings with `texts` (SGLang with its own copy of the
    tokenizer)."""
    eos = end_of_generation_ids(config.model.path, texts.tokenizer if texts is not None else None)
    return engine_kind(config.rollout.engine).build(config, eos, texts)


def _reward_client(config: TandemConfig) -> ScoreClient:
    from services.rollout.reward_client import RewardClient

    return RewardClient(config)


def build_rollout(
    config: TandemConfig,
    *,
    replica: int = 0,
    engine: Engine | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    redis_client: redis.Redis | None = None,
) -> RolloutParts:
    """The real parts; `engine`, `tokenizer` and `redis_client`, when given, are used instead of building them."""
    ro = config.rollout
    rewards = RewardResolver(config, client_factory=_reward_client)
    default_reward = rewards.resolve(ro.reward)  # a bad spec fails the start
    environment = resolve_environment(ro.environment) if ro.environment else None
    if tokenizer is None:
        tokenizer = load_tokenizer(config.model.tokenizer_path or config.model.path)
    texts = Texts(tokenizer, ChatTemplate.from_config(tokenizer, config))
    started = time.monotonic()
    engine = engine if engine is not None else build_engine(config, texts)
    log.info("startup: %s engine ready in %.2fs", engine.name, time.monotonic() - started)
    if engine.compute_device is not None:
        limit_cpu_threads(ro.cpu_threads, engine.compute_device)
    agents = open_agents(config, texts=texts, engine=engine, replica=replica)  # rollout.openai_api
    source: SampleSource = (
        EpisodeSource(
            config,
            engine=engine,
            texts=texts,
            environment=environment,
            default_reward=default_reward,
            resolve=rewards.resolve,
        )
        if environment is not None
        else agent_source(config, agents, default_reward, rewards.resolve)
        if agents is not None and agents.plays
        else SingleTurn(config, engine=engine, texts=texts, default_reward=default_reward, resolve=rewards.resolve)
    )
    producer = f"rollout-{replica}"
    groups = ("actor", "critic") if config.algorithm.uses_critic else ("actor",)
    return RolloutParts(
        config=config,
        replica=replica,
        producer=producer,
        stream=stream_key(config.redis.stream_prefix, config.run_name),
        texts=texts,
        engine=engine,
        source=source,
        writer=BatchWriter(config, producer=producer, groups=groups, client=redis_client),
        weights=WeightReceipt(config, engine=engine, replica=replica),
        recent=RecentCalls(),
        agents=agents,
    )


def open_agents(config: TandemConfig, *, texts: Texts, engine: Engine, replica: int) -> AgentRollout | None:
    """The OpenAI-compatible endpoint when rollout.openai_api.enabled (its packages are the `agents` extra)."""
    if not config.rollout.openai_api.enabled:
        return None
    from services.rollout.agents.runner import AgentRollout

    return AgentRollout(config, texts=texts, engine=engine, replica=replica)


def agent_source(config: TandemConfig, agents: AgentRollout, default_reward: Scorer, resolve: Resolve) -> SampleSource:
    from services.rollout.agents.source import AgentSource

    return AgentSource(config, agents=agents, default_reward=default_reward, resolve=resolve)
