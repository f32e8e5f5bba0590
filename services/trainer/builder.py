"""The real trainer's parts, built once per process in the order they need each other: the process group, the
DeepSpeed engine, the old actor, then the parts TrainerService and the rank commands use (parts.py says which is
which). `build_trainer(...).parts()` is what TrainerService takes; the built object keeps the concrete parts for
benchmarks and tests that look into the model."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from services.contracts import checkpoints
from services.contracts.config import TandemConfig
from services.contracts.trainer_calls import TRAINER_ROLES, TrainerRole
from services.tensors.devices import limit_cpu_threads
from services.trainer.algo.old_actor import OldActor, snapshots_to_keep
from services.trainer.checkpointing import Checkpointer
from services.trainer.dist import CommandRelay, DistInfo, init_process_group
from services.trainer.ledger import TrainLedger
from services.trainer.model.backend import DeepSpeedBackend, param_dtype
from services.trainer.parts import TrainerParts, World
from services.trainer.publishing import WeightPublishing
from services.trainer.ranks import RankCommands, RankParts
from services.trainer.training import ModelLimits, RolloutSource, TrainStep

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeepSpeedTrainer:
    config: TandemConfig
    role: TrainerRole
    dist: DistInfo
    backend: DeepSpeedBackend
    old_actor: OldActor | None
    limits: ModelLimits
    ledger: TrainLedger
    rollouts: RolloutSource
    step: TrainStep
    weights: WeightPublishing
    checkpoints: Checkpointer
    ranks: RankCommands
    unloaded: Path | None

    def parts(self) -> TrainerParts:
        world = World(rank=self.dist.rank, world_size=self.dist.world_size, device=str(self.dist.device))
        return TrainerParts(
            config=self.config,
            role=self.role,
            world=world,
            backend=self.backend,
            rollouts=self.rollouts,
            handoffs=self.step,
            checkpoints=self.checkpoints,
            weights=self.weights,
            ledger=self.ledger,
            ranks=self.ranks,
            unloaded=self.unloaded,
        )


def check_role(config: TandemConfig, role: str) -> TrainerRole:
    for known in TRAINER_ROLES:
        if role == known:
            if role == "critic" and not config.algorithm.uses_critic:
                raise ValueError("--role critic needs algorithm.advantage_estimator: gae")
            return known
    raise ValueError(f"trainer role must be one of {TRAINER_ROLES}, got {role!r}")


def build_trainer(config: TandemConfig, *, run_dir: Path, role: str = "actor") -> DeepSpeedTrainer:
    checked = check_role(config, role)
    started = time.monotonic()
    dist = init_process_group(device=config.trainer.device, timeout_s=config.services.timeouts.process_group_s)
    joined = time.monotonic()
    limit_cpu_threads(config.trainer.cpu_threads, dist.device)
    backend = DeepSpeedBackend(config=config, role=checked, dist_info=dist)
    log.info(
        "startup: process group %.2fs, model + DeepSpeed engine %.2fs", joined - started, time.monotonic() - joined
    )
    old_actor = (
        OldActor(config=config, device=dist.device, dtype=param_dtype(config), keep=snapshots_to_keep(config))
        if checked == "actor" and config.algorithm.keep_old_actor
        else None
    )
    limits = ModelLimits.of(backend.hf_model.config)
    ledger = TrainLedger()
    run_dir = Path(run_dir)
    step = TrainStep(config, role=checked, rank=dist.rank, backend=backend, old_actor=old_actor)
    weights = WeightPublishing(
        config, role=checked, run_dir=run_dir, rank=dist.rank, backend=backend, old_actor=old_actor
    )
    checkpointer = Checkpointer(
        config,
        role=checked,
        run_dir=run_dir,
        dist=dist,
        backend=backend,
        ledger=ledger,
        old_actor=old_actor,
        weights=weights,
    )
    ranks = RankCommands(
        CommandRelay(rank=dist.rank, world_size=dist.world_size),
        RankParts(memory=backend, step=step, checkpoints=checkpointer, weights=weights),
    )
    return DeepSpeedTrainer(
        config=config,
        role=checked,
        dist=dist,
        backend=backend,
        old_actor=old_actor,
        limits=limits,
        ledger=ledger,
        rollouts=RolloutSource(config, role=checked, ledger=ledger, limits=limits),
        step=step,
        weights=weights,
        checkpoints=checkpointer,
        ranks=ranks,
        unloaded=checkpoints.latest_checkpoint(config, run_dir=run_dir, role=checked),
    )
