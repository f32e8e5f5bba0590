"""The last step of a service process: it exits in bounded time, even where a thread is still stuck in a call.

A gRPC handler blocked in a collective or a socket read to a peer that died keeps running after the server
stopped, and Python joins such threads at exit: the process would outlive services.timeouts.shutdown_s and be
SIGKILLed by whoever waits for it, with no word of why. A daemon watchdog, which keeps running while the
interpreter joins the others, names the stuck threads in the log and ends the process."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback

log = logging.getLogger(__name__)


def busy_threads() -> dict[str, str]:
    """Name -> stack of every other non-daemon thread still alive: what interpreter exit waits for."""
    frames = sys._current_frames()
    me = threading.current_thread()
    return {t.name: "".join(traceback.format_stack(frames[t.ident])) if t.ident in frames else "(no frame)\n"
            for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive()}


def arm_exit_watchdog(code: int, *, name: str, after_s: float) -> None:
    """If the process still runs `after_s` from now, log what holds it and end it with `code`."""
    def expire() -> None:
        time.sleep(after_s)
        for thread, stack in busy_threads().items():
            log.warning("%s did not exit within %.1fs: thread %r still runs:\n%s", name, after_s, thread, stack)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    threading.Thread(target=expire, name="exit-watchdog", daemon=True).start()
