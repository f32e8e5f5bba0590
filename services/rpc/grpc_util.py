"""gRPC plumbing shared by all services: servers with health + reflection, channels, error mapping, auth.

Servicers stay thin: each method calls a plain Python object and `map_errors` turns that object's
exceptions into proper status codes, so bad input never kills a server.
"""

from __future__ import annotations

import errno
import functools
import hmac
import inspect
import logging
import socket
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.contracts.config import TimeoutsConfig
from services.contracts.errors import DataLoss, FailedPrecondition, Unavailable

log = logging.getLogger(__name__)

_TIMEOUTS = TimeoutsConfig()  # defaults for callers without a config
_HEALTH_POLL_S = 0.2  # between health checks while waiting for a service

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
OPEN_METHODS_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class PortInUse(OSError):
    """The port a server was told to listen on is taken: servers never share a port (SO_REUSEPORT is off)."""


def _status_for(exc: BaseException) -> grpc.StatusCode:
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    if isinstance(exc, RedisConnectionError | RedisTimeoutError):  # Redis restarting: worth a retry
        return grpc.StatusCode.UNAVAILABLE

    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):  # a full disk: say so, do not retry
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, FileNotFoundError | KeyError):  # the buffer's EntryNotFoundError is a KeyError
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, PermissionError):
        return grpc.StatusCode.PERMISSION_DENIED
    if isinstance(exc, TimeoutError):  # the buffer's BufferFullError and weights' WeightSyncTimeout too
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED
    if isinstance(exc, Unavailable | ConnectionError):  # before FailedPrecondition: a lost weight-sync peer
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, DataLoss):  # before FailedPrecondition: weights that arrived different (a WeightSyncError)
        return grpc.StatusCode.DATA_LOSS
    if isinstance(exc, FailedPrecondition):  # a weight sync this machine cannot serve too (WeightSyncError)
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, ValueError | TypeError | OverflowError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


# Trailing metadata of a failed call: what to do about it, from the error's `hint` attribute (a reward function
# that hangs, a full disk), in UTF-8; the coordinator's failure record shows it (services/contracts/failure.py).
HINT_METADATA_KEY = "tandem-hint-bin"


def _abort_with(method: Callable[..., Any], exc: Exception, context: grpc.ServicerContext) -> None:
    code = _status_for(exc)
    # the full traceback goes to this service's log (RUN_DIR/logs/<service>.log); the caller gets one line
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method.__name__)
    else:
        log.warning("%s: %s: %s", method.__name__, code.name, exc, exc_info=exc)
    message = str(exc.args[0] if exc.args else "") if isinstance(exc, KeyError) else str(exc)
    hint = getattr(exc, "hint", "")
    if isinstance(hint, str) and hint:
        context.set_trailing_metadata(((HINT_METADATA_KEY, _details(hint).encode()),))
    context.abort(code, _details(f"{type(exc).__name__}: {message}"))


def _details(text: str, limit: int = 1500) -> str:
    """Status details travel percent-encoded in a trailer (up to 9 bytes per character) under gRPC's 8 KiB
    metadata limit: a message echoing a huge input must be cut, or the client gets RESOURCE_EXHAUSTED
    ("metadata size exceeds soft limit") instead of the error."""
    return text if len(text.encode()) <= limit else text.encode()[:limit].decode(errors="ignore") + " …"


ServicerMethod = TypeVar("ServicerMethod", bound=Callable[..., object])  # a servicer's RPC method


def map_errors(method: ServicerMethod) -> ServicerMethod:
    """Decorator for servicer methods (unary or server-streaming generators): exceptions become a status
    with the exception's message."""

    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream_wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
            try:
                yield from method(self, request, context)
            except grpc.RpcError:
                raise
            except Exception as exc:  # noqa: BLE001
                _abort_with(method, exc, context)

        return cast(ServicerMethod, stream_wrapper)

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except grpc.RpcError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure must become a status, never a dead server
            _abort_with(method, exc, context)

    return cast(ServicerMethod, wrapper)


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on every call except health and reflection."""

    def __init__(self, token: str):
        self._token = token.encode()

        def deny(request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token (services.auth_token)")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(OPEN_METHODS_PREFIXES):
            return continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization" and hmac.compare_digest(value.encode(), b"Bearer " + self._token):
                return continuation(handler_call_details)
        return self._deny


class _Undecodable:
    """What the lenient deserializer hands on when request bytes are not a valid message."""

    def __init__(self, error: Exception, size: int):
        self.error, self.size = error, size


def _lenient(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, RuntimeWarning-as-error, ...
            return _Undecodable(exc, len(data))

    return deserialize


class DecodeErrorInterceptor(grpc.ServerInterceptor):
    """Request bytes that do not parse get INVALID_ARGUMENT (gRPC's own answer is INTERNAL "Exception
    deserializing request!", which reads like a server bug and is what a fuzzer would hit first)."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        behaviour_name = "unary_stream" if handler.response_streaming else "unary_unary"
        behaviour = getattr(handler, behaviour_name)

        def checked(request: Any, context: grpc.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    _details(
                        f"{method}: request of {request.size} bytes is not a valid message "
                        f"({type(request.error).__name__}: {request.error})"
                    ),
                )
            return behaviour(request, context)

        return handler._replace(
            request_deserializer=_lenient(handler.request_deserializer), **{behaviour_name: checked}
        )


@dataclass(frozen=True)
class ServerOptions:
    bind_host: str = "127.0.0.1"
    port: int = 0
    max_message_mb: int = 64
    max_workers: int = 16
    auth_token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None


def message_options(max_message_mb: int) -> list[tuple[str, int]]:
    limit = max_message_mb << 20
    return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]


