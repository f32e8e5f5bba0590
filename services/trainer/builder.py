"""The real trainer's parts, built once per process in the order they need each other: the process group, the
DeepSpeed engine, the old actor, then the five parts TrainerService and the rank commands use (parts.py names
each). `build_trainer(...)` returns the frozen TrainerParts that TrainerService takes; tests and benchmarks that
look into the model find the concrete objects behind the parts (the backend is a DeepSpeedBackend, the step a
TrainStep holding the old actor)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from services.contracts import checkpoints
from services.contracts.config import TandemConfig
from services.contracts.trainer_calls import TRAINER_ROLES, TrainerRole
from services.tensors.devices import limit_cpu_threads
from services.trainer.algo.old_actor import OldActor, snapshots_to_keep
from services.trainer.checkpointing import Checkpointer
from services.trainer.dist import CommandRelay, init_process_group
from services.trainer.ledger import TrainLedger
from services.trainer.model.backend import DeepSpeedBackend, param_dtype
from services.trainer.parts import TrainerParts, World
from services.trainer.publishing import WeightPublishing
from services.trainer.training import ModelLimits, RolloutSource, TrainStep

log = logging.getLogger(__name__)


def check_role(config: TandemConfig, role: str) -> TrainerRole:
    for known in TRAINER_ROLES:
        if role == known:
            if role == "critic" and not config.algorithm.uses_critic:
                raise ValueError("--role critic needs algorithm.advantage_estimator: gae")
            return known
    raise ValueError(f"trainer role must be one of {TRAINER_ROLES}, got {role!r}")


def build_trainer(config: TandemConfig, *, run_dir: Path, role: str = "actor") -> TrainerParts:
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
    ledger = TrainLedger()
    run_dir = Path(run_dir)
    step = TrainStep(config, role=checked, rank=dist.rank, backend=backend, old_actor=old_actor)
    weights = WeightPublishing(
        config, role=checked, run_dir=run_dir, rank=dist.rank, backend=backend, old_actor=old_actor
    )
    return TrainerParts(
        config=config,
        role=checked,
        world=World(rank=dist.rank, world_size=dist.world_size, device=str(dist.device)),
        backend=backend,
        rollouts=RolloutSource(config, role=checked, ledger=ledger, limits=ModelLimits.of(backend.hf_model.config)),
        step=step,
        checkpoints=Checkpointer(
            config,
            role=checked,
            run_dir=run_dir,
            dist=dist,
            backend=backend,
            ledger=ledger,
            old_actor=old_actor,
            weights=weights,
        ),
        weights=weights,
        ledger=ledger,
        relay=CommandRelay(rank=dist.rank, world_size=dist.world_size),
        unloaded=checkpoints.latest_checkpoint(config, run_dir=run_dir, role=checked),
    )
