"""Stopping a service process the hard way: its SIGTERM taken by a thread other than the main one, with every
core busy (services/rpc/shutdown.py says why the first happens on a loaded machine)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

_libc = ctypes.CDLL(None, use_errno=True)


def sigterm_to_another_thread(pid: int) -> int:
    """What the kernel does with a process-directed SIGTERM when a thread other than the main one takes it (one
    that is starting a thread, say), made certain: tgkill to the first of the others. Returns that thread's id."""
    others = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    assert others, f"process {pid} has no thread besides its main one"
    if _libc.tgkill(pid, others[0], signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill({pid}, {others[0]}, SIGTERM)")
    return others[0]


@contextmanager
def cpu_hogs(count: int = os.cpu_count() or 2) -> Iterator[None]:
    """A busy loop per core beside whatever runs in the block."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def stop_under_load(proc: subprocess.Popen, *, budget_s: float) -> float:
    """SIGTERM on another thread, every core busy: the seconds until the process exited. Fails (and kills it) when
    it outlives `budget_s`, its services.timeouts.shutdown_s. One that already exited: 0."""
    if proc.poll() is not None:
        return 0.0
    with cpu_hogs():
        start = time.monotonic()
        sigterm_to_another_thread(proc.pid)
        try:
            proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(
                f"process {proc.pid} still ran {budget_s:g}s after its SIGTERM (services.timeouts.shutdown_s)"
            ) from None
        return time.monotonic() - start
