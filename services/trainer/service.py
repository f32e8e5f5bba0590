"""TrainerService: the trainer's behaviour as a plain Python object (the gRPC servicer is a thin adapter).

Rank 0 owns the public methods: it validates, decides, and runs each step on every rank as a typed command
(`commands.RankCommands`: relayed to the other ranks, executed in lockstep). Ranks > 0 run `serve_worker()`.
With one rank the relay is a no-op, so 1 and N ranks share one code path. The parts:

    ledger.TrainLedger          exactly-once bookkeeping: recorded Train results, trained entries (checkpointed)
    training.RolloutSource      rank 0's side of Train: Redis entries -> batch, acks, the PPO value hand-off
    training.TrainStep          every rank's optimizer step (actor or critic)
    checkpointing.Checkpointer  Save/Load
    publishing.WeightPublishing PrepareWeightSync/PublishWeights
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from services.buffer.stream import BufferEntry
from services.contracts import checkpoints
from services.contracts.config import TandemConfig
from services.contracts.gen.tandem.v1 import common_pb2, trainer_pb2
from services.telemetry.tracing import set_attributes, span
from services.tensors.devices import cuda_reserved_bytes, limit_cpu_threads
from services.trainer import commands
from services.trainer.backend import DeepSpeedBackend, param_dtype
from services.trainer.checkpointing import Checkpointer
from services.trainer.dist import CommandRelay, init_process_group
from services.trainer.ledger import TrainLedger
from services.trainer.old_actor import OldActor, snapshots_to_keep
from services.trainer.publishing import WeightPublishing
from services.trainer.training import ModelLimits, RolloutSource, TrainStep, check_train_request
from services.weights import TensorSpec

log = logging.getLogger(__name__)

ROLES = ("actor", "critic")


class TrainerService:
    def __init__(self, config: TandemConfig, *, run_dir: Path, role: str = "actor"):
        if role not in ROLES:
            raise ValueError(f"trainer role must be one of {ROLES}, got {role!r}")
        if role == "critic" and not config.algorithm.uses_critic:
            raise ValueError("--role critic needs algorithm.advantage_estimator: gae")
        self.config, self.role, self.run_dir = config, role, Path(run_dir)
        started = time.monotonic()
        self.dist = init_process_group(device=config.trainer.device,
                                       timeout_s=config.services.timeouts.process_group_s)
        joined = time.monotonic()
        limit_cpu_threads(config.trainer.cpu_threads, self.dist.device)
        self.backend = DeepSpeedBackend(config=config, role=role, dist_info=self.dist)
        log.info("startup: process group %.2fs, model + DeepSpeed engine %.2fs", joined - started,
                 time.monotonic() - joined)
        self.old_actor = OldActor(config=config, device=self.dist.device, dtype=param_dtype(config),
                                  keep=snapshots_to_keep(config)) \
            if role == "actor" and config.algorithm.keep_old_actor else None
        limits = ModelLimits.of(self.backend.hf_model.config)
        self.vocab_size, self.max_positions = limits.vocab_size, limits.max_positions
        self.ledger = TrainLedger()   # rank 0 is authoritative; it is what checkpoints hold
        self.rollouts = RolloutSource(config, role=role, ledger=self.ledger, limits=limits)
        self.train_step = TrainStep(config, role=role, rank=self.rank, backend=self.backend, old_actor=self.old_actor)
        self.weights = WeightPublishing(config, role=role, run_dir=self.run_dir, rank=self.rank, backend=self.backend,
                                        old_actor=self.old_actor)
        self.checkpoints = Checkpointer(config, role=role, run_dir=self.run_dir, dist=self.dist, backend=self.backend,
                                        ledger=self.ledger, old_actor=self.old_actor, weights=self.weights)
        parts = commands.RankParts(backend=self.backend, step=self.train_step, checkpoints=self.checkpoints,
                                   weights=self.weights)
        self.ranks = commands.RankCommands(CommandRelay(rank=self.rank, world_size=self.dist.world_size), parts)
        self._lock = threading.Lock()
        # A trainer (re)started where checkpoints exist must Load before it trains: otherwise a coordinator
        # that outlived the old process would continue its run on the initial weights.
        self._unloaded = checkpoints.latest_checkpoint(config, run_dir=self.run_dir, role=role)

    @property
    def rank(self) -> int:
        return self.dist.rank

    # the ledger's counters, read (and in tests set) through the service
    @property
    def step(self) -> int:
        return self.ledger.step

    @property
    def results(self) -> dict[int, trainer_pb2.TrainResponse]:
        return self.ledger.results

    @property
    def weight_version(self) -> int:
        return self.ledger.weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.ledger.weight_version = version

    @property
    def trainer_id(self) -> str:
        return self.weights.trainer_id

    def weight_specs(self) -> list[TensorSpec]:
        return self.weights.specs()

    def iter_named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors. Under ZeRO-3 a collective: every rank must exhaust it in lockstep."""
        return self.weights.iter_named_weights()

    def serve_worker(self) -> None:
        """Ranks > 0: execute relayed commands until rank 0 says shutdown."""
        self.ranks.serve()

    def close(self) -> None:
        if self.rank == 0:
            self.ranks.shutdown()
        self.weights.close()
        self.backend.close()

    def _ensure_onloaded(self) -> None:
        if self.backend.offloaded:
            self.ranks.run(commands.Onload())

    # ---- Train ------------------------------------------------------------------------------------

    def train(self, *, rollout_id: int, entry_ids: list[str] | tuple[str, ...] = (), num_batches: int = 0,
              max_staleness: int = -1, use_critic_values: bool = False,
              trace_context: dict[str, str] | None = None) -> trainer_pb2.TrainResponse:
        with self._lock:
            if self.ledger.is_recorded(rollout_id):
                reply = self.ledger.replay(rollout_id)
                self._commit(rollout_id, list(reply.entry_ids))   # the first ack or hand-off may have been lost
                return reply
            check_train_request(self.config, role=self.role, rollout_id=rollout_id, num_entry_ids=len(entry_ids),
                                num_batches=num_batches, use_critic_values=use_critic_values,
                                unloaded=self._unloaded)
            read_start = time.monotonic()
            entries, skipped = self.rollouts.read(list(entry_ids), num_batches)
            read_s = time.monotonic() - read_start
            version = self.ledger.weight_version
            oldest = min((e.policy_version for e in entries), default=version)
            # Linked to the rl.sample span of every entry (its context travelled in the Redis entry).
            with span("rl.train", parent=trace_context or None, links_from=[e.trace_context for e in entries],
                      rollout_id=rollout_id, role=self.role, world_size=self.dist.world_size,
                      weight_version=version, staleness=version - oldest,
                      entries=len(entries), bytes=sum(e.nbytes for e in entries)) as sp:
                reply = self._train_entries(rollout_id=rollout_id, entries=entries, skipped=skipped,
                                            max_staleness=max_staleness, use_critic_values=use_critic_values,
                                            read_s=read_s)
                set_attributes(sp, samples=reply.samples_trained, samples_dropped_stale=reply.samples_dropped_stale,
                               samples_filtered=reply.samples_filtered)
                return reply

    def _train_entries(self, *, rollout_id: int, entries: list[BufferEntry], skipped: list[str],
                       max_staleness: int, use_critic_values: bool, read_s: float) -> trainer_pb2.TrainResponse:
        start = time.monotonic()
        selection = self.rollouts.prepare(entries, rollout_id=rollout_id, max_staleness=max_staleness,
                                          use_critic_values=use_critic_values)
        prepare_s = time.monotonic() - start
        batch, dropped = selection.batch, selection.dropped_stale
        entry_ids = [e.entry_id for e in entries]
        metrics: dict[str, float] = {}
        step = self.ledger.step
        if batch.num_samples:
            self._ensure_onloaded()
            metrics = self.ranks.run(commands.Train(rollout_id=rollout_id, entry_ids=tuple(entry_ids), batch=batch))
            step += 1
        metrics.update(selection.metrics, samples_dropped_stale=float(dropped),
                       entries_skipped_duplicate=float(len(skipped)))
        # where the Train call's time went on the trainer (the update's own part is perf/train_update_s)
        metrics.update({"perf/train_read_s": read_s, "perf/train_prepare_s": prepare_s,
                        "perf/train_call_s": read_s + time.monotonic() - start})
        # Filtered samples are acknowledged with their entries below: used by this step, never trained again.
        reply = trainer_pb2.TrainResponse(rollout_id=rollout_id, step=step, metrics=metrics, entry_ids=entry_ids,
                                          samples_trained=batch.num_samples, samples_dropped_stale=dropped,
                                          samples_filtered=selection.filtered, time_s=time.monotonic() - start)
        self.ledger.record(rollout_id, reply)
        self._commit(rollout_id, entry_ids)
        log.info("rollout %d: step %d, %d samples (%d stale dropped, %d filtered), loss %.5f", rollout_id, step,
                 batch.num_samples, dropped, selection.filtered, metrics.get("loss", float("nan")))
        return reply

    def _commit(self, rollout_id: int, entry_ids: list[str]) -> None:
        self.rollouts.commit(rollout_id, entry_ids, self.train_step.handoff_for(rollout_id))

    # ---- Save / Load ------------------------------------------------------------------------------

    def save(self, *, rollout_id: int, path: str = "", export_hf: bool = False,
             extra_state: dict[str, str] | None = None) -> trainer_pb2.SaveResponse:
        start = time.monotonic()
        if rollout_id < 0:
            raise ValueError(f"Save: rollout_id must be >= 0, got {rollout_id}")
        with self._lock, span("rl.save", rollout_id=rollout_id, role=self.role):
            directory = self.checkpoints.save_dir(rollout_id, path)
            if self.checkpoints.holds_step(directory, self.ledger.step):
                log.info("checkpoint %s already holds step %d", directory, self.ledger.step)   # a retried Save
            else:
                self._ensure_onloaded()
                self.ranks.run(commands.Save(directory=str(directory), rollout_id=rollout_id,
                                             export_hf=export_hf or self.config.trainer.export_hf_on_save,
                                             extra_state=dict(extra_state or {})))
            hf = directory / "hf"
            return trainer_pb2.SaveResponse(path=str(directory), hf_path=str(hf) if hf.is_dir() else "",
                                            step=self.ledger.step, time_s=time.monotonic() - start)

    def load(self, *, path: str = "") -> trainer_pb2.LoadResponse:
        with self._lock:
            found = self.checkpoints.find(path)
            if found is None:
                return trainer_pb2.LoadResponse(loaded=False)
            directory, state = found
            self._ensure_onloaded()
            self.ranks.run(commands.Load(directory=str(directory)))
            self.checkpoints.restore(state)
            self._unloaded = None
            return trainer_pb2.LoadResponse(loaded=True, path=str(directory),
                                            rollout_id=int(state["checkpoint_rollout_id"]), step=self.ledger.step,
                                            weight_version=self.ledger.weight_version,
                                            extra_state=state.get("extra_state", {}))

    # ---- weights ----------------------------------------------------------------------------------

    def prepare_weight_sync(self, *, version: int, transport: str = "", engine_world_size: int = 1,
                            verify: bool = False, verify_by_bucket: bool = False) -> common_pb2.WeightSyncPlan:
        self.weights.check_request(engine_world_size=engine_world_size)
        with self._lock:
            self._ensure_onloaded()
            announced = self.weights.prepare(version=version, transport=transport,
                                             engine_world_size=engine_world_size, verify=verify,
                                             verify_by_bucket=verify_by_bucket)
            if verify:
                start = time.monotonic()
                sums = self.ranks.run(commands.WeightChecksums(by_bucket=announced.verify_by_bucket))
                self.weights.add_checksums(announced, sums, seconds=time.monotonic() - start)
            return announced

    def publish_weights(self, *, version: int) -> trainer_pb2.PublishWeightsResponse:
        with self._lock:
            self.weights.check_prepared(version)
            with span("rl.sync", weight_version=version, role=self.role) as sp:
                stats = self.ranks.run(commands.PublishWeights(version=version))
                set_attributes(sp, bytes=int(stats.bytes))
            self.ledger.weight_version = version
            self.weights.forget_plan()
            return trainer_pb2.PublishWeightsResponse(version=version, bytes_sent=int(stats.bytes),
                                                      time_s=float(stats.seconds))

    # ---- offload / state --------------------------------------------------------------------------

    def offload(self) -> common_pb2.Ack:
        with self._lock:
            self.backend.check_offload_supported()   # here, before any rank is asked to
            return common_pb2.Ack(ok=True, message=self.ranks.run(commands.Offload()))

    def onload(self) -> common_pb2.Ack:
        with self._lock:
            return common_pb2.Ack(ok=True, message=self.ranks.run(commands.Onload()))

    def get_state(self) -> trainer_pb2.TrainerState:
        return trainer_pb2.TrainerState(role=self.role, step=self.ledger.step,
                                        last_rollout_id=self.ledger.last_rollout_id,
                                        weight_version=self.ledger.weight_version, world_size=self.dist.world_size,
                                        zero_stage=self.config.trainer.zero_stage, offloaded=self.backend.offloaded,
                                        device=str(self.dist.device), samples_trained=self.ledger.samples_trained,
                                        gpu_memory_reserved_bytes=cuda_reserved_bytes())
