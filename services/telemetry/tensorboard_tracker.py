"""The TensorBoard tracker (`tracing.trackers: [tensorboard]`; needs the optional `tensorboard` package)."""

from __future__ import annotations

from pathlib import Path

from services.telemetry.trackers import Tracker


class TensorBoardTracker(Tracker):
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def rewind(self, *, next_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = self.writer.log_dir
        self.writer.close()  # purge_step: TensorBoard hides the old events of steps >= next_step
        self.writer = SummaryWriter(log_dir=log_dir, purge_step=next_step)

    def close(self) -> None:
        self.writer.close()
