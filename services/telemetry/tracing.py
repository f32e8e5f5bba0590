"""OpenTelemetry set-up, once per service process, and the `rl.*` spans (see docs/observability.md).

- `setup_tracing` installs the SDK provider (service.name `tandem-coordinator|trainer|rollout`), the gRPC
  client instrumentation (server interceptors come from `server_interceptors()` in grpc_util.start_server)
  and context propagation into thread pools. With exporter `none` it installs nothing at all and `span()`
  returns OTel's invalid span straight away, so tracing off costs next to nothing.
- Tandem attributes live under `rl.`: `span("rl.train", rollout_id=3)` records `rl.rollout_id`.
- Context crosses gRPC through the instrumentation, thread pools through the executor patch, and Redis
  through the entry's carrier (`inject_context` / `links_from`).
"""

from __future__ import annotations

import contextvars
import importlib
import json
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.util.types import AttributeValue

from services.contracts.files import write_all

if TYPE_CHECKING:
    import grpc
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
    from opentelemetry.sdk.trace.export import SpanExportResult

ATTRIBUTE_PREFIX = "rl."
_state: dict[str, Any] = {"configured": False, "exporter": "none"}
# Before a provider is installed this is OTel's proxy tracer, which follows the provider set later.
_tracer = trace.get_tracer("tandem")
Carrier = Mapping[str, str]
Attribute = AttributeValue | None  # a span attribute as callers pass it: None drops it


def attributes(**values: Attribute) -> dict[str, AttributeValue]:
    """`rollout_id=3` -> `{"rl.rollout_id": 3}`; dotted names (`net.peer.ip`) and None values as they are/dropped."""
    return {(k if "." in k else ATTRIBUTE_PREFIX + k): v for k, v in values.items() if v is not None}


