"""Control flags the gRPC control API sets and the loop reads between steps."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


class Control:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._save = False
        self._stop = threading.Event()
        self._running = threading.Event()
        self._running.set()

    def request_save(self) -> None:
        with self._lock:
            self._save = True

    def take_save_request(self, *, sentinel: str | None = None) -> bool:
        """`tandem ctl save` since the last call, or the `sentinel` file appeared (it is removed: one save each
        time it appears)."""
        with self._lock:
            requested, self._save = self._save, False
        if requested:
            return True
        if sentinel and Path(sentinel).exists():
            Path(sentinel).unlink(missing_ok=True)
            log.info("save triggered by sentinel %s", sentinel)
            return True
        return False

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def stop(self) -> None:
        self._stop.set()
        self._running.set()  # a paused run must wake up to stop

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def wait_while_paused(self, on_change: Callable[[str], None]) -> bool:
        """Blocks while paused; returns False when a stop was requested."""
        if self.paused:
            on_change("paused")
            self._running.wait()
            on_change("running")
        return not self.stop_requested
