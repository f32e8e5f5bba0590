"""The loop's decisions, as pure functions of the step and the config values they read: when to sync, save,
evaluate and stop. Each has a one-line test (tests/test_coordinator_loop.py)."""

from __future__ import annotations


def overlaps(mode: str) -> bool:
    """async: the next batch is generated while the current one trains (one step off-policy)."""
    return mode == "async"


def sync_due(rollout_id: int, *, interval: int, mode: str) -> bool:
    """Weights go to the engines every `interval` steps; in sync mode after every step (on-policy)."""
    return mode == "sync" or (rollout_id + 1) % interval == 0


def sync_pause_mode(inflight_update: str) -> str:
    """How a weight sync pauses the engines: drain waits for running generation; with rollout.inflight_update the
    sync lands between two decode steps (in_place keeps the KV cache, retract has it recomputed)."""
    return {"off": "drain", "keep": "in_place", "recompute": "retract"}[inflight_update]


def waits_for_generation_before_sync(inflight_update: str) -> bool:
    """async mode: the next batch's generation must finish before a sync, unless the sync lands in flight."""
    return inflight_update == "off"


def should_exit(rollout_id: int, *, start_id: int, stop_requested: bool, exit_after: int | None) -> bool:
    """A Stop, or loop.debug_exit_after_rollout steps done since this process started."""
    return stop_requested or (exit_after is not None and rollout_id + 1 - start_id >= exit_after)


def is_final(rollout_id: int, *, num_rollout: int, exiting: bool) -> bool:
    """The run ends after this step: its last step, or an exit (always saved)."""
    return rollout_id + 1 >= num_rollout or exiting


def save_due(rollout_id: int, *, interval: int | None, epoch_end: bool, requested: bool, final: bool) -> bool:
    """Asked for (ctl save, the sentinel), the last step, or every save_interval steps and at each epoch's end."""
    periodic = interval is not None and ((rollout_id + 1) % interval == 0 or epoch_end)
    return requested or final or periodic


def eval_due(rollout_id: int, *, interval: int | None, num_rollout: int) -> bool:
    """Every eval_interval steps, and after the run's last step."""
    return interval is not None and ((rollout_id + 1) % interval == 0 or rollout_id + 1 == num_rollout)


def eval_before_training(*, interval: int | None, next_rollout_id: int, skip: bool) -> bool:
    """A fresh run with evals on measures the initial weights, unless loop.skip_eval_before_train."""
    return interval is not None and next_rollout_id == 0 and not skip


def final_eval_due(last: int, *, interval: int | None, evaluated: bool) -> bool:
    """A run that ends (a Stop, debug_exit_after_rollout) off the eval interval is evaluated once more."""
    return last >= 0 and interval is not None and not evaluated


def final_save_due(last: int, *, stopped: bool, last_saved: int) -> bool:
    """A stopped run's last trained step gets a checkpoint unless it has one."""
    return stopped and last >= 0 and last_saved != last


def critic_only(rollout_id: int, *, has_critic: bool, num_critic_only_steps: int) -> bool:
    """PPO warm-up: the first num_critic_only_steps steps train the critic alone."""
    return has_critic and rollout_id < num_critic_only_steps


def may_start_generation(in_flight: int, *, replicas: int, next_id: int, num_rollout: int) -> bool:
    """fully_async keeps one generation per replica in flight, plus the one the trainer waits for."""
    return in_flight < replicas + 1 and next_id < num_rollout
