"""The Weights & Biases tracker (`tracing.trackers: [wandb]`, the optional `wandb` extra).

W&B's history is indexed by `_step`, which only goes up: a row logged for a step below the run's current one is
dropped ("steps must be monotonically increasing"). So:

- a step row goes to W&B step = its rollout id; an eval row (logged when the asynchronous eval finishes, maybe after
  later steps) joins the newest row, with its own x-axis `eval/rollout_id` (`define_metric("eval/*", ...)`);
- one W&B run per run directory: its id is kept in RUN_DIR/wandb/tandem-wandb.json with the last step logged, and a
  resumed run takes the same id. The rewind-on-resume rule of the other trackers holds: rows of steps from
  `next_step` on, logged before the crash, are replaced by the retrained ones, never logged twice. When such rows
  exist the run is resumed with `resume_from="<id>?_step=<next_step - 1>"` (W&B truncates its history after that
  step and continues at next_step; offline, WANDB_MODE=offline, the rewind is recorded in the run's files and
  applied by `wandb sync`); when none do, with `resume="allow"`. A run that starts over from rollout 0 keeps
  nothing, so it gets a new id.

wandb.init runs at the first rewind (the coordinator's start-up, once it knows where it resumes) or log.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from pathlib import Path
from typing import Any

from services.contracts.config import ConfigError
from services.contracts.files import write_json_atomic
from services.telemetry.trackers import Tracker

log = logging.getLogger(__name__)

STATE_FILE = "tandem-wandb.json"  # under RUN_DIR/wandb/, beside wandb's own files
EVAL_STEP = "eval/rollout_id"  # the x-axis of eval rows


class WandbTracker(Tracker):
    def __init__(self, *, project: str | None, run_name: str, run_dir: Path):
        self.project, self.run_name, self.run_dir = project or "tandem", run_name, run_dir
        self.state_path = run_dir / "wandb" / STATE_FILE
        self.run: Any = None
        self.run_id = ""
        self._last = -1  # the newest W&B step logged to this run
        self._lock = threading.Lock()  # the eval thread logs too

    # ---- Tracker ----------------------------------------------------------------------------------

    def rewind(self, *, next_step: int) -> None:
        with self._lock:
            if self.run is not None:
                self.run.finish()
            self._start(next_step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        with self._lock:
            if self.run is None:
                self._start(max(step, 0))
            row: dict[str, float] = dict(metrics)
            if metrics and all(key.startswith("eval/") for key in metrics):
                row[EVAL_STEP] = float(step)
            wandb_step = max(step, self._last, 0)  # never below the newest: W&B would drop the row
            self.run.log(row, step=wandb_step)
            if wandb_step > self._last:
                self._last = wandb_step
                self._save_state()

    def close(self) -> None:
        with self._lock:
            if self.run is not None:
                self.run.finish()
                self.run = None

    # ---- the run ----------------------------------------------------------------------------------

    def _start(self, next_step: int) -> None:
        import wandb

        saved = self._read_state()
        if saved is None or next_step == 0:  # a new run; one that starts over from rollout 0 keeps nothing
            self.run_id, self._last = uuid.uuid4().hex[:12], -1
            how: dict[str, Any] = {"id": self.run_id}
        elif saved[1] < next_step:  # nothing logged past the checkpoint: carry on
            self.run_id, self._last = saved
            how = {"id": self.run_id, "resume": "allow"}
        else:  # rows of steps >= next_step exist: W&B drops them, keeps the rest
            self.run_id, self._last = saved[0], next_step - 1
            how = {"resume_from": f"{self.run_id}?_step={next_step - 1}"}
            log.info(
                "wandb: run %s rewound to step %d (steps from %d on are trained again)",
                self.run_id,
                next_step - 1,
                next_step,
            )
        try:
            self.run = wandb.init(project=self.project, name=self.run_name, dir=str(self.run_dir), **how)
        except Exception as exc:  # wandb raises its own types (no login, no network, ...)
            raise ConfigError(
                f"tracing.trackers: wandb could not start run {self.run_id}: {type(exc).__name__}: "
                f"{exc} (without network or login: WANDB_MODE=offline)"
            ) from exc
        self.run.define_metric(EVAL_STEP)
        self.run.define_metric("eval/*", step_metric=EVAL_STEP)
        self._save_state()

    def _read_state(self) -> tuple[str, int] | None:
        try:
            data = json.loads(self.state_path.read_text())
            return str(data["id"]), int(data["last_step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _save_state(self) -> None:
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.state_path, {"id": self.run_id, "last_step": self._last})
