"""The replies and requests every service shares (tandem.v1 common.proto), as frozen dataclasses."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Empty:
    """A call without arguments."""


@dataclass(frozen=True)
class Ack:
    """A control call done: `message` says what happened."""

    ok: bool = True
    message: str = ""
