"""The error an engine raises when it cannot serve now; engines and their pause gate both raise it."""

from __future__ import annotations


class EngineUnavailable(RuntimeError):
    """The engine cannot serve right now (paused too long, memory released, weights missing). The service
    reports it as FAILED_PRECONDITION; engines import only torch, so they also run where gRPC is absent."""