class JsonLinesSpanExporter:
    """One JSON object per finished span, appended to a file that several processes share.

    The file is opened with O_APPEND and every export is one `os.write` of whole lines, so lines of
    different processes never interleave (appends of one write are atomic on a local file system)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        from opentelemetry.sdk.trace.export import SpanExportResult

        data = "".join(json.dumps(span_to_dict(s), default=str) + "\n" for s in spans).encode()
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            write_all(self._fd, data)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def span_to_dict(span: ReadableSpan) -> dict[str, object]:
    ctx = span.get_span_context()
    if ctx is None:  # the SDK exports ended spans, which always have one
        raise ValueError(f"span {span.name} has no span context")
    parent = span.parent
    resource = span.resource.attributes
    return {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent else None,
        "service": resource.get("service.name"),
        "instance": resource.get("service.instance.id"),
        "pid": os.getpid(),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "kind": span.kind.name,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "links": [
            {"trace_id": f"{lk.context.trace_id:032x}", "span_id": f"{lk.context.span_id:016x}"} for lk in span.links
        ],
    }


def setup_tracing(
    service_name: str, *, exporter: str = "none", file_path: str | None = None, instance: str | None = None
) -> None:
    """Installs the SDK provider, gRPC client instrumentation and thread-pool propagation. Call it before any
    gRPC server or channel is created: the instrumentation wraps channels made afterwards only."""
    if _state["configured"]:
        return
    if exporter == "none":
        _state.update(configured=True, exporter=exporter)
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider(
        resource=Resource.create(
            {"service.name": service_name, **({"service.instance.id": instance} if instance else {})}
        )
    )
    provider.add_span_processor(_span_processor(exporter, file_path=file_path))
    _state.update(configured=True, exporter=exporter)
    trace.set_tracer_provider(provider)
    from opentelemetry.instrumentation.grpc import GrpcInstrumentorClient, filters

    GrpcInstrumentorClient(filter_=filters.negate(filters.health_check())).instrument()
    _propagate_into_thread_pools()
    _install_log_correlation()


def _span_processor(exporter: str, *, file_path: str | None) -> SpanProcessor:
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
        SpanExporter,
    )

    # file / console export each span as it ends: nothing is lost when a hung run is killed.
    if exporter == "file":
        if not file_path:
            raise ValueError("tracing.exporter: file needs tracing.file_path (or a run dir)")
        # duck-typed (export/shutdown/force_flush), so the module needs the SDK only when a processor is built
        return SimpleSpanProcessor(cast(SpanExporter, JsonLinesSpanExporter(file_path)))
    if exporter == "console":
        return SimpleSpanProcessor(ConsoleSpanExporter())
    if exporter == "otlp":  # endpoint, headers, protocol, ... from the standard OTEL_EXPORTER_OTLP_* variables
        protocol = os.environ.get(
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        )
        module = "http" if protocol.startswith("http") else "grpc"
        try:
            exporter_module = importlib.import_module(f"opentelemetry.exporter.otlp.proto.{module}.trace_exporter")
        except ImportError as exc:
            raise ValueError(
                f"tracing.exporter: otlp over {protocol} needs the matching "
                f"opentelemetry-exporter-otlp-proto-* package: {exc}"
            ) from exc
        return BatchSpanProcessor(exporter_module.OTLPSpanExporter())
    raise ValueError(f"tracing.exporter: unknown exporter {exporter!r} (none, file, console, otlp)")


def server_interceptors() -> list[grpc.ServerInterceptor]:
    if not tracing_enabled():
        return []
    from opentelemetry.instrumentation.grpc import filters, server_interceptor

    return [server_interceptor(filter_=filters.negate(filters.health_check()))]


def shutdown_tracing() -> None:
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()


def tracing_enabled() -> bool:
    return _state["configured"] and _state["exporter"] != "none"


def _off() -> bool:
    """Set up with exporter none: skip the OTel API entirely (not set up at all: defer to the global API)."""
    return _state["configured"] and _state["exporter"] == "none"


def _propagate_into_thread_pools() -> None:
    """`ThreadPoolExecutor.submit` runs the task in a copy of the submitter's context, so spans started in
    pool threads (the coordinator's fan-out of Generate / weight-sync / eval calls) join the caller's trace.
    This is what opentelemetry-instrumentation-threading does; installed only when tracing is on."""
    from concurrent.futures import ThreadPoolExecutor

    original = ThreadPoolExecutor.submit
    if getattr(original, "_tandem_context", False):
        return

    def submit(self: ThreadPoolExecutor, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        return original(self, contextvars.copy_context().run, fn, *args, **kwargs)

    submit._tandem_context = True  # type: ignore[attr-defined]
    ThreadPoolExecutor.submit = submit  # type: ignore[method-assign, assignment]  # patched on purpose


def _links(carriers: Carrier | Iterable[Carrier] | None) -> list[trace.Link]:
    if not carriers:
        return []
    if isinstance(carriers, Mapping):
        carriers = [carriers]
    links, seen = [], set()
    for carrier in carriers:
        linked = trace.get_current_span(propagate.extract(carrier)).get_span_context() if carrier else None
        if linked is not None and linked.is_valid and linked.span_id not in seen:
            seen.add(linked.span_id)
            links.append(trace.Link(linked))
    return links


def _parent_context(parent: Carrier | None) -> otel_context.Context | None:
    """The carrier names the trace to continue. When the current span (a gRPC server span) already belongs to
    that trace it is the closer parent, so the carrier only wins when it starts or switches a trace."""
    if not parent:
        return None
    ctx = propagate.extract(parent)
    remote = trace.get_current_span(ctx).get_span_context()
    current = trace.get_current_span().get_span_context()
    if not remote.is_valid or (current.is_valid and current.trace_id == remote.trace_id):
        return None
    return ctx


@contextmanager
def span(
    name: str,
    *,
    parent: Carrier | None = None,
    links_from: Carrier | Iterable[Carrier] | None = None,
    **attrs: Attribute,
) -> Iterator[trace.Span]:
    """A span made current for the block. `parent`: a carrier to continue a trace (gRPC request field);
    `links_from`: carriers to link to (Redis entries); keyword attributes land under `rl.`."""
    if _off():
        yield trace.INVALID_SPAN
        return
    with _tracer.start_as_current_span(
        name, context=_parent_context(parent), links=_links(links_from), attributes=attributes(**attrs)
    ) as s:
        yield s


def start_root_span(name: str, **attrs: Attribute) -> trace.Span:
    """A span that starts its own trace whatever is current, and is not made current (see `use_span`)."""
    if _off():
        return trace.INVALID_SPAN
    return _tracer.start_span(name, context=otel_context.Context(), attributes=attributes(**attrs))


@contextmanager
def use_span(s: trace.Span, *, end: bool = False) -> Iterator[trace.Span]:
    """Makes `s` current for the block (records an exception on it); ends it afterwards when `end`."""
    if _off():
        yield s
        return
    with trace.use_span(s, end_on_exit=end) as current:
        yield current


def set_attributes(s: trace.Span, **attrs: Attribute) -> None:
    if s.is_recording():
        s.set_attributes(attributes(**attrs))


def annotate(**attrs: Attribute) -> None:
    """Adds `rl.*` attributes to the current span."""
    set_attributes(trace.get_current_span(), **attrs)


def inject_context() -> dict[str, str]:
    """The current context as a carrier (W3C traceparent), for a request field or a Redis entry."""
    carrier: dict[str, str] = {}
    if not _off():
        propagate.inject(carrier)
    return carrier


class StepSpans:
    """The coordinator's `rl.loop` spans, one root (own trace) per rollout id. A step's span opens when its
    generation starts — in async mode while the previous step is still training — and ends when that step's
    train / sync / save are done; `close_all` ends those of generations that were never trained."""

    def __init__(self, name: str = "rl.loop"):
        self.name = name
        self._open: dict[int, trace.Span] = {}
        self._last: tuple[int, trace.Span] | None = None  # the step ended last, for work that follows it
        self._lock = threading.Lock()

    def open(self, rollout_id: int, **attrs: Attribute) -> trace.Span:
        s = start_root_span(self.name, rollout_id=rollout_id, **attrs)
        with self._lock:
            self._open[rollout_id] = s
        return s

    @contextmanager
    def started(self, rollout_id: int, **attrs: Attribute) -> Iterator[trace.Span]:
        """Opens the step's span and makes it current for the block (which starts the generation)."""
        with use_span(self.open(rollout_id, **attrs)) as s:
            yield s

    @contextmanager
    def step(self, rollout_id: int, **attrs: Attribute) -> Iterator[trace.Span]:
        """The step's span, current for the block and ended after it."""
        with self._lock:
            s = self._open.pop(rollout_id, None)
        if s is None:
            s = start_root_span(self.name, rollout_id=rollout_id, **attrs)
        try:
            with use_span(s, end=True) as current:
                yield current
        finally:
            self._last = (rollout_id, s)

    @contextmanager
    def after(self, rollout_id: int) -> Iterator[None]:
        """Work that belongs to a step already ended (the final save of a stopped run) joins its trace: a child
        may end after its parent. Without such a step the block runs in the current context."""
        last = self._last
        if _off() or last is None or last[0] != rollout_id:
            yield
            return
        with trace.use_span(last[1], record_exception=False, set_status_on_exception=False):  # it has ended
            yield

    def close_all(self, **attrs: Attribute) -> None:
        with self._lock:
            spans, self._open = list(self._open.values()), {}
        for s in spans:
            set_attributes(s, **attrs)
            s.end()


def attach(carrier: Carrier | None) -> object | None:
    if not carrier:
        return None
    return otel_context.attach(propagate.extract(carrier))


def detach(token: object | None) -> None:
    if token is not None:
        otel_context.detach(token)  # type: ignore[arg-type]


class _TraceIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        ctx = trace.get_current_span().get_span_context()
        record.trace_id = f"{ctx.trace_id:032x}" if ctx.is_valid else "-"
        record.span_id = f"{ctx.span_id:016x}" if ctx.is_valid else "-"
        return True


def _install_log_correlation() -> None:
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _TraceIdFilter) for f in handler.filters):
            handler.addFilter(_TraceIdFilter())


