"""How long a process took to start: the age of this process, for the 'ready after N s' line every service logs."""

from __future__ import annotations

import os


def process_age_s() -> float:
    """Seconds since this process started (from /proc on Linux; 0.0 where that is not available)."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime_s - started_ticks / os.sysconf("SC_CLK_TCK"))
