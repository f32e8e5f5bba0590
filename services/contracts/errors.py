"""The domain's errors that a call's caller must tell apart: raised by the services and the weights package, mapped
to gRPC status codes only at the edge (services/rpc/grpc_util.py, `map_errors`)."""

from __future__ import annotations


class FailedPrecondition(RuntimeError):
    """The call is valid but the service is not in a state to honour it (maps to FAILED_PRECONDITION)."""


class DataLoss(RuntimeError):
    """What arrived differs from what was sent, e.g. weights whose checksums differ (maps to DATA_LOSS)."""


class Unavailable(RuntimeError):
    """A dependency (Redis, a peer) is not reachable right now (maps to UNAVAILABLE)."""