# gRPC turns SO_REUSEPORT on by default: a second run on the same fixed ports would then share them silently,
# each connection going to either process.
SERVER_OPTIONS = (("grpc.so_reuseport", 0),)


def _bind_port(server: grpc.Server, address: str, creds: grpc.ServerCredentials | None, *, host: str, port: int) -> int:
    try:
        bound = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    except RuntimeError:  # grpcio >= 1.54 raises "Failed to bind to address"; older ones return 0
        bound = 0
    if bound:
        return bound
    error = _bind_error(host, port)
    if port and error is not None and error.errno == errno.EADDRINUSE:
        raise PortInUse(f"port {port} on {host} is in use (another tandem run?)")
    raise OSError(f"could not bind gRPC server to {address}" + (f": {error.strerror}" if error else ""))


def ensure_port_free(host: str, port: int) -> None:
    """Raises PortInUse when host:port is taken: before starting a service there, so that a health check does
    not get its answer from whatever already listens on it."""
    error = _bind_error(host, port)
    if error is not None and error.errno == errno.EADDRINUSE:
        raise PortInUse(f"port {port} on {host} is in use (another tandem run?)")


def _bind_error(host: str, port: int) -> OSError | None:
    """Why a plain socket cannot bind host:port (the reason gRPC does not say)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        return exc
    return None


class RunningServer:
    def __init__(
        self, server: grpc.Server, port: int, health_servicer: health.HealthServicer, service_names: tuple[str, ...]
    ):
        self.server, self.port, self.health, self.service_names = server, port, health_servicer, service_names

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            self.health.set(name, status)

    def stop(self, grace_s: float) -> None:
        """Stops serving; calls in flight get `grace_s` to finish."""
        self.set_serving(False)
        self.server.stop(grace_s).wait()

    def wait(self) -> None:
        self.server.wait_for_termination()


def start_server(
    register: Iterable[tuple[Callable[[object, grpc.Server], None], object, str]], options: ServerOptions
) -> RunningServer:
    """`register` holds (add_XServicer_to_server, servicer, full service name) triples."""
    from services.telemetry.tracing import server_interceptors

    interceptors: list[grpc.ServerInterceptor] = [*server_interceptors(), DecodeErrorInterceptor()]
    if options.auth_token:
        interceptors.insert(0, BearerTokenInterceptor(options.auth_token))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=options.max_workers),
        interceptors=interceptors,
        options=[*message_options(options.max_message_mb), *SERVER_OPTIONS],
    )
    names = []
    for add, servicer, name in register:
        add(servicer, server)
        names.append(name)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*names, HEALTH_SERVICE, reflection.SERVICE_NAME), server)
    address = f"{options.bind_host}:{options.port}"
    creds = None
    if options.tls_cert and options.tls_key:
        with open(options.tls_key, "rb") as k, open(options.tls_cert, "rb") as c:
            creds = grpc.ssl_server_credentials([(k.read(), c.read())])
    port = _bind_port(server, address, creds, host=options.bind_host, port=options.port)
    server.start()
    running = RunningServer(server, port, health_servicer, tuple(names))
    running.set_serving(True)
    return running


# For pollers of a server that is starting: gRPC's default reconnect backoff (1 s, growing) would report it
# unavailable for seconds after it listens.
# Waiting for a service that is still loading its model: a backoff capped at 1 s would notice it up to a second late,
# on the start-up's critical path; 250 ms costs a few more refused connects on a local port.
FAST_RECONNECT = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 250),
)


def open_channel(
    target: str,
    *,
    max_message_mb: int = 64,
    tls_ca: str | None = None,
    auth_token: str | None = None,
    options: tuple[tuple[str, int], ...] = (),
) -> grpc.Channel:
    opts = [*message_options(max_message_mb), *options]
    if tls_ca:
        with open(tls_ca, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        if auth_token:
            creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(auth_token))
        return grpc.secure_channel(target, creds, options=opts)
    channel = grpc.insecure_channel(target, options=opts)
    if auth_token:
        channel = grpc.intercept_channel(channel, _HeaderInterceptor(("authorization", f"Bearer {auth_token}")))
    return channel


class _HeaderInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, header: tuple[str, str]):
        self._header = header

    def _with_header(self, details):
        metadata = [*(details.metadata or []), self._header]
        return details._replace(metadata=metadata) if hasattr(details, "_replace") else _Details(details, metadata)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._with_header(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._with_header(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._with_header(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._with_header(client_call_details), request_iterator)


class _Details(grpc.ClientCallDetails):
    def __init__(self, base: grpc.ClientCallDetails, metadata: list[tuple[str, str]]):
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


def wait_healthy(
    target: str,
    *,
    timeout_s: float,
    service: str = "",
    tls_ca: str | None = None,
    should_abort: Callable[[], str | None] | None = None,
    check_timeout_s: float = _TIMEOUTS.health_check_s,
) -> None:
    """Polls grpc.health.v1 until SERVING, each check within `check_timeout_s` (services.timeouts.health_check_s);
    `should_abort` may return a reason to give up early (e.g. the child process died)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with open_channel(target, tls_ca=tls_ca, options=FAST_RECONNECT) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if should_abort is not None and (reason := should_abort()):
                raise RuntimeError(f"{target}: {reason}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=check_timeout_s)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as exc:
                last = f"{exc.code().name}: {exc.details()}"
            time.sleep(_HEALTH_POLL_S)
    raise TimeoutError(f"service at {target} not healthy after {timeout_s:.0f}s (last: {last})")
