"""The run loop (reference semantics: miles' `train_async.py`, one step off-policy).

    start up: wait for services, load the latest checkpoint, push weights (version v), eval before training
    for rollout_id in range(start, num_rollout):
        batch = the generation in flight for rollout_id;  start generating rollout_id + 1
        train (PPO: critic first, then the actor once past num_critic_only_steps)
        every update_weights_interval steps: wait for generation (unless rollout.inflight_update: then the sync lands
        between two of its decode steps), then sync weights;  save when due
        eval when due (asynchronously), drained at the end

Its decisions are pure functions (policy.py); memory moves (memory.py), evals (evals.py) and the start-up's pieces
(run_start.py) live beside it. Every collaborator is injected: it takes builder.CoordinatorParts
(builder.build_coordinator wires the real ones).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from services.contracts import runfacts
from services.contracts.trainer_calls import SaveRequest, TrainRequest, TrainResult
from services.coordinator import policy
from services.coordinator.control import Control
from services.coordinator.evals import Evaluator
from services.coordinator.generation import Generator
from services.coordinator.memory import ENGINE_CACHES, ENGINE_WEIGHTS, MemoryMoves
from services.coordinator.run_start import keep_reusable, restore, wait_for_services
from services.coordinator.seams import (
    GenerationResult,
    InFlight,
    TrainerApi,
)
from services.coordinator.state import GeneratedBatch, RunState
from services.coordinator.stepmetrics import generation_metrics, prefixed, span_attributes
from services.coordinator.streaming import GroupStream
from services.telemetry.process_age import process_age_s
from services.telemetry.tracing import StepSpans, annotate, inject_context, set_attributes, span

if TYPE_CHECKING:
    from services.coordinator.builder import CoordinatorParts

log = logging.getLogger(__name__)

HISTORY_KEPT = 20  # checkpoint paths remembered in the run state


class Coordinator:
    def __init__(self, parts: CoordinatorParts):
        self.parts = parts
        config = self.config = parts.config
        self.loop_cfg = config.loop
        self.inflight_update = config.rollout.inflight_update
        self.run_dir = parts.run_dir
        self.trainer, self.critic, self.pool, self.sync = parts.trainer, parts.critic, parts.pool, parts.sync
        self.data, self.buffer, self.trackers = parts.data, parts.buffer, parts.trackers
        self.generations, self.events, self.clock = parts.generations, parts.events, parts.clock
        self.train_retry = parts.train_retry
        self.control = Control()
        self.num_rollout = runfacts.num_rollout(config, dataset_size=self.data.size)
        self.state = RunState()
        self.memory = MemoryMoves(
            trainer=self.trainer,
            pool=self.pool,
            offload_train=config.loop.offload_train,
            offload_rollout=config.loop.offload_rollout,
            clock=self.clock,
        )
        self.evals = Evaluator(
            pool=self.pool,
            rollout=config.rollout,
            prompts=parts.eval_prompts,
            executor=parts.evals,
            trackers=self.trackers,
            events=self.events,
            weight_version=lambda: self.state.weight_version,
        )
        self.step_spans = StepSpans()  # one trace per rollout id, opened when its generation starts
        self.generator = Generator(
            config=config,
            pool=self.pool,
            data=self.data,
            executor=self.generations,
            spans=self.step_spans,
            clock=self.clock,
        )
        self.stream = (
            GroupStream(config=config, pool=self.pool, data=self.data, executor=self.generations, clock=self.clock)
            if config.loop.mode == "streaming"
            else None
        )
        self.last_metrics: dict[str, float] = {}
        self.last_checkpoint = ""
        self.last_saved_rollout = -1
        self.status = "starting"
        self.error = ""
        self._start_id = 0
        self._epoch_ends: set[int] = set()
        # where the coordinator's start-up went (reported with the first step as perf/startup_*_s)
        self.startup_seconds: dict[str, float] = {}

    # ---- the loop ---------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            with span("rl.startup", mode=self.loop_cfg.mode):  # checkpoint load, first weight push, first eval
                finished = self._startup()
            if not finished:
                self._start_id = self.state.next_rollout_id
                self.status = "running"
                match self.loop_cfg.mode:
                    case "fully_async":
                        self._run_fully_async()
                    case "streaming":
                        self._run_streaming()
                    case _:
                        self._run_one_step_off()
                self._finish()
            self.status = "finished"
        except Exception as exc:
            self.status, self.error = "failed", f"{type(exc).__name__}: {exc}"
            self.events.emit("state", message=f"failed: {self.error}")
            raise
        finally:
            self.step_spans.close_all(trained=False)  # generations started but never trained
            self.events.emit("state", message=self.status)
            self.events.close()

    def _run_one_step_off(self) -> None:
        """sync: generate, train, sync. async: the next batch generates while this one trains."""
        overlap = policy.overlaps(self.loop_cfg.mode)
        upcoming: InFlight | None = self._generation_for(self.state.next_rollout_id)
        for rollout_id in range(self.state.next_rollout_id, self.num_rollout):
            if not self.control.wait_while_paused(self.status_setter):
                break
            with self.step_spans.step(rollout_id):
                step_start = self.clock.monotonic()
                assert upcoming is not None  # started above or by the previous step
                current = self._awaited(upcoming)
                wait_s = self.clock.monotonic() - step_start
                more = rollout_id + 1 < self.num_rollout
                upcoming = self._generation_for(rollout_id + 1) if overlap and more else None
                metrics = self._train_step(rollout_id, current)
                metrics["perf/rollout_wait_s"] = wait_s
                if policy.sync_due(rollout_id, interval=self.loop_cfg.update_weights_interval, mode=self.loop_cfg.mode):
                    if upcoming is not None and policy.waits_for_generation_before_sync(self.inflight_update):
                        upcoming.result()  # else the sync lands between two of its decode steps
                    metrics.update(self._sync_weights())
                self.memory.offload_trainer(metrics)  # after the sync, which needs the weights
                if not overlap and more:
                    upcoming = self._generation_for(rollout_id + 1)
                self._after_step(rollout_id, metrics, step_start=step_start, in_flight=[upcoming] if upcoming else [])
            if self._should_exit(rollout_id):
                break

    def _run_fully_async(self) -> None:
        """Generation runs continuously (one call in flight per replica); each step trains the oldest
        finished batch; samples older than max_staleness are dropped by the trainer and counted."""
        in_flight: list[InFlight] = []
        next_id = self.state.next_rollout_id
        for rollout_id in range(self.state.next_rollout_id, self.num_rollout):
            if not self.control.wait_while_paused(self.status_setter):
                break
            while policy.may_start_generation(
                len(in_flight), replicas=self.pool.size, next_id=next_id, num_rollout=self.num_rollout
            ):
                in_flight.append(self._generation_for(next_id))
                next_id += 1
            with self.step_spans.step(rollout_id):
                step_start = self.clock.monotonic()
                metrics = self._train_step(
                    rollout_id, self._awaited(in_flight.pop(0)), max_staleness=self.loop_cfg.max_staleness
                )
                if policy.sync_due(rollout_id, interval=self.loop_cfg.update_weights_interval, mode=self.loop_cfg.mode):
                    metrics.update(self._sync_weights())
                self.memory.offload_trainer(metrics)
                self._after_step(rollout_id, metrics, step_start=step_start, in_flight=in_flight)
            if self._should_exit(rollout_id):
                break

    def _run_streaming(self) -> None:
        """Groups generate continuously (streaming.py); each step trains the first rollout_batch_size done, samples
        older than max_staleness dropped by the trainer."""
        stream = self.stream
        assert stream is not None
        stream.needed = (self.num_rollout - self.state.next_rollout_id) * self.config.rollout.rollout_batch_size
        for rollout_id in range(self.state.next_rollout_id, self.num_rollout):
            if not self.control.wait_while_paused(self.status_setter):
                break
            stream.fill()
            with self.step_spans.step(rollout_id):
                step_start = self.clock.monotonic()
                gen = stream.take(rollout_id)
                metrics = self._train_step(rollout_id, gen, max_staleness=self.loop_cfg.max_staleness)
                metrics["perf/rollout_wait_s"] = gen.seconds
                if policy.sync_due(rollout_id, interval=self.loop_cfg.update_weights_interval, mode=self.loop_cfg.mode):
                    metrics.update(self._sync_weights())
                self.memory.offload_trainer(metrics)
                self._after_step(rollout_id, metrics, step_start=step_start, in_flight=[])
            if self._should_exit(rollout_id):
                break

    def status_setter(self, status: str) -> None:
        self.status = status
        self.events.emit("state", message=status)

    # ---- start-up / finish --------------------------------------------------------------------------

    def _startup(self) -> bool:
        """True when the checkpoint shows the run already finished: nothing to do, nothing to log again."""
        started = self.clock.monotonic()
        wait_for_services(
            [self.trainer, *([self.critic] if self.critic else []), self.pool],
            timeout_s=self.loop_cfg.startup_timeout_s,
        )
        self.startup_seconds["services"] = self.clock.monotonic() - started
        restored = restore(self.trainer, self.critic)
        self.state, self.last_checkpoint = restored.state, restored.checkpoint
        self.data.cursor = self.state.cursor
        if self.buffer is not None:
            self.state = keep_reusable(self.state, self.buffer)
        if self.stream is not None:
            self.stream.restore(self.state.groups)
        done = self.state.next_rollout_id
        if runfacts.is_finished(next_rollout_id=done, num_rollout=self.num_rollout):
            message = runfacts.finished_message(
                done=done, num_rollout=self.num_rollout, checkpoint=self.last_checkpoint
            )
            log.info("%s", message)
            self.events.emit("state", rollout_id=done - 1, message=message)
            return True
        for tracker in self.trackers:  # steps after the checkpoint are trained again: drop their old rows
            tracker.rewind(next_step=done)
        self.events.emit("state", rollout_id=done, message=f"starting at rollout {done} of {self.num_rollout}")
        metrics = self._sync_weights(bump=False)
        self.startup_seconds["first_sync"] = metrics["perf/weight_sync_time_s"]
        log.info(
            "initial weights pushed: version %d (%.2fs)", self.state.weight_version, metrics["perf/weight_sync_time_s"]
        )
        if policy.eval_before_training(
            interval=self.loop_cfg.eval_interval, next_rollout_id=done, skip=self.loop_cfg.skip_eval_before_train
        ):
            t = self.clock.monotonic()
            self.evals.run_now(-1)
            self.startup_seconds["first_eval"] = self.clock.monotonic() - t
        self.startup_seconds["total"] = self.clock.monotonic() - started
        return False

    def _finish(self) -> None:
        last = self.state.next_rollout_id - 1
        with self.step_spans.after(last):  # the final eval / save join the last step's trace
            if policy.final_eval_due(last, interval=self.loop_cfg.eval_interval, evaluated=self.evals.evaluated(last)):
                self.evals.submit(last)
            self.evals.drain()
            if policy.final_save_due(last, stopped=self.control.stop_requested, last_saved=self.last_saved_rollout):
                self._save(last, in_flight=[], final=True)

    # ---- steps ------------------------------------------------------------------------------------

    def _generation_for(self, rollout_id: int) -> InFlight:
        return self.generator.start(rollout_id, pending=self.state.pending, weight_version=self.state.weight_version)

    def _awaited(self, gen: InFlight) -> GenerationResult:
        """The generation of the step about to train; an epoch it ended makes the step a save point."""
        result = gen.result()
        if result.epoch_end:
            self._epoch_ends.add(gen.rollout_id)
        return result

    def _train_step(self, rollout_id: int, gen: GenerationResult, *, max_staleness: int = -1) -> dict[str, float]:
        metrics = generation_metrics(gen, weight_version=self.state.weight_version)
        self.memory.release_engines(metrics, first=self.evals.drain)
        self.memory.onload_trainer(metrics)
        warm_up = policy.critic_only(
            rollout_id,
            has_critic=self.critic is not None,
            num_critic_only_steps=self.config.algorithm.num_critic_only_steps,
        )
        with span(
            "rl.train",
            rollout_id=rollout_id,
            weight_version=self.state.weight_version,
            entries=len(gen.entry_ids),
            staleness=metrics.get("rollout/staleness"),
        ) as train_span:
            t = self.clock.monotonic()

            def request(*, use_critic_values: bool) -> TrainRequest:
                return TrainRequest(
                    rollout_id=rollout_id,
                    entry_ids=tuple(gen.entry_ids),
                    max_staleness=max_staleness,
                    trace_context=inject_context(),
                    use_critic_values=use_critic_values,
                )

            if self.critic is not None:
                metrics.update(prefixed("critic", self._train(self.critic, request(use_critic_values=False)).metrics))
            reply = None
            if warm_up:
                self._skip_for_actor(gen)
            else:
                reply = self._train(self.trainer, request(use_critic_values=self.critic is not None))
                metrics.update(prefixed("train", reply.metrics))
                set_attributes(train_span, **span_attributes(reply.metrics))
            metrics["perf/train_time_s"] = self.clock.monotonic() - t
        generated = int(metrics.get("rollout/num_samples", 0))
        self.state = self.state.trained(
            rollout_id,
            generated=generated,
            trained=reply.samples_trained if reply is not None else 0,
            dropped_stale=reply.samples_dropped_stale if reply is not None else 0,
            filtered=reply.samples_filtered if reply is not None else 0,
            critic_only=generated if reply is None else 0,
        )
        metrics["rollout/stale_dropped"] = float(reply.samples_dropped_stale if reply is not None else 0)
        metrics["rollout/stale_dropped_total"] = float(self.state.samples_dropped_stale)
        if self.config.rollout.dynamic_sampling.enabled:
            metrics["rollout/filtered_samples"] = float(reply.samples_filtered if reply is not None else 0)
            metrics["rollout/filtered_samples_total"] = float(self.state.samples_filtered)
        return metrics

    def _train(self, client: TrainerApi, request: TrainRequest) -> TrainResult:
        return self.train_retry.call(lambda: client.train(request), clock=self.clock)

    def _skip_for_actor(self, gen: GenerationResult) -> None:
        """A critic-only step: the actor never trains these entries. Without counting them as its share, they
        would stay in the stream and hold the bound on waiting batches (a stall once num_critic_only_steps >=
        redis.max_buffered_batches)."""
        if self.buffer is not None:
            self.buffer.skip(list(gen.entry_ids), group="actor")

    def _sync_weights(self, *, bump: bool = True) -> dict[str, float]:
        moves: dict[str, float] = {}
        self.memory.onload_trainer(moves)
        version = self.state.weight_version + (1 if bump else 0)
        self.memory.resume_engines(ENGINE_WEIGHTS, moves)  # the sync needs the destination tensors back
        result = self.sync.run(version=version)
        self.memory.resume_engines(ENGINE_CACHES, moves)
        self.state = replace(self.state, weight_version=version, weights_pushed=True)
        self.events.emit(
            "sync",
            rollout_id=self.state.next_rollout_id - 1,
            metrics={"weight_version": version, "seconds": result.seconds, "gbps": result.gbps},
        )
        phases = {f"perf/sync_{phase}_s": seconds for phase, seconds in result.phase_seconds.items()}
        return {
            **moves,
            **phases,
            "perf/weight_sync_time_s": result.seconds,
            "perf/weight_sync_gbps": result.gbps,
            "weights/version": float(version),
            "weights/bytes": float(result.bytes),
            "weights/verified_tensors": float(result.verified_tensors),
        }

    def _after_step(
        self, rollout_id: int, metrics: dict[str, float], *, step_start: float, in_flight: list[InFlight]
    ) -> None:
        final = self._is_final(rollout_id)
        requested = self.control.take_save_request(sentinel=self.loop_cfg.save_trigger_sentinel)
        if policy.save_due(
            rollout_id,
            interval=self.loop_cfg.save_interval,
            epoch_end=rollout_id in self._epoch_ends,
            requested=requested,
            final=final,
        ):
            t = self.clock.monotonic()
            self._save(rollout_id, in_flight=in_flight, final=final)
            metrics["perf/save_time_s"] = self.clock.monotonic() - t
        if policy.eval_due(rollout_id, interval=self.loop_cfg.eval_interval, num_rollout=self.num_rollout):
            self.evals.submit(rollout_id)
        step_s = metrics["perf/step_time_s"] = self.clock.monotonic() - step_start
        metrics["perf/tokens_per_s"] = metrics.get("rollout/response_tokens", 0.0) / step_s if step_s else 0.0
        metrics["weights/version"] = float(self.state.weight_version)
        metrics["data/epoch"] = float(self.data.cursor.epoch)
        if rollout_id == self._start_id:  # the run's first step: where the coordinator's start-up went
            metrics.update({f"perf/startup_{k}_s": v for k, v in self.startup_seconds.items()})
            metrics["perf/startup_to_first_step_s"] = process_age_s()
        annotate(
            staleness=metrics.get("rollout/staleness"),
            tokens=metrics.get("rollout/response_tokens"),
            step_time_s=step_s,
        )  # on the step's rl.loop span
        self.last_metrics = metrics
        for tracker in self.trackers:
            tracker.log(rollout_id, metrics)
        self.events.emit("step", rollout_id=rollout_id, metrics=metrics)

    def _should_exit(self, rollout_id: int) -> bool:
        return policy.should_exit(
            rollout_id,
            start_id=self._start_id,
            stop_requested=self.control.stop_requested,
            exit_after=self.loop_cfg.debug_exit_after_rollout,
        )

    def _is_final(self, rollout_id: int) -> bool:
        return policy.is_final(rollout_id, num_rollout=self.num_rollout, exiting=self._should_exit(rollout_id))

    def _save(self, rollout_id: int, *, in_flight: list[InFlight], final: bool) -> None:
        """A checkpoint of the step, with the generations in flight (waited for, so a resume reuses their entries);
        the run's final one always carries a Hugging Face export in its hf/ directory."""
        if self.stream is not None:  # the groups drawn and not trained (the final save waits for those generating)
            state = replace(
                self.state,
                next_rollout_id=rollout_id + 1,
                cursor=self.data.cursor,
                groups=self.stream.outstanding(wait=final),
            )
        else:
            pending = tuple(_recorded(g, weight_version=self.state.weight_version) for g in in_flight)
            cursor = pending[0].cursor_before if pending else self.data.cursor
            state = replace(self.state, next_rollout_id=rollout_id + 1, cursor=cursor, pending=pending)
        with span("rl.save", rollout_id=rollout_id):
            request = SaveRequest(
                rollout_id=rollout_id,
                export_hf=final or self.config.trainer.export_hf_on_save,
                extra_state={"coordinator": state.to_json()},
            )
            if self.critic is not None:
                self.critic.save(request)
            reply = self.trainer.save(request)
        self.state = replace(state, history=(*self.state.history, reply.path)[-HISTORY_KEPT:])
        self.last_checkpoint = reply.path
        self.last_saved_rollout = rollout_id
        where = reply.path
        if final and reply.hf_path:
            where = f"{reply.path} (final; Hugging Face model in {reply.hf_path})"
        self.events.emit("save", rollout_id=rollout_id, message=where)
        log.info("saved rollout %d to %s", rollout_id, where)


def _recorded(gen: InFlight, *, weight_version: int) -> GeneratedBatch:
    """What a checkpoint records of a generation in flight (waiting for it), for a resume to reuse."""
    result = gen.result()
    cursor_after = result.cursor_after if result.cursor_after is not None else gen.cursor_after  # the last round's
    return GeneratedBatch(
        rollout_id=gen.rollout_id,
        entry_ids=result.entry_ids,
        cursor_before=gen.cursor_before,
        cursor_after=cursor_after,
        metrics=generation_metrics(result, weight_version=weight_version),
    )
