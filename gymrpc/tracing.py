"""OpenTelemetry traces of gymrpc (docs/tracing.md): off unless the environment says where spans go.

One process has one tracer provider (several in-process servers share it). Until one is
installed, `enabled()` is False and every helper here returns at its first line, so the call
path of a server without tracing has no tracing code at all (the guard does not wrap it) and a
client call checks one global. Context crosses processes as W3C `traceparent` gRPC metadata.

Exporters, chosen at server start by `setup_from_env`:
- `OTEL_TRACES_EXPORTER=otlp` (OTLP over gRPC, `OTEL_EXPORTER_OTLP_ENDPOINT` and the other
  standard variables), `console`, or several comma-separated; unset or `none`: nothing.
- `GYMRPC_TRACES_FILE=path`: every span appended as one JSON line as soon as it ends, by every
  process of a stack into one file (O_APPEND, one write a span), so a SIGKILL loses no ended span.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)
TRACES_FILE_ENV = "GYMRPC_TRACES_FILE"
TRACEPARENT = "traceparent"
RESUMED_FROM = "gymrpc.resumed_from"
"""Attribute of the link from a resumed run's episode span to the span of the run it continues."""
UNTRACED_SERVICES = frozenset({"gymrpc.v1.RegistryService"})
"""Services whose calls get no span: name resolution and lease renewals would bury the episodes' traces."""
_PROPAGATOR = TraceContextTextMapPropagator()
_provider: TracerProvider | None = None
_tracer: trace.Tracer | None = None


class JsonLinesExporter(SpanExporter):
    """Appends each span as one JSON line (`ReadableSpan.to_json`) to a file shared by processes."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(span.to_json(indent=None) + "\n" for span in spans)
        os.write(self._fd, lines.encode())  # one write: lines of two processes never interleave
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


def setup_from_env(service_name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Install a provider when the environment asks for an exporter (first call wins); True if tracing is on.

    `service_name` (the server's stable name) is `service.name` unless `OTEL_SERVICE_NAME` says otherwise.
    """
    if _provider is not None:
        return True
    env = os.environ if environ is None else environ
    names = [n.strip() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip() not in ("", "none")]
    path = env.get(TRACES_FILE_ENV)
    if not names and not path:
        return False
    resource = Resource.create({SERVICE_NAME: env.get("OTEL_SERVICE_NAME") or service_name})
    provider = TracerProvider(resource=resource)
    for name in names:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif name == "console":
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r} (gymrpc knows otlp, console, none)")
    if path:
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(path)))
    use(provider)
    log.info("tracing on", extra={"exporters": ",".join(names) or "none", "traces_file": path or "none"})
    return True


def use(provider: TracerProvider | None) -> None:
    """Make `provider` this process's (tests pass one with an in-memory exporter); None turns tracing off.

    Servers started afterwards trace their calls; those already serving keep what they had.
    """
    global _provider, _tracer
    _provider = provider
    _tracer = None if provider is None else provider.get_tracer("gymrpc")


def enabled() -> bool:
    return _tracer is not None


def shutdown() -> None:
    """Flush and close the exporters (a server's graceful stop): batched spans are not lost."""
    if _provider is not None:
        _provider.shutdown()
        use(None)


def outgoing(metadata: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """`metadata` plus the current span's `traceparent`, if tracing is on and a span is current."""
    if _tracer is None:
        return metadata
    parent = traceparent()
    return (*metadata, (TRACEPARENT, parent)) if parent else metadata


def traceparent() -> str:
    """The current span as a W3C `traceparent` value; empty without a recording span."""
    if _tracer is None:
        return ""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get(TRACEPARENT, "")


def _parent(metadata: Any) -> Any:
    for key, value in metadata or ():
        if key == TRACEPARENT:
            return _PROPAGATOR.extract({TRACEPARENT: value if isinstance(value, str) else value.decode()})
    return None


@contextlib.contextmanager
def server_span(method: str, metadata: Any) -> Iterator[trace.Span]:
    """The SERVER span of one RPC (`/pkg.Service/Method`), child of the caller's `traceparent` if sent."""
    assert _tracer is not None
    service, _, name = method.strip("/").rpartition("/")
    attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}
    with _tracer.start_as_current_span(
        method.strip("/"),
        context=_parent(metadata),
        kind=SpanKind.SERVER,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        yield span


def end_rpc(span: trace.Span, code: Any, reason: str) -> None:
    """Record how the RPC ended: `rpc.grpc.status_code`, and an error status with the gymrpc reason."""
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code.value[0] != 0:
        if reason:
            span.set_attribute("gymrpc.error_reason", reason)
        span.set_status(Status(StatusCode.ERROR, reason or code.name))


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[trace.Span | None]:
    """A child of the current span (an episode's model call, a checkpoint phase); nothing when off."""
    if _tracer is None:
        yield None
        return
    with _tracer.start_as_current_span(name, attributes=attributes) as current:
        yield current


def link_previous(previous: str, **attributes: Any) -> None:
    """Link the current span to `previous` (a stored `traceparent`): a resumed run to the one it continues."""
    if _tracer is None or not previous:
        return
    context = trace.get_current_span(_PROPAGATOR.extract({TRACEPARENT: previous})).get_span_context()
    if context.is_valid:
        trace.get_current_span().add_link(context, {RESUMED_FROM: previous, **attributes})


__all__ = [
    "RESUMED_FROM",
    "TRACES_FILE_ENV",
    "JsonLinesExporter",
    "enabled",
    "end_rpc",
    "link_previous",
    "outgoing",
    "server_span",
    "setup_from_env",
    "shutdown",
    "span",
    "traceparent",
    "use",
]
