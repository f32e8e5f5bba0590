"""TrainerService: the trainer's behaviour as a plain Python object (the gRPC servicer is a thin adapter).

Rank 0 owns the public methods: it talks to Redis, validates, decides, and relays each command to the
other ranks (`CommandRelay`), then every rank executes it in lockstep (`_execute`). Ranks > 0 run
`serve_worker()`. With one rank the relay is a no-op, so 1 and N ranks share one code path.

Exactly-once: Train reads the named entries, trains one optimizer step, records rollout_id → response and
the entry ids, and only then acknowledges the entries. A retried Train for a recorded rollout_id returns
the recorded response (and re-acknowledges, in case the first ack was lost). Entries already trained under
another rollout id are skipped. The records travel in the checkpoint's client state.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from google.protobuf import json_format

from services.buffer.stream import BufferEntry, RolloutBuffer, connect, stream_key
from services.contracts import checkpoints
from services.contracts.config import TandemConfig
from services.contracts.gen.tandem.v1 import common_pb2, trainer_pb2
from services.contracts.wire import array_from_proto, array_to_proto
from services.rpc.grpc_util import FailedPrecondition
from services.telemetry.tracing import set_attributes, span
from services.tensors.devices import cuda_reserved_bytes
from services.trainer import checkpoint as ckpt
from services.trainer.actor import actor_step
from services.trainer.backend import TORCH_DTYPES, DeepSpeedBackend, load_frozen_causal_lm, param_dtype
from services.trainer.batching import TrainBatch, check_trainable, merge_batches, stale_samples
from services.trainer.critic import (
    ValueHandoff,
    critic_step,
    handoff_key,
    publish_handoff,
    read_handoff,
    values_for_batch,
)
from services.trainer.dist import CommandRelay, barrier, init_process_group
from services.trainer.old_actor import OldActor, snapshots_to_keep
from services.trainer.weight_export import iter_named_weights, weight_specs
from services.weights.layout import tensor_checksum

log = logging.getLogger(__name__)

ROLES = ("actor", "critic")
MAX_RECORDED_RESULTS = 1024        # replayable Train responses kept (and checkpointed)
MAX_RECORDED_ENTRIES = 100_000     # trained entry ids remembered to refuse a second delivery
MAX_ENGINE_RANKS = 4096            # a weight-sync group larger than this is a malformed request
_BATCH_FIELDS = ("tokens", "prompt_lengths", "response_lengths", "loss_mask", "rollout_log_probs", "rewards",
                 "group_ids", "sample_versions", "sampling_temperature", "sampling_top_p", "sampling_top_k", "values")


def _encode_batch(batch: TrainBatch) -> tuple[list[str], list[bytes]]:
    names = [f for f in _BATCH_FIELDS if getattr(batch, f) is not None]
    return names, [array_to_proto(getattr(batch, f).numpy()).SerializeToString() for f in names]


def _decode_batch(names: list[str], payloads: list[bytes]) -> TrainBatch:
    arrays = {}
    for name, raw in zip(names, payloads):
        msg = common_pb2.TensorData()
        msg.ParseFromString(raw)
        arrays[name] = torch.from_numpy(array_from_proto(msg, what=name).copy())
    return TrainBatch(**arrays)


class TrainerService:
    def __init__(self, config: TandemConfig, *, run_dir: Path, role: str = "actor"):
        if role not in ROLES:
            raise ValueError(f"trainer role must be one of {ROLES}, got {role!r}")
        if role == "critic" and not config.algorithm.uses_critic:
            raise ValueError("--role critic needs algorithm.advantage_estimator: gae")
        self.config, self.role, self.run_dir = config, role, Path(run_dir)
        self.dist = init_process_group(device=config.trainer.device)
        self.relay = CommandRelay(rank=self.dist.rank, world_size=self.dist.world_size)
        self.backend = DeepSpeedBackend(config=config, role=role, dist_info=self.dist)
        algo = config.algorithm
        self.ref_model = load_frozen_causal_lm(config, self.dist.device) \
            if role == "actor" and algo.kl_coef > 0 else None
        self.old_actor = OldActor(config=config, device=self.dist.device, dtype=param_dtype(config),
                                  keep=snapshots_to_keep(config)) \
            if role == "actor" and algo.keep_old_actor else None
        model_cfg = self.backend.module.config
        self.vocab_size = int(model_cfg.vocab_size)
        self.max_positions = getattr(model_cfg, "max_position_embeddings", None)
        self.export_dtype = TORCH_DTYPES[config.model.dtype]
        self.checkpoint_base = checkpoints.default_base(checkpoint_dir=config.trainer.checkpoint_dir, run_dir=self.run_dir)
        # state (rank 0 is authoritative; it is what checkpoints hold)
        self.step = 0
        self.last_rollout_id = -1
        self.weight_version = 0
        self.samples_trained = 0
        self.results: OrderedDict[int, trainer_pb2.TrainResponse] = OrderedDict()
        self.trained_entries: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()
        self._plan: common_pb2.WeightSyncPlan | None = None
        self._publishers: dict[str, Any] = {}
        self._handoff: tuple[int, ValueHandoff] | None = None   # critic: last published, for replays
        self.stream = stream_key(config.redis.stream_prefix, config.run_name)
        self._buffer: RolloutBuffer | None = None   # connected on first use: Redis may start after us
        # A trainer (re)started where checkpoints exist must Load before it trains: otherwise a coordinator
        # that outlived the old process would continue its run on the initial weights.
        self._unloaded = checkpoints.latest_checkpoint(config, run_dir=self.run_dir, role=role)

    @property
    def buffer(self) -> RolloutBuffer:
        if self._buffer is None:
            cfg = self.config.redis
            if not cfg.url:
                raise FailedPrecondition("redis.url is not set: the trainer has no rollout buffer to read")
            groups = ("actor", "critic") if self.config.algorithm.uses_critic else ("actor",)
            self._buffer = RolloutBuffer(connect(cfg.url, password=cfg.password), self.stream, groups=groups,
                                         group=self.role, consumer=f"{self.role}-0",
                                         max_buffered_batches=cfg.max_buffered_batches,
                                         claim_idle_ms=cfg.claim_idle_ms)
        return self._buffer

    @property
    def redis(self):  # type: ignore[no-untyped-def]
        return self.buffer.client

    @property
    def rank(self) -> int:
        return self.dist.rank

    # ---- command plumbing -------------------------------------------------------------------------

    def _run(self, header: dict[str, Any], payloads: list[bytes] = ()) -> Any:
        """Rank 0: relay the command, then execute it here too."""
        self.relay.send(header, list(payloads))
        return self._execute(header, list(payloads))

    def _execute(self, header: dict[str, Any], payloads: list[bytes]) -> Any:
        handlers = {"train": self._exec_train, "save": self._exec_save, "load": self._exec_load,
                    "weights": self._exec_weights, "offload": self._exec_offload, "onload": self._exec_onload}
        return handlers[header["cmd"]](header, payloads)

    def serve_worker(self) -> None:
        """Ranks > 0: execute relayed commands until rank 0 says shutdown."""
        while True:
            header, payloads = self.relay.recv()
            if header["cmd"] == "shutdown":
                return
            self._execute(header, payloads)

    def close(self) -> None:
        if self.rank == 0 and self.dist.world_size > 1:
            try:
                self.relay.send({"cmd": "shutdown"})
            except RuntimeError as exc:   # a launcher stopping everything signals the other ranks too
                log.info("other ranks already gone at shutdown: %s", str(exc).splitlines()[0][:200])
        for publisher in self._publishers.values():
            publisher.close()
        self.backend.close()

    def _ensure_onloaded(self) -> None:
        if self.backend.offloaded:
            self._run({"cmd": "onload"})

    # ---- Train ------------------------------------------------------------------------------------

    def train(self, *, rollout_id: int, entry_ids: list[str] | tuple[str, ...] = (), num_batches: int = 0,
              max_staleness: int = -1, use_critic_values: bool = False,
              trace_context: dict[str, str] | None = None) -> trainer_pb2.TrainResponse:
        with self._lock:
            if rollout_id in self.results:
                return self._replay(rollout_id)
            if rollout_id < 0:
                raise ValueError(f"rollout_id must be >= 0, got {rollout_id}")
            if self._unloaded is not None:
                raise FailedPrecondition(f"this trainer started after checkpoint {self._unloaded} was written and "
                                         "has not loaded it: call Load first")
            limit = self.config.redis.max_buffered_batches
            if len(entry_ids) > limit or num_batches > limit:
                raise ValueError(f"Train({rollout_id}) asks for {max(len(entry_ids), num_batches)} batches; at most "
                                 f"redis.max_buffered_batches ({limit}) can be in the buffer at once")
            if use_critic_values and self.role == "critic":
                raise ValueError("use_critic_values is for the actor's Train, not the critic's")
            if self.role == "actor" and self.config.algorithm.uses_critic and not use_critic_values:
                raise FailedPrecondition("advantage_estimator gae: the actor's Train needs use_critic_values "
                                         "(train the critic on the rollout first)")
            entries, skipped = self._read_entries(list(entry_ids), num_batches)
            oldest = min((e.policy_version for e in entries), default=self.weight_version)
            # Linked to the rl.sample span of every entry (its context travelled in the Redis entry).
            with span("rl.train", parent=trace_context or None, links_from=[e.trace_context for e in entries],
                      rollout_id=rollout_id, role=self.role, world_size=self.dist.world_size,
                      weight_version=self.weight_version, staleness=self.weight_version - oldest,
                      entries=len(entries), bytes=sum(e.nbytes for e in entries)) as sp:
                reply = self._train_entries(rollout_id=rollout_id, entries=entries, skipped=skipped,
                                            max_staleness=max_staleness, use_critic_values=use_critic_values)
                set_attributes(sp, samples=reply.samples_trained, samples_dropped_stale=reply.samples_dropped_stale)
                return reply

    def _replay(self, rollout_id: int) -> trainer_pb2.TrainResponse:
        recorded = self.results[rollout_id]
        self._side_effects(rollout_id, list(recorded.entry_ids))   # the first ack or hand-off may have been lost
        reply = trainer_pb2.TrainResponse()
        reply.CopyFrom(recorded)
        reply.replayed = True
        return reply

    def _read_entries(self, entry_ids: list[str], num_batches: int) -> tuple[list[BufferEntry], list[str]]:
        if not entry_ids:
            if num_batches <= 0:
                raise ValueError("empty batch: Train needs entry_ids or num_batches > 0")
            return self._take_batches(num_batches), []
        if len(set(entry_ids)) != len(entry_ids):
            raise ValueError(f"entry_ids name an entry more than once: {entry_ids}")
        skipped = [e for e in entry_ids if e in self.trained_entries]
        fresh = [e for e in entry_ids if e not in self.trained_entries]
        if not fresh:
            done = sorted({self.trained_entries[e] for e in skipped})
            raise FailedPrecondition(f"entries {skipped} were already trained (rollout {done}); nothing new to train")
        return self.buffer.read(fresh, timeout_s=self.config.redis.get_timeout_s), skipped

    def _take_batches(self, count: int) -> list[BufferEntry]:
        deadline = time.monotonic() + self.config.redis.get_timeout_s
        entries: list[BufferEntry] = []
        while len(entries) < count:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"only {len(entries)} of {count} batches arrived within "
                                   f"{self.config.redis.get_timeout_s}s (redis.get_timeout_s)")
            got = self.buffer.get(count - len(entries), block_ms=500)
            self.buffer.ack([e.entry_id for e in got if e.entry_id in self.trained_entries])   # a lost ack
            entries += [e for e in got if e.entry_id not in self.trained_entries]
        return entries

    def _prepare_batch(self, entries: list[BufferEntry], *, rollout_id: int, max_staleness: int,
                       use_critic_values: bool) -> tuple[TrainBatch, int]:
        """The batch to train on (stale samples removed) and the number dropped; raises on bad input."""
        batch = merge_batches([e.batch for e in entries])
        if use_critic_values:
            handoff = read_handoff(self.redis, stream=self.stream, rollout_id=rollout_id)
            batch = batch.with_values(values_for_batch(handoff, entry_ids=[e.entry_id for e in entries], batch=batch))
        # The critic values every sample, so its hand-off lines up with the actor's unfiltered batch.
        if self.role == "critic":
            max_staleness = -1
        stale = stale_samples(batch, weight_version=self.weight_version, max_staleness=max_staleness)
        if stale:
            dropped = set(stale)
            batch = batch.select([i for i in range(batch.num_samples) if i not in dropped])
        if batch.num_samples:
            algo = self.config.algorithm
            check_trainable(batch, vocab_size=self.vocab_size, max_positions=self.max_positions,
                            needs_rollout_log_probs=algo.use_rollout_logprobs or algo.use_tis)
        return batch, len(stale)

    def _train_entries(self, *, rollout_id: int, entries: list[BufferEntry], skipped: list[str],
                       max_staleness: int, use_critic_values: bool) -> trainer_pb2.TrainResponse:
        start = time.monotonic()
        batch, dropped = self._prepare_batch(entries, rollout_id=rollout_id, max_staleness=max_staleness,
                                             use_critic_values=use_critic_values)
        entry_ids = [e.entry_id for e in entries]
        metrics: dict[str, float] = {}
        if batch.num_samples:
            self._ensure_onloaded()
            names, payloads = _encode_batch(batch)
            metrics = self._run({"cmd": "train", "rollout_id": rollout_id, "fields": names, "entry_ids": entry_ids},
                                payloads)
            self.step += 1
        metrics.update(samples_dropped_stale=float(dropped), entries_skipped_duplicate=float(len(skipped)))
        reply = trainer_pb2.TrainResponse(rollout_id=rollout_id, step=self.step, metrics=metrics, entry_ids=entry_ids,
                                          samples_trained=batch.num_samples, samples_dropped_stale=dropped,
                                          time_s=time.monotonic() - start)
        self._record(rollout_id, reply)
        self._side_effects(rollout_id, entry_ids)
        log.info("rollout %d: step %d, %d samples (%d stale dropped), loss %.5f", rollout_id, self.step,
                 batch.num_samples, dropped, metrics.get("loss", float("nan")))
        return reply

    def _record(self, rollout_id: int, reply: trainer_pb2.TrainResponse) -> None:
        self.results[rollout_id] = reply
        while len(self.results) > MAX_RECORDED_RESULTS:
            self.results.popitem(last=False)
        for entry_id in reply.entry_ids:
            self.trained_entries[entry_id] = rollout_id
        while len(self.trained_entries) > MAX_RECORDED_ENTRIES:
            self.trained_entries.popitem(last=False)
        self.last_rollout_id = max(self.last_rollout_id, rollout_id)
        self.samples_trained += reply.samples_trained

    def _side_effects(self, rollout_id: int, entry_ids: list[str]) -> None:
        """After the step is committed and recorded: publish the critic's values, ack, drop a used hand-off."""
        if self.role == "critic" and self._handoff is not None and self._handoff[0] == rollout_id:
            publish_handoff(self.redis, stream=self.stream, rollout_id=rollout_id, handoff=self._handoff[1])
        self.buffer.ack(entry_ids)
        if self.role == "actor" and self.config.algorithm.uses_critic:
            self.redis.delete(handoff_key(self.stream, rollout_id))

    def _exec_train(self, header: dict[str, Any], payloads: list[bytes]) -> dict[str, float]:
        batch = _decode_batch(header["fields"], payloads)
        budget = self.config.trainer.micro_batch_tokens
        if self.role == "actor":
            return actor_step(backend=self.backend, batch=batch, algo=self.config.algorithm, ref_model=self.ref_model,
                              old_actor=self.old_actor, token_budget=budget)
        metrics, (values, advantages, returns) = critic_step(backend=self.backend, batch=batch,
                                                             algo=self.config.algorithm, token_budget=budget)
        if self.rank == 0:
            self._handoff = (header["rollout_id"], ValueHandoff(
                entry_ids=tuple(header.get("entry_ids", ())), response_lengths=batch.response_lengths.numpy(),
                values=values.numpy(), advantages=advantages.numpy(), returns=returns.numpy()))
        return metrics

    # ---- Save / Load ------------------------------------------------------------------------------

    def _client_state(self, extra_state: dict[str, str], *, checkpoint_rollout_id: int) -> dict[str, Any]:
        """`rollout_id` is the last rollout this trainer trained; `checkpoint_rollout_id` the one the Save named
        (they differ for the actor during critic-only steps)."""
        return {"format": 1, "role": self.role, "step": self.step, "rollout_id": self.last_rollout_id,
                "checkpoint_rollout_id": checkpoint_rollout_id,
                "weight_version": self.weight_version, "samples_trained": self.samples_trained,
                "world_size": self.dist.world_size, "zero_stage": self.config.trainer.zero_stage,
                "trained_entries": list(self.trained_entries.items()),
                "results": {str(k): json_format.MessageToDict(v) for k, v in self.results.items()},
                "extra_state": dict(extra_state)}

    def save(self, *, rollout_id: int, path: str = "", export_hf: bool = False,
             extra_state: dict[str, str] | None = None) -> trainer_pb2.SaveResponse:
        start = time.monotonic()
        if rollout_id < 0:
            raise ValueError(f"Save: rollout_id must be >= 0, got {rollout_id}")
        with self._lock, span("rl.save", rollout_id=rollout_id, role=self.role):
            root = checkpoints.checkpoint_root(base=self._own_path(path) if path else self.checkpoint_base, role=self.role)
            directory = checkpoints.checkpoint_dir(root, rollout_id)
            export = export_hf or self.config.trainer.export_hf_on_save
            if checkpoints.is_complete(directory) and checkpoints.read_json(directory / checkpoints.COMPLETE)["step"] == self.step:
                log.info("checkpoint %s already holds step %d", directory, self.step)   # a retried Save
            else:
                self._ensure_onloaded()
                self._run({"cmd": "save", "dir": str(directory), "rollout_id": rollout_id, "export_hf": export,
                           "extra_state": dict(extra_state or {})})
            hf = directory / "hf"
            return trainer_pb2.SaveResponse(path=str(directory), hf_path=str(hf) if hf.is_dir() else "",
                                            step=self.step, time_s=time.monotonic() - start)

    def _exec_save(self, header: dict[str, Any], payloads: list[bytes]) -> None:
        directory = Path(header["dir"])
        staging = ckpt.staging_dir(directory)   # renamed to `directory` once complete
        try:
            self._write_checkpoint(staging, header)
        except Exception as exc:
            if self.rank == 0:
                full = ckpt.out_of_space(exc, staging)
                ckpt.release_frames(exc)   # else the partial files' space stays taken while the error lives
                shutil.rmtree(staging, ignore_errors=True)
                if full:
                    raise self._no_space(directory) from exc
            raise
        if self.rank == 0:
            ckpt.publish(staging, directory)
            removed = ckpt.apply_retention(directory.parent, keep=self.config.trainer.keep_last_checkpoints,
                                           current=directory)
            log.info("saved %s (removed %d old checkpoints)", directory, len(removed))

    def _write_checkpoint(self, staging: Path, header: dict[str, Any]) -> None:
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)   # a save of this rollout id that was cut short
            staging.mkdir(parents=True)
        barrier()
        state = self._client_state(header["extra_state"], checkpoint_rollout_id=header["rollout_id"]) \
            if self.rank == 0 else {}
        self.backend.save_checkpoint(staging, client_state=state)
        ckpt.write_json_atomic(staging / f"rng_rank{self.rank}.json", ckpt.rng_state())
        if header["export_hf"]:
            self._export_hf(staging / "hf")
        barrier()   # every rank's shards are on disk before the marker says so
        if self.rank == 0:
            ckpt.write_json_atomic(staging / checkpoints.STATE, state)
            ckpt.mark_complete(staging, {"rollout_id": header["rollout_id"], "step": state["step"],
                                         "world_size": self.dist.world_size, "time": time.time()})

    def _no_space(self, directory: Path) -> ckpt.NoSpaceLeft:
        last = checkpoints.latest_complete(directory.parent)
        free = shutil.disk_usage(next(p for p in directory.parents if p.exists())).free
        return ckpt.NoSpaceLeft(f"no space left on {directory.parent}: checkpoint {directory.name} was not written "
                                f"({free} bytes free after removing its partial files); the last good checkpoint "
                                f"{last or '(none)'} is kept")

    def _export_hf(self, out: Path) -> None:
        """HF-format safetensors of the current weights (collective under ZeRO-3; rank 0 writes)."""
        from safetensors.torch import save_file

        state = dict(self.iter_named_weights())
        if self.rank != 0:
            return
        out.mkdir(parents=True, exist_ok=True)
        module = self.backend.module
        if self.role == "critic":
            backbone = {k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")}
            module.backbone.save_pretrained(out, state_dict=backbone, safe_serialization=True)
            head = {k: v.contiguous() for k, v in state.items() if k.startswith("value_head.")}
            save_file(head, str(out / "value_head.safetensors"))
        else:
            module.save_pretrained(out, state_dict=state, safe_serialization=True)
        ckpt.copy_tokenizer_files(Path(self.config.model.tokenizer_path or self.config.model.path), out)

    def load(self, *, path: str = "") -> trainer_pb2.LoadResponse:
        with self._lock:
            directory = checkpoints.resolve_load_dir(str(self._own_path(path)) if path else "", role=self.role,
                                              default_root=checkpoints.checkpoint_root(base=self.checkpoint_base,
                                                                                role=self.role))
            if directory is None:
                return trainer_pb2.LoadResponse(loaded=False)
            state = checkpoints.read_json(directory / checkpoints.STATE)
            if state.get("role") != self.role:
                raise FailedPrecondition(f"checkpoint {directory} belongs to role {state.get('role')}, not {self.role}")
            if state["world_size"] != self.dist.world_size and self.config.trainer.zero_stage > 0:
                raise FailedPrecondition(f"checkpoint {directory} was saved by {state['world_size']} ranks; ZeRO "
                                         f"shards cannot be loaded by {self.dist.world_size}")
            self._ensure_onloaded()
            self._run({"cmd": "load", "dir": str(directory)})
            self._restore(state)
            self._unloaded = None
            return trainer_pb2.LoadResponse(loaded=True, path=str(directory),
                                            rollout_id=int(state["checkpoint_rollout_id"]),
                                            step=self.step, weight_version=self.weight_version,
                                            extra_state=state.get("extra_state", {}))

    def _own_path(self, path: str) -> Path:
        """Save/Load paths from a caller stay under the checkpoint directory or the run directory: a Load
        unpickles DeepSpeed's optimizer files, so it must never read a directory someone else prepared."""
        try:
            resolved = Path(path).resolve()
        except (OSError, ValueError) as exc:   # NUL bytes, names too long
            raise ValueError(f"checkpoint path {path[:200]!r} is not a usable path: {exc}") from None
        roots = [self.checkpoint_base.resolve(), self.run_dir.resolve()]
        if not any(resolved.is_relative_to(root) for root in roots):
            raise ValueError(f"checkpoint path {path[:200]!r} is outside trainer.checkpoint_dir ({roots[0]}) and "
                             f"the run directory ({roots[1]})")
        return resolved

    def _exec_load(self, header: dict[str, Any], payloads: list[bytes]) -> None:
        directory = Path(header["dir"])
        self.backend.load_checkpoint(directory)
        if self.old_actor is not None:
            self.old_actor.clear()
        rng = directory / f"rng_rank{self.rank}.json"
        if rng.is_file():
            ckpt.set_rng_state(checkpoints.read_json(rng))

    def _restore(self, state: dict[str, Any]) -> None:
        self.step, self.last_rollout_id = int(state["step"]), int(state["rollout_id"])
        self.weight_version, self.samples_trained = int(state["weight_version"]), int(state["samples_trained"])
        self.trained_entries = OrderedDict((e, int(r)) for e, r in state["trained_entries"])
        self.results = OrderedDict((int(k), json_format.ParseDict(v, trainer_pb2.TrainResponse()))
                                   for k, v in state["results"].items())
        self._plan = None

    # ---- weights ----------------------------------------------------------------------------------

    def weight_specs(self) -> list:
        """TensorSpec per parameter (HF names, export dtype, full shapes), in iteration order."""
        return weight_specs(self.backend.module, dtype=self.export_dtype)

    def iter_named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors. Under ZeRO-3 a collective: every rank must exhaust it in lockstep."""
        bucket = int(self.config.weights.bucket_mb * (1 << 20))
        return iter_named_weights(self.backend.module, dtype=self.export_dtype, zero3=self.backend.zero_stage == 3,
                                  group_bytes=bucket)

    def _publisher(self, transport: str) -> Any:
        from services.weights import WeightPublisher

        if transport not in self._publishers:
            self._publishers[transport] = WeightPublisher(transport=transport, config=self.config.weights,
                                                          run_dir=self.run_dir, trainer_id=self.trainer_id)
        return self._publishers[transport]

    @property
    def trainer_id(self) -> str:
        configured = self.config.weights.trainer_id if self.role == "actor" else None
        return configured or f"{self.config.run_name}/{self.role}"

    def prepare_weight_sync(self, *, version: int, transport: str = "", engine_world_size: int = 1,
                            verify: bool = False) -> common_pb2.WeightSyncPlan:
        if self.role != "actor":
            raise FailedPrecondition("the critic has no weights to publish to rollout engines")
        if not 1 <= engine_world_size <= MAX_ENGINE_RANKS:
            raise ValueError(f"engine_world_size must be in 1..{MAX_ENGINE_RANKS}, got {engine_world_size}")
        with self._lock:
            self._ensure_onloaded()
            plan = self._publisher(transport or self.config.weights.transport).prepare(
                self.weight_specs(), version=version, engine_world_size=engine_world_size, verify=verify)
            self._plan = plan   # publish needs exactly the plan its publisher prepared
            announced = common_pb2.WeightSyncPlan()
            announced.CopyFrom(plan)
            if verify:   # what the coordinator compares the receivers' checksums with
                sums = self._run({"cmd": "weights", "mode": "checksums"})
                for bucket in announced.buckets:
                    for meta in bucket.tensors:
                        meta.checksum = sums[meta.name]
            return announced

    def publish_weights(self, *, version: int) -> trainer_pb2.PublishWeightsResponse:
        with self._lock:
            if self._plan is None or self._plan.version != version:
                raise FailedPrecondition(f"PublishWeights(v{version}) needs PrepareWeightSync(v{version}) first")
            with span("rl.sync", weight_version=version, role=self.role) as sp:
                stats = self._run({"cmd": "weights", "mode": "publish", "version": version})
                set_attributes(sp, bytes=int(stats.bytes))
            self.weight_version = version
            self._plan = None
            return trainer_pb2.PublishWeightsResponse(version=version, bytes_sent=int(stats.bytes),
                                                      time_s=float(stats.seconds))

    def _exec_weights(self, header: dict[str, Any], payloads: list[bytes]) -> Any:
        try:
            return self._send_weights(header)
        finally:   # every rank, even when the publish failed: under ZeRO-3 the snapshot is a collective
            if header["mode"] == "publish" and self.old_actor is not None:
                self.old_actor.take_snapshot(version=header["version"], module=self.backend.module,
                                             zero3=self.backend.zero_stage == 3,
                                             optimizer_step=self.backend.global_steps)

    def _send_weights(self, header: dict[str, Any]) -> Any:
        named = self.iter_named_weights()
        try:
            if self.rank != 0:
                return None
            if header["mode"] == "checksums":
                return {name: tensor_checksum(t) for name, t in named}
            transport = self._plan.transport or self.config.weights.transport
            return self._publisher(transport).publish(self._plan, named)
        finally:
            for _ in named:   # a failed publish must still finish the collective gathers on every rank
                pass

    # ---- offload / state --------------------------------------------------------------------------

    def offload(self) -> common_pb2.Ack:
        with self._lock:
            self.backend.check_offload_supported()   # here, before any rank is asked to
            return common_pb2.Ack(ok=True, message=self._run({"cmd": "offload"}))

    def onload(self) -> common_pb2.Ack:
        with self._lock:
            return common_pb2.Ack(ok=True, message=self._run({"cmd": "onload"}))

    def _exec_offload(self, header: dict[str, Any], payloads: list[bytes]) -> str:
        for publisher in self._publishers.values():
            publisher.release()   # cuda_ipc buckets: the next sync allocates them again
        return self.backend.offload()

    def _exec_onload(self, header: dict[str, Any], payloads: list[bytes]) -> str:
        return self.backend.onload()

    def get_state(self) -> trainer_pb2.TrainerState:
        return trainer_pb2.TrainerState(role=self.role, step=self.step, last_rollout_id=self.last_rollout_id,
                                        weight_version=self.weight_version, world_size=self.dist.world_size,
                                        zero_stage=self.config.trainer.zero_stage, offloaded=self.backend.offloaded,
                                        device=str(self.dist.device), samples_trained=self.samples_trained,
                                        gpu_memory_reserved_bytes=cuda_reserved_bytes())
