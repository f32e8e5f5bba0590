"""PrepareWeightSync / PublishWeights: the actor's weights to the rollout engines, one publisher per transport.

Rank 0 prepares a plan with the publisher of the request's transport (the plan names every tensor's bucket) and
keeps it: the publish needs exactly that plan. The weights are iterated on every rank in lockstep (under ZeRO-3
each group of parameters is gathered, a collective); only rank 0 sends them. After every publish, failed or not,
each rank snapshots the weights for the old actor (keep_old_actor), again in lockstep.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from services.contracts.config import TandemConfig
from services.contracts.errors import FailedPrecondition
from services.contracts.trainer_calls import WeightSyncRequest
from services.contracts.weight_plan import WeightSyncPlan
from services.trainer.algo.old_actor import OldActor
from services.trainer.model.backend import TORCH_DTYPES, DeepSpeedBackend
from services.trainer.model.weight_export import iter_named_weights, weight_specs
from services.weights import SyncStats, TensorSpec, WeightPublisher
from services.weights.checksums import named_bucket_checksums, named_checksums, with_checksums
from services.weights.layout import layout_from_plan

MAX_ENGINE_RANKS = 4096  # a weight-sync group larger than this is a malformed request


class WeightPublishing:
    def __init__(
        self,
        config: TandemConfig,
        *,
        role: str,
        run_dir: Path,
        rank: int,
        backend: DeepSpeedBackend,
        old_actor: OldActor | None,
    ):
        self.config, self.role, self.run_dir, self.rank = config, role, run_dir, rank
        self.backend, self.old_actor = backend, old_actor
        self.export_dtype = TORCH_DTYPES[config.model.dtype]
        self._publishers: dict[str, WeightPublisher] = {}  # rank 0, made on first use of each transport
        self._plan: WeightSyncPlan | None = None

    @property
    def trainer_id(self) -> str:
        configured = self.config.weights.trainer_id if self.role == "actor" else None
        return configured or f"{self.config.run_name}/{self.role}"

    def specs(self) -> list[TensorSpec]:
        """TensorSpec per exported tensor (HF names, export dtype, full shapes), in iteration order; with LoRA
        the base model's names and shapes (the weights are sent merged)."""
        return weight_specs(self.backend.exported_tensors(), dtype=self.export_dtype)

    def iter_named_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors (in the export dtype unless given). Under ZeRO-3 a collective: every rank must
        exhaust it in lockstep."""
        bucket = int(self.config.weights.bucket_mb * (1 << 20))
        return iter_named_weights(
            self.backend.exported_tensors(),
            dtype=dtype or self.export_dtype,
            zero3=self.backend.zero_stage == 3,
            group_bytes=bucket,
        )

    def _publisher(self, transport: str) -> WeightPublisher:
        if transport not in self._publishers:
            rollout = self.config.rollout
            self._publishers[transport] = WeightPublisher(
                transport=transport,
                config=self.config.weights,
                run_dir=self.run_dir,
                trainer_id=self.trainer_id,
                sglang_load_format=rollout.sglang.weight_load_format if rollout.engine == "sglang" else None,
            )
        return self._publishers[transport]

    # ---- rank 0 -------------------------------------------------------------------------------------

    def check_request(self, *, engine_world_size: int) -> None:
        if self.role != "actor":
            raise FailedPrecondition("the critic has no weights to publish to rollout engines")
        if not 1 <= engine_world_size <= MAX_ENGINE_RANKS:
            raise ValueError(f"engine_world_size must be in 1..{MAX_ENGINE_RANKS}, got {engine_world_size}")

    def prepare(self, request: WeightSyncRequest) -> WeightSyncPlan:
        """The plan the publish will follow (kept; the caller annotates copies of it for the engines)."""
        plan = self._publisher(request.transport or self.config.weights.transport).prepare(
            self.specs(),
            version=request.version,
            engine_world_size=request.engine_world_size,
            verify=request.verify,
            verify_by_bucket=request.verify_by_bucket,
        )
        self._plan = plan
        return plan

    @staticmethod
    def add_checksums(plan: WeightSyncPlan, sums: dict[str, str] | list[str], *, seconds: float) -> WeightSyncPlan:
        """`plan` announcing the trainer's checksums (per bucket: a list; per tensor: a dict)."""
        return with_checksums(plan, sums, seconds=seconds)

    def check_prepared(self, version: int) -> None:
        if self._plan is None or self._plan.version != version:
            raise FailedPrecondition(f"PublishWeights(v{version}) needs PrepareWeightSync(v{version}) first")

    def forget_plan(self) -> None:
        self._plan = None

    # ---- every rank ---------------------------------------------------------------------------------

    def checksums(self, *, by_bucket: bool = False) -> dict[str, str] | list[str] | None:
        """The WeightChecksums command: rank 0 gets them, per tensor (name -> checksum) or per bucket of the plan
        it prepared (in bucket order)."""
        named = self.iter_named_weights()
        try:
            if self.rank != 0:
                return None
            if not by_bucket:
                return named_checksums(named)
            if self._plan is None:
                raise FailedPrecondition("checksums by bucket need PrepareWeightSync's plan")
            return named_bucket_checksums(layout_from_plan(self._plan), named, where="checksums (trainer)")
        finally:
            _drain(named)

    def publish(self, version: int) -> SyncStats | None:
        """The PublishWeights command: rank 0 sends and gets the stats."""
        try:
            return self._send()
        finally:  # every rank, even when the publish failed: under ZeRO-3 the snapshot is a collective
            if self.old_actor is not None:
                self.old_actor.take_snapshot(
                    version=version,
                    weights=self.iter_named_weights(self.old_actor.dtype),
                    optimizer_step=self.backend.global_steps,
                )

    def _send(self) -> SyncStats | None:
        named = self.iter_named_weights()
        try:
            if self.rank != 0:
                return None
            if self._plan is None:
                raise FailedPrecondition("PublishWeights needs PrepareWeightSync first")
            return self._publisher(self._plan.transport or self.config.weights.transport).publish(self._plan, named)
        finally:
            _drain(named)

    def release(self) -> None:
        """Before an Offload: transports drop their buffers (cuda_ipc); the next sync allocates them again."""
        for publisher in self._publishers.values():
            publisher.release()

    def close(self) -> None:
        for publisher in self._publishers.values():
            publisher.close()


def _drain(named: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Walks the rest of a weight iterator: a failed send must still finish the collective gathers on every rank."""
    for _ in named:
        pass
