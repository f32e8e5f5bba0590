"""What TrainerService is made of, each part behind a small Protocol: the service decides and sequences, the parts
do. builder.py wires the real ones (DeepSpeed, Redis, the weight transports); tests/test_trainer_unit.py wires fakes
that record their calls, and runs the real service and the real rank commands over them.

    backend      the model's engine as the service sees it: offloaded or not, and its close
    rollouts     rank 0's side of Train: the named Redis entries, the batch selected from them, acks (training.py)
    handoffs     the critic's values of the rollout it trained last, for the actor (training.TrainStep)
    checkpoints  where a Save goes, whether it is there already, what a Load reads (checkpointing.py)
    weights      the weight-sync plan and its checksums (publishing.py)
    ledger       the exactly-once books (ledger.py), a plain class: the real one in tests too
    ranks        every rank's half of a command (ranks.RankCommands over the parts above, on each rank)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from services.contracts.config import TandemConfig
from services.contracts.trainer_calls import TrainerRole
from services.trainer.ledger import TrainLedger
from services.trainer.ranks import Checksums, RankCommands

if TYPE_CHECKING:
    import torch

    from services.buffer.entries import BufferEntry
    from services.trainer.algo.critic import ValueHandoff
    from services.trainer.algo.selection import Selection
    from services.trainer.checkpointing import FoundCheckpoint
    from services.weights.layout import TensorSpec
    from services.weights.transport_base import WeightSyncPlan


@dataclass(frozen=True)
class World:
    """This trainer's ranks, and where rank 0 computes."""

    rank: int
    world_size: int
    device: str


class Backend(Protocol):
    @property
    def offloaded(self) -> bool: ...
    def check_offload_supported(self) -> None: ...
    def close(self) -> None: ...


class RolloutReader(Protocol):
    def read(self, entry_ids: list[str], num_batches: int) -> list[BufferEntry]: ...
    def prepare(
        self, entries: list[BufferEntry], *, rollout_id: int, max_staleness: int, use_critic_values: bool
    ) -> Selection: ...
    def commit(self, rollout_id: int, entry_ids: list[str], handoff: ValueHandoff | None) -> None: ...


class Handoffs(Protocol):
    def handoff_for(self, rollout_id: int) -> ValueHandoff | None: ...


class CheckpointPlaces(Protocol):
    def save_dir(self, rollout_id: int, path: str = "") -> Path: ...
    def holds_step(self, directory: Path, step: int) -> bool: ...
    def find(self, path: str = "") -> FoundCheckpoint | None: ...
    def restore(self, found: FoundCheckpoint) -> None: ...


class WeightPlans(Protocol):
    @property
    def trainer_id(self) -> str: ...
    def specs(self) -> list[TensorSpec]: ...
    def iter_named_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...
    def check_request(self, *, engine_world_size: int) -> None: ...
    def prepare(
        self, *, version: int, transport: str, engine_world_size: int, verify: bool, verify_by_bucket: bool = False
    ) -> WeightSyncPlan: ...
    def add_checksums(self, plan: WeightSyncPlan, sums: Checksums, *, seconds: float) -> None: ...
    def check_prepared(self, version: int) -> None: ...
    def forget_plan(self) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class TrainerParts:
    config: TandemConfig
    role: TrainerRole
    world: World
    backend: Backend
    rollouts: RolloutReader
    handoffs: Handoffs
    checkpoints: CheckpointPlaces
    weights: WeightPlans
    ledger: TrainLedger
    ranks: RankCommands
    unloaded: Path | None  # a checkpoint written before this trainer started and not loaded yet: Train waits for Load
