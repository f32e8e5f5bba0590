"""The coordinator's parts, built once per process: the gRPC clients of the trainer, the critic and the rollout
replicas, the replica pool, the weight sync, the data, the Redis buffer, the trackers and the worker threads.
`Coordinator` (loop.py) takes the frozen `CoordinatorParts` and runs the loop over them; tests/test_coordinator_loop.py
builds parts from fakes."""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from services.buffer.stream import RolloutBuffer, connect, stream_key
from services.contracts.config import TandemConfig
from services.coordinator.clients import make_clients
from services.coordinator.data import DataSource, PromptRecord, load_eval_prompts
from services.coordinator.policy import sync_pause_mode
from services.coordinator.pool import RolloutPool
from services.coordinator.retry import TRAIN_RETRY, RetryPolicy, generate_retry
from services.coordinator.seams import (
    BufferApi,
    Clock,
    PromptSource,
    RolloutPoolApi,
    SystemClock,
    TrainerApi,
    WeightSyncApi,
)
from services.coordinator.sync import WeightSync
from services.telemetry.events import EventLog
from services.telemetry.tracker_registry import make_trackers
from services.telemetry.trackers import Tracker


@dataclass(frozen=True)
class CoordinatorParts:
    config: TandemConfig
    run_dir: Path
    trainer: TrainerApi
    critic: TrainerApi | None  # PPO's critic trainer
    pool: RolloutPoolApi
    sync: WeightSyncApi
    data: PromptSource
    buffer: BufferApi | None  # the run's Redis buffer: resume bookkeeping and critic-only steps
    trackers: list[Tracker]
    eval_prompts: Callable[[], list[PromptRecord]]
    generations: Executor  # runs pool.generate beside the loop
    evals: Executor  # runs evals beside the loop
    events: EventLog = field(default_factory=EventLog)
    clock: Clock = field(default_factory=SystemClock)
    train_retry: RetryPolicy = TRAIN_RETRY


def run_buffer(config: TandemConfig) -> RolloutBuffer | None:
    """The run's Redis stream as the coordinator reads it (None without redis.url)."""
    if not config.redis.url:
        return None
    groups = ("actor", "critic") if config.algorithm.uses_critic else ("actor",)
    return RolloutBuffer(
        connect(config.redis.url, password=config.redis.password, timeout_s=config.services.timeouts.redis_socket_s),
        stream_key(config.redis.stream_prefix, config.run_name),
        groups=groups,
    )


def build_coordinator(config: TandemConfig, *, run_dir: Path) -> CoordinatorParts:
    """The real parts: gRPC clients, the Redis buffer, the data file."""
    data = DataSource.from_config(config.data, batch_size=config.rollout.rollout_batch_size)
    trainer, critic, replicas = make_clients(config)
    buffer = run_buffer(config)
    pool = RolloutPool(
        replicas, retry=generate_retry(config.loop.max_retries), discard=buffer.delete if buffer is not None else None
    )
    sync = WeightSync(
        trainer=trainer,
        pool=pool,
        config=config.weights,
        trainer_offloads=config.loop.offload_train,
        pause_mode=sync_pause_mode(config.rollout.inflight_update),
    )
    return CoordinatorParts(
        config=config,
        run_dir=run_dir,
        trainer=trainer,
        critic=critic,
        pool=pool,
        sync=sync,
        data=data,
        buffer=buffer,
        trackers=make_trackers(config.tracing.trackers, run_dir=run_dir, run_name=config.run_name),
        eval_prompts=functools.partial(load_eval_prompts, config.data),
        # fully_async keeps one generation per replica in flight, plus the one the trainer waits for; streaming
        # one Generate per group in flight
        generations=ThreadPoolExecutor(
            max_workers=config.streaming_groups_in_flight if config.loop.mode == "streaming" else pool.size + 1,
            thread_name_prefix="generate",
        ),
        evals=ThreadPoolExecutor(max_workers=1, thread_name_prefix="eval"),
    )
