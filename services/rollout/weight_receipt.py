"""A rollout replica's side of a weight update: pause for it, take part in the trainer's transfer, and the receiver
(services/weights) that the transfers go through, made on the first sync and released before GPU memory is."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from services.contracts.config import TandemConfig
from services.contracts.errors import FailedPrecondition
from services.contracts.rollout_calls import PrepareRequest, PrepareResult, ReceiveResult
from services.rollout.engines.engine_errors import EngineUnavailable
from services.rollout.engines.interface import Engine
from services.telemetry import tracing

if TYPE_CHECKING:
    from services.contracts.weight_plan import WeightSyncPlan
    from services.weights.front_ends import WeightReceiver

log = logging.getLogger(__name__)


class WeightReceipt:
    def __init__(self, config: TandemConfig, *, engine: Engine, replica: int):
        self.config, self.engine, self.replica = config, engine, replica
        self._receiver: WeightReceiver | None = None  # made on the first weight sync

    def prepare(self, request: PrepareRequest) -> PrepareResult:
        """Pauses generation for the update (the coordinator calls Resume afterwards)."""
        mode = request.pause_mode or "drain"
        self.engine.pause(mode, timeout_s=self.config.weights.timeout_s)
        log.info("paused (%s) for weight update to version %d", mode, request.version)
        return PrepareResult(ready=True, engine_ranks=self.engine.engine_ranks)

    def receive(self, plan: WeightSyncPlan, rank_offset: int) -> ReceiveResult:
        """Takes part in the transfer the trainer announced in `plan` (as `checked_plan` returned it), in place
        into the engine's weights."""
        with tracing.span(
            "rl.sync", weight_version=plan.version, transport=plan.transport, side="rollout", replica=self.replica
        ):
            try:
                stats = self.engine.receive_weights(plan, rank_offset=rank_offset, receiver=self.receiver())
            except EngineUnavailable as exc:
                raise FailedPrecondition(str(exc)) from exc
        return ReceiveResult(
            version=self.engine.weight_version,
            checksums=dict(stats.checksums),
            bytes_received=stats.bytes,
            time_s=stats.seconds,
            bucket_checksums=stats.bucket_checksums,
            checksum_s=stats.checksum_seconds,
        )

    def checked_plan(self, plan: WeightSyncPlan, rank_offset: int) -> WeightSyncPlan:
        """The plan as this replica takes part in it: refused before this engine contacts any address in it when
        it names another trainer; its timeout clamped to weights.timeout_s (a caller must not hold the engine
        longer than the config allows)."""
        if rank_offset < 0:
            raise ValueError(f"ReceiveWeights: rank_offset must be >= 0, got {rank_offset}")
        accepted = self.config.weights.trainer_id
        if accepted and plan.trainer_id != accepted:
            raise PermissionError(
                f"ReceiveWeights v{plan.version}: trainer {plan.trainer_id!r} is not the accepted "
                f"trainer {accepted!r} (weights.trainer_id)"
            )
        limit = self.config.weights.timeout_s
        if not 0 < plan.timeout_s <= limit:
            plan = replace(plan, timeout_s=limit)
        return plan

    def receiver(self) -> WeightReceiver:
        if self._receiver is None:
            from services.weights import WeightReceiver

            self._receiver = WeightReceiver(
                accepted_trainer_id=self.config.weights.trainer_id,
                timeout_s=self.config.weights.timeout_s,
                refuse_timeout_s=self.config.services.timeouts.probe_s,
            )
        return self._receiver

    def release(self) -> None:
        """Before GPU memory is released: a kept mapping would keep the trainer's freed buffers on the GPU."""
        if self._receiver is not None:
            self._receiver.release()

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
