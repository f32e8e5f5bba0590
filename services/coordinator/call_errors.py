"""The one error type of a failed service call, which of its status codes a restart would only repeat, and the
failure record (services/contracts/failure.py) that any error ending the coordinator's run becomes."""

from __future__ import annotations

import re

import grpc

from services.contracts.config import ConfigError
from services.contracts.exits import ExitCode
from services.contracts.failure import FailureRecord
from services.rpc.grpc_util import HINT_METADATA_KEY

# Statuses of errors that a restart would only repeat (a reward function that raises, a full disk, bad data): the
# coordinator then exits with ExitCode.PERMANENT and `tandem run` does not restart it.
PERMANENT_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED})


class ServiceCallError(RuntimeError):
    """A call to a service failed; the message names the service, the call and the status. `service` is the
    process (its log is RUN_DIR/logs/<service>.log), `details` what it answered, `hint` what to do (if it said)."""

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode | None = None,
        service: str = "",
        call: str = "",
        details: str = "",
        hint: str = "",
    ):
        super().__init__(message)
        self.code = code
        self.service, self.call, self.details, self.hint = service, call, details or message, hint

    @classmethod
    def from_rpc(cls, service: str, call: str, exc: grpc.RpcError, *, process: str = "") -> ServiceCallError:
        return cls(
            describe_rpc_error(service, call, exc),
            code=exc.code(),
            service=process or service,
            call=call,
            details=str(exc.details() or ""),
            hint=_hint_of(exc),
        )

    @property
    def permanent(self) -> bool:
        return self.code in PERMANENT_CODES


class TrainerStateLost(ServiceCallError):
    """The trainer's optimizer step does not follow on from the last one we saw: it restarted (or someone else
    trained it) and no longer holds the state this coordinator's run state describes."""


def describe_rpc_error(service: str, call: str, exc: grpc.RpcError) -> str:
    details = str(exc.details() or "")
    hint = (
        " (the limit is services.max_message_mb on both sides)"
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "message larger than max" in details
        else ""
    )
    return f"{service} {call} failed: {exc.code().name}: {details}{hint}"


def _hint_of(exc: grpc.RpcError) -> str:
    trailing = getattr(exc, "trailing_metadata", None)
    for key, value in (trailing() if callable(trailing) else None) or ():
        if key == HINT_METADATA_KEY:
            return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    return ""


_ERROR_TYPE = re.compile(r"^[A-Za-z_]\w*: ")  # the exception's name grpc_util.map_errors puts before its message


def failure_record(exc: BaseException, *, kept: str, starting: bool = False) -> FailureRecord:
    """What ended the run, for the block every command ends with: a service's answer (its status, its hint), bad
    input the coordinator found itself (exit 3: a restart reads the same data), or anything else (exit 1)."""
    if isinstance(exc, ServiceCallError):
        return FailureRecord(
            service=exc.service or "coordinator",
            kind=exc.code.name if exc.code else "UNKNOWN",
            what=_ERROR_TYPE.sub("", exc.details, count=1),
            call=exc.call,
            kept=kept,
            hint=exc.hint,
            exit_code=ExitCode.PERMANENT if exc.permanent else ExitCode.FAILED,
        )
    if isinstance(exc, ConfigError) or (starting and isinstance(exc, ValueError | FileNotFoundError)):
        return FailureRecord(
            service="coordinator", kind="BAD_INPUT", what=str(exc), kept=kept, exit_code=ExitCode.PERMANENT
        )
    return FailureRecord(
        service="coordinator",
        kind="UNEXPECTED",
        what=f"{type(exc).__name__}: {exc}",
        kept=kept,
        exit_code=ExitCode.FAILED,
    )
