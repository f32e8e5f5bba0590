"""Picking a free TCP port for a server that binds it later (tandem run's services, the embedded redis-server,
a trainer's rendezvous store)."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on host that is free now, for a server that binds it seconds later (after loading a model).
    Picked at random below the kernel's ephemeral range when there is room: the kernel hands ports of that
    range to outgoing connections and to every bind(0), so one taken from there may be in use again by then."""
    low = _ephemeral_range_start()
    if low >= 8192:
        for port in random.SystemRandom().sample(range(low // 2, low), 64):
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ephemeral_range_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: bind(0) it is
        return 0


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
