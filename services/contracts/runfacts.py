"""Facts about a run that more than one service decides on: how many rollouts it has, and whether it is done.

The coordinator's loop, `tandem run`'s preflight and `tandem ctl` all ask these questions; each has one answer here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.contracts.config import TandemConfig


RUN_MARKER = "run.json"  # in RUN_DIR while `tandem run` runs it (pid, coordinator address): how `tandem ctl` finds it


def num_rollout(config: TandemConfig, *, dataset_size: int) -> int:
    """loop.num_rollout, else every prompt once per epoch in steps of rollout.rollout_batch_size (an epoch's ragged
    tail is dropped) times data.num_epochs."""
    if config.loop.num_rollout is not None:
        return config.loop.num_rollout
    return (dataset_size // config.rollout.rollout_batch_size) * config.data.num_epochs


def is_finished(*, next_rollout_id: int, num_rollout: int) -> bool:
    return next_rollout_id >= num_rollout


def finished_message(*, done: int, num_rollout: int, checkpoint: str) -> str:
    return (
        f"this run already finished: {done} of {num_rollout} rollouts trained, last checkpoint {checkpoint}; "
        "raise loop.num_rollout to train further, or use a new --run-dir"
    )


def reward_timeout_s(config: TandemConfig) -> float:
    """The deadline of one reward call: rollout.reward_timeout_s, else half the Generate's own deadline
    (loop.step_timeout_s), so that a reward that hangs is named before the Generate times out."""
    return config.rollout.reward_timeout_s or config.loop.step_timeout_s / 2


UNBOUNDED_CONTEXT = 1 << 30  # neither the config nor the model says


def context_length(*, configured: int | None, model_positions: int | None) -> int:
    """Prompt + response tokens one sequence may hold: rollout.max_context_length, capped by the model's
    max_position_embeddings. The rollout engine generates within it; preflight checks the prompts against it."""
    known = [n for n in (configured, model_positions) if n]
    return min(known) if known else UNBOUNDED_CONTEXT


def model_positions(model_dir: str | Path) -> int | None:
    """max_position_embeddings of a Hugging Face model directory's config.json (None: not given)."""
    try:
        value = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None
