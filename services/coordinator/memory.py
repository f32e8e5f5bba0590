"""Who holds the GPU memory when, for trainer and engines sharing GPUs: loop.offload_train hands the trainer's
memory back after each step; loop.offload_rollout (sync mode) has the engines release theirs while the trainer
trains and take it back around the weight sync (weights first, then the KV cache and CUDA graphs)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from services.coordinator.seams import Clock, RolloutPoolApi, TrainerApi
from services.telemetry.tracing import span

GIB = 2**30
ENGINE_WEIGHTS = ("weights",)  # what a weight sync writes into
ENGINE_CACHES = ("kv_cache", "cuda_graph")  # what generation needs besides the weights
ENGINE_TAGS = frozenset(ENGINE_WEIGHTS + ENGINE_CACHES)


class MemoryMoves:
    def __init__(
        self, *, trainer: TrainerApi, pool: RolloutPoolApi, offload_train: bool, offload_rollout: bool, clock: Clock
    ):
        self.trainer = trainer
        self.pool = pool
        self.offload_train = offload_train
        self.offload_rollout = offload_rollout
        self.clock = clock
        self.trainer_offloaded = False
        self.engines_released: set[str] = set()  # memory tags the engines gave up

    def release_engines(self, metrics: dict[str, float], *, first: Callable[[], None]) -> None:
        """offload_rollout: the engines give their memory to the trainer for the step. `first` waits for what
        still runs on them (a pending eval); no generation runs now (sync mode)."""
        if not self.offload_rollout:
            return
        with self._timed(metrics, "perf/rollout_release_s"):
            first()
            self.pool.release_memory()
        self.engines_released = set(ENGINE_TAGS)
        held, freed = self.pool.gpu_memory()
        metrics["memory/rollout_gpu_gb_released"] = held / GIB  # what the engines' own processes still hold
        metrics["memory/rollout_gpu_gb_freed"] = freed / GIB  # what the release gave back (SGLang: device-wide)

    def resume_engines(self, tags: tuple[str, ...], metrics: dict[str, float]) -> None:
        wanted = tuple(t for t in tags if t in self.engines_released)
        if wanted:
            with self._timed(metrics, "perf/rollout_resume_s"), span("rl.rollout_resume", tags=",".join(wanted)):
                self.pool.resume_memory(wanted)
            self.engines_released -= set(wanted)

    def offload_trainer(self, metrics: dict[str, float]) -> None:
        """offload_train: the trainer hands its memory back once the step is done with it (train and sync)."""
        if not self.offload_train:
            return
        metrics["memory/trainer_gpu_gb_training"] = self.trainer.get_state().gpu_memory_reserved_bytes / GIB
        with self._timed(metrics, "perf/trainer_offload_s"), span("rl.offload"):
            self.trainer.offload()
        self.trainer_offloaded = True
        metrics["memory/trainer_gpu_gb_offloaded"] = self.trainer.get_state().gpu_memory_reserved_bytes / GIB

    def onload_trainer(self, metrics: dict[str, float]) -> None:
        if self.trainer_offloaded:
            with self._timed(metrics, "perf/trainer_onload_s"), span("rl.onload"):
                self.trainer.onload()
            self.trainer_offloaded = False

    @contextlib.contextmanager
    def _timed(self, metrics: dict[str, float], key: str) -> Iterator[None]:
        """Adds the block's seconds to metrics[key] (a step may move memory more than once)."""
        t = self.clock.monotonic()
        try:
            yield
        finally:
            metrics[key] = metrics.get(key, 0.0) + self.clock.monotonic() - t
