"""What TrainerService is made of: five parts, each behind one Protocol, each under one name. The service decides and
sequences, the parts do; the rank commands (ranks.py) run on every rank over the same parts. builder.py wires the
real ones (DeepSpeed, Redis, the weight transports); tests/test_trainer_unit.py wires fakes that record their
calls, and runs the real service and the real rank commands over them.

    backend      Backend      the model under DeepSpeed (model/backend.py): offload and onload, close
    rollouts     Rollouts     rank 0's Redis side of Train: the named entries, the batch selected, acks (training.py)
    step         Step         every rank's Train step, and the critic's values it leaves for the actor (training.py)
    checkpoints  Checkpoints  Save and Load on every rank; where a Save goes, what a Load reads (checkpointing.py)
    weights      Weights      the weight-sync plan, its checksums and the publish on every rank (publishing.py)
and the plain objects beside them: the ledger (ledger.py: the exactly-once books, the real one in tests too) and
the relay that carries commands to the other ranks (dist.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from services.contracts.config import TandemConfig
from services.contracts.trainer_calls import TrainerRole, WeightSyncRequest
from services.contracts.weight_plan import WeightSyncPlan
from services.trainer.dist import CommandRelay
from services.trainer.ledger import TrainLedger

if TYPE_CHECKING:
    import torch

    from services.buffer.entries import BufferEntry
    from services.trainer.algo.critic import ValueHandoff
    from services.trainer.algo.selection import Selection
    from services.trainer.checkpointing import FoundCheckpoint
    from services.trainer.commands import Load, Save, Train
    from services.weights.layout import TensorSpec
    from services.weights.transport_base import SyncStats, WeightSyncPlan

# What WeightChecksums answers on rank 0: name -> checksum, or one checksum per bucket of the plan.
Checksums = dict[str, str] | list[str]


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
    def offload(self) -> str: ...
    def onload(self) -> str: ...
    def close(self) -> None: ...


class Rollouts(Protocol):
    def read(self, entry_ids: list[str], num_batches: int) -> list[BufferEntry]: ...
    def prepare(
        self, entries: list[BufferEntry], *, rollout_id: int, max_staleness: int, use_critic_values: bool
    ) -> Selection: ...
    def commit(self, rollout_id: int, entry_ids: list[str], handoff: ValueHandoff | None) -> None: ...


class Step(Protocol):
    def run(self, command: Train) -> dict[str, float]: ...
    def handoff_for(self, rollout_id: int) -> ValueHandoff | None: ...


class Checkpoints(Protocol):
    def save_dir(self, rollout_id: int, path: str = "") -> Path: ...
    def holds_step(self, directory: Path, step: int) -> bool: ...
    def find(self, path: str = "") -> FoundCheckpoint | None: ...
    def restore(self, found: FoundCheckpoint) -> None: ...
    def write(self, command: Save) -> None: ...
    def read(self, command: Load) -> None: ...


class Weights(Protocol):
    @property
    def trainer_id(self) -> str: ...
    def specs(self) -> list[TensorSpec]: ...
    def iter_named_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...
    def check_request(self, *, engine_world_size: int) -> None: ...
    def prepare(self, request: WeightSyncRequest) -> WeightSyncPlan: ...
    def add_checksums(self, plan: WeightSyncPlan, sums: Checksums, *, seconds: float) -> WeightSyncPlan: ...
    def check_prepared(self, version: int) -> None: ...
    def forget_plan(self) -> None: ...
    def checksums(self, *, by_bucket: bool = False) -> Checksums | None: ...  # None on ranks > 0
    def publish(self, version: int) -> SyncStats | None: ...  # None on ranks > 0
    def release(self) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class TrainerParts:
    config: TandemConfig
    role: TrainerRole
    world: World
    backend: Backend
    rollouts: Rollouts
    step: Step
    checkpoints: Checkpoints
    weights: Weights
    ledger: TrainLedger
    relay: CommandRelay
    unloaded: Path | None  # a checkpoint written before this trainer started and not loaded yet: Train waits for Load
