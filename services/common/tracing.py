"""OpenTelemetry set-up, once per service process.

Span names follow the `rl.*` convention of the design brief. With exporter `none` no SDK provider is
installed, so `span()` returns OTel's no-op spans and costs next to nothing. Context crosses gRPC through
the OTel gRPC instrumentation and Redis through `inject_context` / `extract_context` on the entry.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

_state: dict[str, Any] = {"configured": False, "exporter": "none"}
_tracer_name = "tandem"


class JsonLinesSpanExporter:
    """Appends one JSON object per finished span to a file (several processes may share it)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = [json.dumps(span_to_dict(s)) for s in spans]
        with self._lock, open(self.path, "a") as f:
            f.write("".join(line + "\n" for line in lines))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def span_to_dict(span: Any) -> dict[str, Any]:
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name, "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent else None,
        "service": span.resource.attributes.get("service.name"),
        "start_ns": span.start_time, "end_ns": span.end_time, "kind": span.kind.name,
        "status": span.status.status_code.name, "attributes": dict(span.attributes or {}),
        "links": [{"trace_id": f"{lk.context.trace_id:032x}", "span_id": f"{lk.context.span_id:016x}"}
                  for lk in span.links],
    }


def setup_tracing(service_name: str, *, exporter: str = "none", file_path: str | None = None) -> None:
    """Installs the SDK provider and gRPC instrumentation; call before creating servers/channels."""
    if _state["configured"]:
        return
    _state.update(configured=True, exporter=exporter)
    if exporter == "none":
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter == "file":
        if not file_path:
            raise ValueError("tracing.exporter: file needs tracing.file_path (or a run dir)")
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(file_path)))
    elif exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    elif exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # reads OTEL_EXPORTER_OTLP_*
    else:
        raise ValueError(f"tracing.exporter: unknown exporter {exporter!r}")
    trace.set_tracer_provider(provider)
    from opentelemetry.instrumentation.grpc import GrpcInstrumentorClient

    GrpcInstrumentorClient().instrument()
    _install_log_correlation()


def server_interceptors() -> list[Any]:
    if _state["exporter"] == "none":
        return []
    from opentelemetry.instrumentation.grpc import server_interceptor

    return [server_interceptor()]


def shutdown_tracing() -> None:
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()


def tracing_enabled() -> bool:
    return _state["exporter"] != "none"


@contextmanager
def span(name: str, *, links_from: dict[str, str] | None = None, parent: dict[str, str] | None = None,
         **attributes: Any) -> Iterator[Any]:
    """A span; `parent` is a carrier to continue a trace, `links_from` a carrier to link to (Redis)."""
    tracer = trace.get_tracer(_tracer_name)
    links = []
    if links_from:
        linked = trace.get_current_span(propagate.extract(links_from)).get_span_context()
        if linked.is_valid:
            links.append(trace.Link(linked))
    ctx = propagate.extract(parent) if parent else None
    attrs = {k: v for k, v in attributes.items() if v is not None}
    with tracer.start_as_current_span(name, context=ctx, links=links, attributes=attrs) as s:
        yield s


def inject_context() -> dict[str, str]:
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def attach(carrier: dict[str, str] | None) -> object | None:
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
        handler.addFilter(_TraceIdFilter())


def setup_logging(service_name: str, level: str = "INFO", log_file: str | None = None) -> None:
    """Log lines carry the service name and the current trace/span ids."""
    fmt = f"%(asctime)s %(levelname)s {service_name} [trace=%(trace_id)s span=%(span_id)s] %(name)s: %(message)s"
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    # Under `tandem run` the supervisor already captures stdout/stderr into logs/<service>.log.
    if log_file and not os.environ.get("TANDEM_SERVICE"):
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    for h in handlers:
        h.setFormatter(logging.Formatter(fmt))
        h.addFilter(_TraceIdFilter())
    logging.basicConfig(level=getattr(logging, level), handlers=handlers, force=True)
