"""The last step of a service process: it hears SIGTERM whichever thread the kernel hands it to, and it exits in
bounded time, even where a thread is still stuck in a call.

Hearing it: the kernel may give a process-directed signal to any thread that does not block it. A thread that is
starting a thread (glibc blocks every signal around `clone`) or changing its signal mask takes a pending signal
that the main thread was woken for but has not run for yet, which is common on a loaded machine. CPython's C
handler then runs in that thread and only flags the signal for the main thread, which sleeps on in a lock
(`Event.wait()`) and never runs the Python handler: the service ignored SIGTERM until SIGKILL, its log without a
line of why. The C handler also writes the signal's number to the wakeup fd, from whatever thread it runs in;
`StopSignals` reads that fd in a thread of its own.

Exiting: a gRPC handler blocked in a collective or a socket read to a peer that died keeps running after the server
stopped, and Python joins such threads at exit; interpreter finalization then runs destructors (process groups,
channels) in an order nobody controls, where a daemon watchdog can no longer run. So the watchdog is armed as the
stop begins, for most of services.timeouts.shutdown_s, names the stuck threads in the log and ends the process; and a
service that finished its stop ends with `exit_now`, without finalization."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# The share of services.timeouts.shutdown_s after which the watchdog ends a stopping service; the rest is for its
# last log lines and the exit, before a supervisor that waits the whole budget sends SIGKILL.
WATCHDOG_SHARE = 0.9


class StopSignals:
    """SIGTERM and SIGINT as an event (`wait`, `received`), whichever thread the kernel delivers them to.
    `on_signal(signum, count)` runs in the watcher thread for each one (count: how many so far), while the main
    thread may be anywhere, asleep in a lock included."""

    def __init__(
        self, *, on_signal: Callable[[int, int], None] | None = None, signals: Iterable[signal.Signals] = STOP_SIGNALS
    ):
        self._signals = frozenset(int(s) for s in signals)
        self._on_signal = on_signal
        self.received = threading.Event()
        self.signum: int | None = None
        self.count = 0
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        for sig in self._signals:  # a Python handler (a no-op), so that the C handler writes to the wakeup fd
            signal.signal(sig, lambda _signum, _frame: None)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_fd,), name="stop-signals", daemon=True).start()

    def wait(self) -> signal.Signals:
        """Blocks until a stop signal came; returns the first."""
        self.received.wait()
        assert self.signum is not None
        return signal.Signals(self.signum)

    def _watch(self, fd: int) -> None:
        while True:
            for number in os.read(fd, 64):
                if number in self._signals:
                    self.count += 1
                    self.signum = self.signum or number
                    if self._on_signal is not None:
                        self._on_signal(number, self.count)
                    self.received.set()


def busy_threads() -> dict[str, str]:
    """Name -> stack of every other non-daemon thread still alive: what interpreter exit waits for."""
    frames = sys._current_frames()
    me = threading.current_thread()
    return {
        t.name: "".join(traceback.format_stack(frames[t.ident])) if t.ident in frames else "(no frame)\n"
        for t in threading.enumerate()
        if t is not me and not t.daemon and t.is_alive()
    }


def arm_exit_watchdog(code: int, *, name: str, after_s: float) -> None:
    """If the process still runs `after_s` from now, log what holds it and end it with `code`."""

    def expire() -> None:
        time.sleep(after_s)
        for thread, stack in busy_threads().items():
            log.warning("%s did not exit within %.1fs: thread %r still runs:\n%s", name, after_s, thread, stack)
        exit_now(code)

    threading.Thread(target=expire, name="exit-watchdog", daemon=True).start()


def begin_stop(*, name: str, signum: int, shutdown_s: float, code: int) -> float:
    """A service starts its stop: logs it, arms the watchdog for the whole stop, and returns the monotonic time by
    which the steps of the stop must be done."""
    log.info("%s stopping (%s)", name, signal.Signals(signum).name)
    after_s = shutdown_s * WATCHDOG_SHARE
    arm_exit_watchdog(code, name=name, after_s=after_s)
    return time.monotonic() + after_s


def exit_now(code: int) -> None:
    """Ends the process with `code` once the logs are out, without interpreter finalization."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or its reader gone
            stream.flush()
    os._exit(code)
