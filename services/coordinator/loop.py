"""The run loop (reference semantics: miles' `train_async.py`, one step off-policy).

    start up: wait for services, load the latest checkpoint, push weights (version v), eval before training
    for rollout_id in range(start, num_rollout):
        batch = the generation in flight for rollout_id;  start generating rollout_id + 1
        train (PPO: critic first, then the actor once past num_critic_only_steps)
        save when due;  every update_weights_interval steps: wait for generation, then sync weights
        eval when due (asynchronously), drained at the end
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from services.buffer.stream import RolloutBuffer
from services.contracts import runfacts
from services.contracts.config import TandemConfig
from services.contracts.gen.tandem.v1 import common_pb2, rollout_pb2, trainer_pb2
from services.contracts.sampling import SamplingSpec
from services.coordinator.clients import GenerationResult, RolloutPool, TrainerClient
from services.coordinator.control import Control
from services.coordinator.data import DataSource, load_prompts
from services.coordinator.state import GeneratedBatch, RunState
from services.coordinator.stepmetrics import generation_metrics, prefixed, weighted_mean
from services.coordinator.sync import WeightSync
from services.telemetry.tracing import StepSpans, annotate, inject_context, span
from services.telemetry.trackers import EventLog, Tracker

log = logging.getLogger(__name__)


class Coordinator:
    def __init__(self, *, config: TandemConfig, run_dir: Path, trainer: TrainerClient, critic: TrainerClient | None,
                 pool: RolloutPool, trackers: list[Tracker], events: EventLog | None = None,
                 buffer: RolloutBuffer | None = None):
        self.config = config
        self.loop_cfg = config.loop
        self.run_dir = run_dir
        self.trainer = trainer
        self.critic = critic
        self.pool = pool
        self.trackers = trackers
        self.events = events or EventLog()
        self.control = Control()
        self.data = DataSource.from_config(config.data, batch_size=config.rollout.rollout_batch_size)
        self.num_rollout = runfacts.num_rollout(config, dataset_size=len(self.data.records))
        self.state = RunState()
        self.sync = WeightSync(trainer=trainer, pool=pool, config=config.weights,
                               trainer_offloads=config.loop.offload_train)
        self.evals = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eval")
        self.eval_futures: list[Future] = []
        self.buffer = buffer   # the run's Redis buffer: resume bookkeeping and critic-only steps (None in unit tests)
        self.last_metrics: dict[str, float] = {}
        self.last_checkpoint = ""
        self.offloaded = False
        self.rollout_released: set[str] = set()   # memory tags the engines gave up (offload_rollout)
        self.status = "starting"
        self.error = ""
        self.last_saved_rollout = -1
        self._start_id = 0
        self._epoch_ends: set[int] = set()
        self._evaluated_ids: set[int] = set()
        self.step_spans = StepSpans()   # one trace per rollout id, opened when its generation starts

    # ---- the loop ---------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            with span("rl.startup", mode=self.loop_cfg.mode):   # checkpoint load, first weight push, first eval
                finished = self._startup()
            if not finished:
                self._start_id = self.state.next_rollout_id
                self.status = "running"
                if self.loop_cfg.mode == "fully_async":
                    self._run_fully_async()
                else:
                    self._run_one_step_off()
                self._finish()
            self.status = "finished"
        except Exception as exc:
            self.status, self.error = "failed", f"{type(exc).__name__}: {exc}"
            self.events.emit("state", message=f"failed: {self.error}")
            raise
        finally:
            self.step_spans.close_all(trained=False)   # generations started but never trained
            self.events.emit("state", message=self.status)
            self.events.close()

    def _run_one_step_off(self) -> None:
        overlap = self.loop_cfg.mode == "async"
        start = self.state.next_rollout_id
        next_gen = self._resume_or_generate(start) if start < self.num_rollout else None
        for rollout_id in range(start, self.num_rollout):
            if not self.control.wait_while_paused(self.status_setter):
                break
            with self.step_spans.step(rollout_id):
                step_start = time.monotonic()
                wait_start = time.monotonic()
                current = next_gen.result()
                wait_s = time.monotonic() - wait_start
                next_gen = None
                if overlap and rollout_id + 1 < self.num_rollout:
                    next_gen = self._start_generation(rollout_id + 1)
                metrics = self._train_step(rollout_id=rollout_id, gen=current)
                metrics["perf/rollout_wait_s"] = wait_s
                if (rollout_id + 1) % self.loop_cfg.update_weights_interval == 0 or not overlap:
                    if next_gen is not None:
                        next_gen.result()   # never swap weights under a running generation
                    metrics.update(self._sync_weights())
                self._offload_trainer(metrics)   # after the sync, which needs the weights: generation gets the memory
                if not overlap and rollout_id + 1 < self.num_rollout:
                    next_gen = self._start_generation(rollout_id + 1)
                self._after_step(rollout_id=rollout_id, metrics=metrics, step_start=step_start, in_flight=next_gen)
            if self._should_exit(rollout_id):
                break

    def _run_fully_async(self) -> None:
        """Generation runs continuously (one call in flight per replica); each step trains the oldest
        finished batch; samples older than max_staleness are dropped by the trainer and counted."""
        start = self.state.next_rollout_id
        in_flight: list[Future] = [self._resume_or_generate(start)] if start < self.num_rollout else []
        next_gen_id = start + 1
        for rollout_id in range(start, self.num_rollout):
            if not self.control.wait_while_paused(self.status_setter):
                break
            while len(in_flight) < len(self.pool.clients) + 1 and next_gen_id < self.num_rollout:
                in_flight.append(self._resume_or_generate(next_gen_id))   # every recorded one is reused
                next_gen_id += 1
            with self.step_spans.step(rollout_id):
                step_start = time.monotonic()
                current = in_flight.pop(0).result()
                metrics = self._train_step(rollout_id=rollout_id, gen=current,
                                           max_staleness=self.loop_cfg.max_staleness)
                if (rollout_id + 1) % self.loop_cfg.update_weights_interval == 0:
                    metrics.update(self._sync_weights())
                self._offload_trainer(metrics)
                self._after_step(rollout_id=rollout_id, metrics=metrics, step_start=step_start,
                                 in_flight=in_flight[0] if in_flight else None, all_in_flight=in_flight)
            if self._should_exit(rollout_id):
                break

    def status_setter(self, status: str) -> None:
        self.status = status
        self.events.emit("state", message=status)

    # ---- start-up / finish --------------------------------------------------------------------------

    def _startup(self) -> bool:
        """True when the checkpoint shows the run already finished: nothing to do, nothing to log again."""
        timeout = self.loop_cfg.startup_timeout_s
        for client in [self.trainer, *([self.critic] if self.critic else []), *self.pool.clients]:
            client.wait_healthy(timeout)
        self._load_checkpoint()
        done = self.state.next_rollout_id
        if runfacts.is_finished(next_rollout_id=done, num_rollout=self.num_rollout):
            message = runfacts.finished_message(done=done, num_rollout=self.num_rollout, checkpoint=self.last_checkpoint)
            log.info("%s", message)
            self.events.emit("state", rollout_id=done - 1, message=message)
            return True
        for tracker in self.trackers:   # steps after the checkpoint are trained again: drop their old rows
            tracker.rewind(next_step=done)
        self.events.emit("state", rollout_id=self.state.next_rollout_id,
                         message=f"starting at rollout {self.state.next_rollout_id} of {self.num_rollout}")
        metrics = self._sync_weights(bump=False)
        log.info("initial weights pushed: version %d (%.2fs)", self.state.weight_version,
                 metrics["perf/weight_sync_time_s"])
        if (self.loop_cfg.eval_interval and self.state.next_rollout_id == 0
                and not self.loop_cfg.skip_eval_before_train):
            self._record_eval(rollout_id=-1, metrics=self.evaluate())
        return False

    def _load_checkpoint(self) -> None:
        reply = self.trainer.call(self.trainer.stub.Load, trainer_pb2.LoadRequest(), timeout_s=self.loop_cfg.step_timeout_s,
                                  what="Load")
        self.trainer.last_step = reply.step if reply.loaded else None
        if self.critic is not None:
            critic = self.critic.call(self.critic.stub.Load, trainer_pb2.LoadRequest(),
                                      timeout_s=self.loop_cfg.step_timeout_s, what="Load")
            self.critic.last_step = critic.step if critic.loaded else None
        if reply.loaded and "coordinator" in reply.extra_state:
            saved = RunState.from_json(reply.extra_state["coordinator"])
            # Weights trained after the last sync were never pushed under the saved version: give them a new one.
            self.state = _replace(saved, weight_version=saved.weight_version + (0 if saved.weights_pushed else 1),
                                  weights_pushed=True)
            self.last_checkpoint = reply.path
            log.info("resumed from %s at rollout %d", reply.path, saved.next_rollout_id)
        self.data.cursor = self.state.cursor
        if self.buffer is not None:
            self.state = _replace(self.state, pending=tuple(p for p in self.state.pending if self._still_buffered(p)))
            keep = [e for p in self.state.pending for e in p.entry_ids]
            dropped = self.buffer.discard_except(keep)
            if dropped:
                log.info("discarded %d buffer entries generated after the last checkpoint", dropped)

    def _still_buffered(self, gen: GeneratedBatch) -> bool:
        """A recorded generation trained after the checkpoint was acknowledged and deleted; the checkpoint's
        weights never saw it, so it is generated again from its cursor (same prompts)."""
        missing = self.buffer.missing(list(gen.entry_ids))  # type: ignore[union-attr]
        if missing:
            log.warning("rollout %d: %d of its %d buffered entries were trained after the checkpoint and are gone; "
                        "generating it again", gen.rollout_id, len(missing), len(gen.entry_ids))
        return not missing

    def _finish(self) -> None:
        stopped = self.control.stop_requested
        last = self.state.next_rollout_id - 1
        with self.step_spans.after(last):   # the final eval / save join the last step's trace
            if last >= 0 and (self.loop_cfg.eval_interval or stopped) and not self._evaluated(last):
                if self.loop_cfg.eval_interval:
                    self._submit_eval(last)
            for fut in self.eval_futures:
                fut.result()
            if stopped and self.last_saved_rollout != last and last >= 0:
                self._save(rollout_id=last, in_flight=[], final=True)

    # ---- steps ------------------------------------------------------------------------------------

    def _start_generation(self, rollout_id: int) -> Future:
        cursor_before = self.data.cursor
        batch = self.data.next_batch()
        prompts = [common_pb2.Prompt(text=p.text, label=p.label, group_id=g, metadata=p.metadata)
                   for p, g in zip(batch.prompts, batch.group_ids)]
        if batch.epoch_end:
            self._epoch_ends.add(rollout_id)
        # The step's own trace starts here; the pool's threads inherit it, so Generate runs under rl.loop.
        with self.step_spans.started(rollout_id, weight_version=self.state.weight_version, mode=self.loop_cfg.mode):
            fut = self.pool.generate_async(rollout_id=rollout_id, prompts=prompts,
                                           n_samples=self.config.rollout.n_samples_per_prompt,
                                           sampling=SamplingSpec.from_config(self.config.rollout.sampling).to_proto(),
                                           trace_context=inject_context())
        fut.cursor_before, fut.cursor_after = cursor_before, batch.cursor_after  # type: ignore[attr-defined]
        return fut

    def _resume_or_generate(self, rollout_id: int) -> Future:
        """After a resume, a generation recorded in the checkpoint is reused instead of regenerated."""
        for p in self.state.pending:
            if p.rollout_id == rollout_id:
                self.data.cursor = p.cursor_after
                fut = _done(GenerationResult(rollout_id=rollout_id, entry_ids=p.entry_ids, responses=(), seconds=0.0,
                                             recorded_metrics=p.metrics))
                fut.cursor_before, fut.cursor_after = p.cursor_before, p.cursor_after  # type: ignore[attr-defined]
                log.info("reusing %d buffered entries of rollout %d from the checkpoint", len(p.entry_ids), rollout_id)
                self.step_spans.open(rollout_id, weight_version=self.state.weight_version, mode=self.loop_cfg.mode,
                                     reused=True)
                return fut
        return self._start_generation(rollout_id)

    def _train_step(self, *, rollout_id: int, gen: GenerationResult, max_staleness: int = -1) -> dict[str, float]:
        metrics = generation_metrics(gen, weight_version=self.state.weight_version)
        timeout = self.loop_cfg.step_timeout_s
        self._release_rollout_memory(metrics)
        self._onload(metrics)
        with span("rl.train", rollout_id=rollout_id, weight_version=self.state.weight_version,
                  entries=len(gen.entry_ids), staleness=metrics.get("rollout/staleness")):
            request = trainer_pb2.TrainRequest(rollout_id=rollout_id, entry_ids=list(gen.entry_ids),
                                               max_staleness=max_staleness, trace_context=inject_context())
            t = time.monotonic()
            if self.critic is not None:
                critic_reply = self.critic.train(request, timeout_s=timeout)
                metrics.update(prefixed("critic", critic_reply.metrics))
            reply = None
            if self.critic is None or rollout_id >= self.config.algorithm.num_critic_only_steps:
                request.use_critic_values = self.critic is not None
                reply = self.trainer.train(request, timeout_s=timeout)
                metrics.update(prefixed("train", reply.metrics))
            else:
                self._skip_for_actor(gen)
            metrics["perf/train_time_s"] = time.monotonic() - t
        trained = reply.samples_trained if reply is not None else 0
        dropped = reply.samples_dropped_stale if reply is not None else 0
        generated = int(metrics.get("rollout/num_samples", 0))
        critic_only = generated if reply is None else 0
        self.state = _replace(self.state, next_rollout_id=rollout_id + 1,
                              samples_generated=self.state.samples_generated + generated,
                              samples_trained=self.state.samples_trained + trained,
                              samples_dropped_stale=self.state.samples_dropped_stale + dropped,
                              samples_critic_only=self.state.samples_critic_only + critic_only,
                              pending=tuple(p for p in self.state.pending if p.rollout_id != rollout_id),
                              weights_pushed=False)
        metrics["rollout/stale_dropped"] = float(dropped)
        metrics["rollout/stale_dropped_total"] = float(self.state.samples_dropped_stale)
        return metrics

    def _skip_for_actor(self, gen: GenerationResult) -> None:
        """A critic-only step: the actor never trains these entries. Without counting them as its share, they
        would stay in the stream and hold the bound on waiting batches (a stall once num_critic_only_steps >=
        redis.max_buffered_batches)."""
        if self.buffer is not None:
            self.buffer.skip(list(gen.entry_ids), group="actor")

    def _sync_weights(self, *, bump: bool = True) -> dict[str, float]:
        memory_moves: dict[str, float] = {}
        self._onload(memory_moves)
        version = self.state.weight_version + (1 if bump else 0)
        self._resume_rollout_memory(("weights",), memory_moves)   # the sync needs the destination tensors back
        result = self.sync.run(version=version)
        self._resume_rollout_memory(("kv_cache", "cuda_graph"), memory_moves)
        self.state = _replace(self.state, weight_version=version, weights_pushed=True)
        self.events.emit("sync", rollout_id=self.state.next_rollout_id - 1,
                         metrics={"weight_version": version, "seconds": result.seconds, "gbps": result.gbps})
        return {**memory_moves, "perf/weight_sync_time_s": result.seconds, "perf/weight_sync_gbps": result.gbps,
                "weights/version": float(version), "weights/bytes": float(result.bytes),
                "weights/verified_tensors": float(result.verified_tensors)}

    def _after_step(self, *, rollout_id: int, metrics: dict[str, float], step_start: float,
                    in_flight: Future | None, all_in_flight: list[Future] | None = None) -> None:
        if self._should_save(rollout_id):
            t = time.monotonic()
            self._save(rollout_id=rollout_id, in_flight=all_in_flight if all_in_flight is not None else
                       ([in_flight] if in_flight is not None else []), final=self._is_final_step(rollout_id))
            metrics["perf/save_time_s"] = time.monotonic() - t
        if self._eval_due(rollout_id):
            self._submit_eval(rollout_id)
        metrics["perf/step_time_s"] = time.monotonic() - step_start
        tokens = metrics.get("rollout/response_tokens", 0.0)
        metrics["perf/tokens_per_s"] = tokens / metrics["perf/step_time_s"] if metrics["perf/step_time_s"] else 0.0
        metrics["weights/version"] = float(self.state.weight_version)
        metrics["data/epoch"] = float(self.data.cursor.epoch)
        annotate(staleness=metrics.get("rollout/staleness"), tokens=metrics.get("rollout/response_tokens"),
                 step_time_s=metrics["perf/step_time_s"])   # on the step's rl.loop span
        self.last_metrics = metrics
        for tracker in self.trackers:
            tracker.log(rollout_id, metrics)
        self.events.emit("step", rollout_id=rollout_id, metrics=metrics)

    def _should_exit(self, rollout_id: int) -> bool:
        if self.control.stop_requested:
            return True
        n = self.loop_cfg.debug_exit_after_rollout
        return n is not None and rollout_id + 1 - self._start_id >= n

    def _is_final_step(self, rollout_id: int) -> bool:
        """The run ends after this step (its end, a stop, or debug_exit_after_rollout): it is always saved."""
        return rollout_id + 1 >= self.num_rollout or self._should_exit(rollout_id)

    # ---- save / eval / offload ----------------------------------------------------------------------

    def _should_save(self, rollout_id: int) -> bool:
        due = self.control.take_save_request() or self._sentinel_fired()
        interval = self.loop_cfg.save_interval
        if interval is not None:
            due |= (rollout_id + 1) % interval == 0 or rollout_id in self._epoch_ends
        return due or self._is_final_step(rollout_id)

    def _sentinel_fired(self) -> bool:
        path = self.loop_cfg.save_trigger_sentinel
        if path and Path(path).exists():
            Path(path).unlink(missing_ok=True)
            log.info("save triggered by sentinel %s", path)
            return True
        return False

    def _save(self, *, rollout_id: int, in_flight: list[Future], final: bool = False) -> None:
        """A checkpoint of the step (and the generations in flight, so a resume reuses them); the run's final
        one always carries a Hugging Face export in its hf/ directory."""
        pending = []
        for fut in in_flight:   # record finished generations so a resume reuses their entries
            gen = fut.result()
            pending.append(GeneratedBatch(rollout_id=gen.rollout_id, entry_ids=gen.entry_ids,
                                          cursor_before=fut.cursor_before, cursor_after=fut.cursor_after,
                                          metrics=generation_metrics(gen, weight_version=self.state.weight_version)))
        cursor = pending[0].cursor_before if pending else self.data.cursor
        state = _replace(self.state, next_rollout_id=rollout_id + 1, cursor=cursor, pending=tuple(pending))
        with span("rl.save", rollout_id=rollout_id):
            request = trainer_pb2.SaveRequest(rollout_id=rollout_id, export_hf=final or self.config.trainer.export_hf_on_save,
                                              extra_state={"coordinator": state.to_json()})
            timeout = self.loop_cfg.step_timeout_s
            if self.critic is not None:
                self.critic.call(self.critic.stub.Save, request, timeout_s=timeout, what="Save")
            reply = self.trainer.call(self.trainer.stub.Save, request, timeout_s=timeout, what="Save")
        self.state = _replace(state, history=(*self.state.history, reply.path)[-20:])
        self.last_checkpoint = reply.path
        self.last_saved_rollout = rollout_id
        where = f"{reply.path} (final; Hugging Face model in {reply.hf_path})" if final and reply.hf_path else reply.path
        self.events.emit("save", rollout_id=rollout_id, message=where)
        log.info("saved rollout %d to %s", rollout_id, where)

    def _eval_due(self, rollout_id: int) -> bool:
        interval = self.loop_cfg.eval_interval
        return bool(interval) and ((rollout_id + 1) % interval == 0 or rollout_id + 1 == self.num_rollout)

    def _evaluated(self, rollout_id: int) -> bool:
        return rollout_id in self._evaluated_ids

    def _submit_eval(self, rollout_id: int) -> None:
        self._evaluated_ids.add(rollout_id)
        fut = self.evals.submit(lambda: self._record_eval(rollout_id=rollout_id, metrics=self.evaluate()))
        self.eval_futures.append(fut)

    def evaluate(self) -> dict[str, float]:
        cfg = self.config
        path = cfg.data.eval_path or cfg.data.train_path
        prompts = load_prompts(path, prompt_key=cfg.data.prompt_key, label_key=cfg.data.label_key,
                               limit=cfg.data.eval_max_prompts)
        protos = [common_pb2.Prompt(text=p.text, label=p.label, group_id=i, metadata=p.metadata)
                  for i, p in enumerate(prompts)]
        sampling = SamplingSpec.from_config(cfg.rollout.eval_sampling).to_proto()
        shares = [protos[i::len(self.pool.clients)] for i in range(len(self.pool.clients))]
        with span("rl.eval", weight_version=self.state.weight_version, prompts=len(protos)):
            replies = self.pool.broadcast_each("Evaluate", [rollout_pb2.EvaluateRequest(
                name="eval", prompts=share, n_samples_per_prompt=cfg.rollout.eval_n_samples_per_prompt,
                sampling=sampling) for share in shares], timeout_s=self.loop_cfg.step_timeout_s)
        return weighted_mean([dict(r.metrics) for r in replies], [len(s) for s in shares])

    def _record_eval(self, *, rollout_id: int, metrics: dict[str, float]) -> dict[str, float]:
        metrics = {**metrics, "weights/version": float(self.state.weight_version)}
        for tracker in self.trackers:
            tracker.log(rollout_id, metrics)
        self.events.emit("eval", rollout_id=rollout_id, metrics=metrics)
        return metrics

    def _release_rollout_memory(self, metrics: dict[str, float]) -> None:
        """offload_rollout: the engines give their GPU memory to the trainer for the step (sync mode only, so
        no generation runs now; a pending eval finishes first)."""
        if not self.loop_cfg.offload_rollout:
            return
        with _timed(metrics, "perf/rollout_release_s"):
            for fut in self.eval_futures:
                fut.result()
            self.pool.broadcast("ReleaseMemory", rollout_pb2.MemoryRequest(tags=[]), timeout_s=120)
        self.rollout_released = {"weights", "kv_cache", "cuda_graph"}
        states = self.pool.broadcast("GetState", common_pb2.Empty(), timeout_s=30)
        metrics["memory/rollout_gpu_gb_released"] = sum(s.gpu_memory_reserved_bytes for s in states) / 2**30

    def _resume_rollout_memory(self, tags: tuple[str, ...], metrics: dict[str, float]) -> None:
        tags = tuple(t for t in tags if t in self.rollout_released)
        if tags:
            with _timed(metrics, "perf/rollout_resume_s"), span("rl.rollout_resume", tags=",".join(tags)):
                self.pool.broadcast("ResumeMemory", rollout_pb2.MemoryRequest(tags=list(tags)), timeout_s=120)
            self.rollout_released -= set(tags)

    def _trainer_gpu_gb(self) -> float:
        state = self.trainer.call(self.trainer.stub.GetState, common_pb2.Empty(), timeout_s=30, what="GetState")
        return state.gpu_memory_reserved_bytes / 2**30

    def _offload_trainer(self, metrics: dict[str, float]) -> None:
        """offload_train: the trainer hands its GPU memory back once the step is done with it (train and sync)."""
        if not self.loop_cfg.offload_train:
            return
        metrics["memory/trainer_gpu_gb_training"] = self._trainer_gpu_gb()
        with _timed(metrics, "perf/trainer_offload_s"), span("rl.offload"):
            self.trainer.call(self.trainer.stub.Offload, common_pb2.Empty(), timeout_s=120, what="Offload")
        self.offloaded = True
        metrics["memory/trainer_gpu_gb_offloaded"] = self._trainer_gpu_gb()

    def _onload(self, metrics: dict[str, float]) -> None:
        if self.offloaded:
            with _timed(metrics, "perf/trainer_onload_s"), span("rl.onload"):
                self.trainer.call(self.trainer.stub.Onload, common_pb2.Empty(), timeout_s=120, what="Onload")
            self.offloaded = False


@contextlib.contextmanager
def _timed(metrics: dict[str, float], key: str) -> Iterator[None]:
    """Adds the block's seconds to metrics[key] (a step may move memory more than once)."""
    t = time.monotonic()
    try:
        yield
    finally:
        metrics[key] = metrics.get(key, 0.0) + time.monotonic() - t


def _done(value: object) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


def _replace(state: RunState, **changes: object) -> RunState:
    from dataclasses import replace

    return replace(state, **changes)