# `log.error(..., exc_info=exc, extra=TRACEBACK_TO_FILE)`: the traceback goes to the log file only, the terminal gets
# the line (a service run alone, whose expected failure ends in a block of its own instead).
TRACEBACK_TO_FILE = {"traceback_to_file": True}


class _TerminalFormatter(logging.Formatter):
    """Leaves out the traceback of records marked TRACEBACK_TO_FILE (the file handler still writes it)."""

    def format(self, record: logging.LogRecord) -> str:
        if not getattr(record, "traceback_to_file", False):
            return super().format(record)
        saved = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None
        try:
            return super().format(record) + " (traceback in the log file)"
        finally:
            record.exc_info, record.exc_text = saved


def setup_logging(service_name: str, level: str = "INFO", log_file: str | None = None) -> None:
    """Log lines carry the service name and the current trace/span ids (`-` outside a span)."""
    fmt = f"%(asctime)s %(levelname)s {service_name} [trace=%(trace_id)s span=%(span_id)s] %(name)s: %(message)s"
    # Under `tandem run` the supervisor already captures stdout/stderr into logs/<service>.log.
    own_file = bool(log_file) and not os.environ.get("TANDEM_SERVICE")
    terminal = logging.StreamHandler()
    terminal.setFormatter(_TerminalFormatter(fmt) if own_file else logging.Formatter(fmt))
    handlers: list[logging.Handler] = [terminal]
    if log_file and own_file:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
        handlers[-1].setFormatter(logging.Formatter(fmt))
    for h in handlers:
        h.addFilter(_TraceIdFilter())
    logging.basicConfig(level=getattr(logging, level), handlers=handlers, force=True)
