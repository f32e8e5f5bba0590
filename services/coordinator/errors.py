"""The one error type of a failed service call, and which of its status codes a restart would only repeat."""

from __future__ import annotations

import grpc

# Statuses of errors that a restart would only repeat (a reward function that raises, a full disk, bad data): the
# coordinator then exits with ExitCode.PERMANENT and `tandem run` does not restart it.
PERMANENT_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED})


class ServiceCallError(RuntimeError):
    """A call to a service failed; the message names the service, the call and the status."""

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code

    @classmethod
    def from_rpc(cls, service: str, call: str, exc: grpc.RpcError) -> ServiceCallError:
        return cls(describe_rpc_error(service, call, exc), code=exc.code())

    @property
    def permanent(self) -> bool:
        return self.code in PERMANENT_CODES


class TrainerStateLost(ServiceCallError):
    """The trainer's optimizer step does not follow on from the last one we saw: it restarted (or someone else
    trained it) and no longer holds the state this coordinator's run state describes."""


def describe_rpc_error(service: str, call: str, exc: grpc.RpcError) -> str:
    hint = " (the limit is services.max_message_mb on both sides)" \
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else ""
    return f"{service} {call} failed: {exc.code().name}: {exc.details()}{hint}"
