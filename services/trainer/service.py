"""TrainerService: the trainer's behaviour as a plain Python object (the gRPC servicer is a thin adapter).

It takes its parts from one builder (builder.build_trainer; parts.py names each part's Protocol), decides, and runs
each step on every rank as a typed command (`ranks.RankCommands`: relayed to the other ranks, executed in lockstep).
Rank 0 owns the public methods; ranks > 0 run `serve_worker()`. It takes and returns the frozen dataclasses of
services/contracts/trainer_calls.py. The exactly-once guards live here: a Train of a recorded rollout replays its
result, entries trained before are skipped, a Save of a step already saved is not written twice, a trainer started
beside checkpoints trains only after its Load, and every command runs with the model onloaded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from services.contracts.errors import FailedPrecondition
from services.contracts.trainer_calls import (
    LoadRequest,
    LoadResult,
    PublishRequest,
    PublishResult,
    SaveRequest,
    SaveResult,
    TrainerStatus,
    TrainRequest,
    TrainResult,
    WeightSyncRequest,
)
from services.contracts.weight_plan import WeightSyncPlan
from services.telemetry.tracing import set_attributes, span
from services.tensors.devices import cuda_reserved_bytes
from services.trainer.commands import Load, Offload, Onload, PublishWeights, Save, Train, WeightChecksums
from services.trainer.parts import TrainerParts
from services.trainer.ranks import RankCommands
from services.trainer.training import check_train_request

if TYPE_CHECKING:
    import torch

    from services.buffer.entries import BufferEntry
    from services.weights.layout import TensorSpec
    from services.weights.transport_base import WeightSyncPlan

log = logging.getLogger(__name__)


class TrainerService:
    def __init__(self, parts: TrainerParts):
        self.parts = parts
        self.config, self.role, self.world = parts.config, parts.role, parts.world
        self.ledger = parts.ledger  # rank 0's ledger is authoritative: checkpoints hold it
        self.ranks = RankCommands(parts)
        self._lock = threading.Lock()
        # A trainer (re)started where checkpoints exist must Load before it trains: otherwise a coordinator
        # that outlived the old process would continue its run on the initial weights.
        self._unloaded = parts.unloaded

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def trainer_id(self) -> str:
        return self.parts.weights.trainer_id

    def weight_specs(self) -> list[TensorSpec]:
        return self.parts.weights.specs()

    def iter_named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors. Under ZeRO-3 a collective: every rank must exhaust it in lockstep."""
        return self.parts.weights.iter_named_weights()

    def serve_worker(self) -> None:
        """Ranks > 0: execute relayed commands until rank 0 says shutdown."""
        self.ranks.serve()

    def close(self) -> None:
        if self.rank == 0:
            self.ranks.shutdown()
        self.parts.weights.close()
        self.parts.backend.close()

    def _ensure_onloaded(self) -> None:
        if self.parts.backend.offloaded:
            self.ranks.run(Onload())

    # ---- Train ------------------------------------------------------------------------------------

    def train(self, request: TrainRequest) -> TrainResult:
        rollout_id, entry_ids, use_critic_values = request.rollout_id, request.entry_ids, request.use_critic_values
        with self._lock:
            if self.ledger.is_recorded(rollout_id):
                reply = self.ledger.replay(rollout_id)
                self._commit(rollout_id, list(reply.entry_ids))  # the first ack or hand-off may have been lost
                return reply
            check_train_request(
                self.config,
                role=self.role,
                rollout_id=rollout_id,
                num_entry_ids=len(entry_ids),
                num_batches=request.num_batches,
                use_critic_values=use_critic_values,
                unloaded=self._unloaded,
            )
            read_start = time.monotonic()
            fresh, skipped = self._untrained(list(entry_ids))
            entries = self.parts.rollouts.read(fresh, request.num_batches)
            read_s = time.monotonic() - read_start
            version = self.ledger.weight_version
            oldest = min((e.policy_version for e in entries), default=version)
            # Linked to the rl.sample span of every entry (its context travelled in the Redis entry).
            with span(
                "rl.train",
                parent=request.trace_context or None,
                links_from=[e.trace_context for e in entries],
                rollout_id=rollout_id,
                role=self.role,
                world_size=self.world.world_size,
                weight_version=version,
                staleness=version - oldest,
                entries=len(entries),
                bytes=sum(e.nbytes for e in entries),
            ) as sp:
                reply = self._train_entries(
                    rollout_id=rollout_id,
                    entries=entries,
                    skipped=skipped,
                    max_staleness=request.max_staleness,
                    use_critic_values=use_critic_values,
                    read_s=read_s,
                )
                set_attributes(
                    sp,
                    samples=reply.samples_trained,
                    samples_dropped_stale=reply.samples_dropped_stale,
                    samples_filtered=reply.samples_filtered,
                )
                return reply

    def _untrained(self, entry_ids: list[str]) -> tuple[list[str], list[str]]:
        """(the named entries not trained yet, those trained under another rollout id: skipped)."""
        if len(set(entry_ids)) != len(entry_ids):
            raise ValueError(f"entry_ids name an entry more than once: {entry_ids}")
        fresh, skipped = self.ledger.split(entry_ids)
        if entry_ids and not fresh:
            raise FailedPrecondition(
                f"entries {skipped} were already trained (rollout "
                f"{self.ledger.rollouts_of(skipped)}); nothing new to train"
            )
        return fresh, skipped

    def _train_entries(
        self,
        *,
        rollout_id: int,
        entries: list[BufferEntry],
        skipped: list[str],
        max_staleness: int,
        use_critic_values: bool,
        read_s: float,
    ) -> TrainResult:
        start = time.monotonic()
        selection = self.parts.rollouts.prepare(
            entries, rollout_id=rollout_id, max_staleness=max_staleness, use_critic_values=use_critic_values
        )
        prepare_s = time.monotonic() - start
        batch, dropped = selection.batch, selection.dropped_stale
        entry_ids = tuple(e.entry_id for e in entries)
        metrics: dict[str, float] = {}
        step = self.ledger.step
        if batch.num_samples:
            self._ensure_onloaded()
            metrics = self.ranks.run(Train(rollout_id=rollout_id, entry_ids=entry_ids, batch=batch))
            step += 1
        metrics.update(
            selection.metrics, samples_dropped_stale=float(dropped), entries_skipped_duplicate=float(len(skipped))
        )
        # where the Train call's time went on the trainer (the update's own part is perf/train_update_s)
        metrics.update(
            {
                "perf/train_read_s": read_s,
                "perf/train_prepare_s": prepare_s,
                "perf/train_call_s": read_s + time.monotonic() - start,
            }
        )
        # Filtered samples are acknowledged with their entries below: used by this step, never trained again.
        reply = TrainResult(
            rollout_id=rollout_id,
            step=step,
            metrics=metrics,
            entry_ids=entry_ids,
            samples_trained=batch.num_samples,
            samples_dropped_stale=dropped,
            samples_filtered=selection.filtered,
            time_s=time.monotonic() - start,
        )
        self.ledger.record(rollout_id, reply)
        self._commit(rollout_id, list(entry_ids))
        log.info(
            "rollout %d: step %d, %d samples (%d stale dropped, %d filtered), loss %.5f",
            rollout_id,
            step,
            batch.num_samples,
            dropped,
            selection.filtered,
            metrics.get("loss", float("nan")),
        )
        return reply

    def _commit(self, rollout_id: int, entry_ids: list[str]) -> None:
        self.parts.rollouts.commit(rollout_id, entry_ids, self.parts.step.handoff_for(rollout_id))

    # ---- Save / Load ------------------------------------------------------------------------------

    def save(self, request: SaveRequest) -> SaveResult:
        start, rollout_id = time.monotonic(), request.rollout_id
        if rollout_id < 0:
            raise ValueError(f"Save: rollout_id must be >= 0, got {rollout_id}")
        with self._lock, span("rl.save", rollout_id=rollout_id, role=self.role):
            checkpoints = self.parts.checkpoints
            directory = checkpoints.save_dir(rollout_id, request.path)
            if checkpoints.holds_step(directory, self.ledger.step):
                log.info("checkpoint %s already holds step %d", directory, self.ledger.step)  # a retried Save
            else:
                self._ensure_onloaded()
                self.ranks.run(
                    Save(
                        directory=str(directory),
                        rollout_id=rollout_id,
                        export_hf=request.export_hf or self.config.trainer.export_hf_on_save,
                        extra_state=dict(request.extra_state),
                    )
                )
            hf = directory / "hf"
            return SaveResult(
                path=str(directory),
                hf_path=str(hf) if hf.is_dir() else "",
                step=self.ledger.step,
                time_s=time.monotonic() - start,
            )

    def load(self, request: LoadRequest) -> LoadResult:
        with self._lock:
            found = self.parts.checkpoints.find(request.path)
            if found is None:
                return LoadResult(loaded=False)
            self._ensure_onloaded()
            self.ranks.run(Load(directory=str(found.directory)))
            self.parts.checkpoints.restore(found)
            self._unloaded = None
            return LoadResult(
                loaded=True,
                path=str(found.directory),
                rollout_id=found.rollout_id,
                step=self.ledger.step,
                weight_version=self.ledger.weight_version,
                extra_state=found.extra_state,
            )

    # ---- weights ----------------------------------------------------------------------------------

    def prepare_weight_sync(self, request: WeightSyncRequest) -> WeightSyncPlan:
        weights = self.parts.weights
        weights.check_request(engine_world_size=request.engine_world_size)
        with self._lock:
            self._ensure_onloaded()
            announced = weights.prepare(request)
            if request.verify:
                start = time.monotonic()
                sums = self.ranks.run(WeightChecksums(by_bucket=request.verify_by_bucket))
                announced = weights.add_checksums(announced, sums, seconds=time.monotonic() - start)
            return announced

    def publish_weights(self, request: PublishRequest) -> PublishResult:
        version = request.version
        with self._lock:
            self.parts.weights.check_prepared(version)
            with span("rl.sync", weight_version=version, role=self.role) as sp:
                stats = self.ranks.run(PublishWeights(version=version))
                set_attributes(sp, bytes=int(stats.bytes))
            self.ledger.weight_version = version
            self.parts.weights.forget_plan()
            return PublishResult(version=version, bytes_sent=int(stats.bytes), time_s=float(stats.seconds))

    # ---- offload / state --------------------------------------------------------------------------

    def offload(self) -> str:
        with self._lock:
            self.parts.backend.check_offload_supported()  # here, before any rank is asked to
            return self.ranks.run(Offload())

    def onload(self) -> str:
        with self._lock:
            return self.ranks.run(Onload())

    def get_state(self) -> TrainerStatus:
        return TrainerStatus(
            role=self.role,
            step=self.ledger.step,
            last_rollout_id=self.ledger.last_rollout_id,
            weight_version=self.ledger.weight_version,
            world_size=self.world.world_size,
            zero_stage=self.config.trainer.zero_stage,
            offloaded=self.parts.backend.offloaded,
            device=self.world.device,
            samples_trained=self.ledger.samples_trained,
            gpu_memory_reserved_bytes=cuda_reserved_bytes(),
        )
