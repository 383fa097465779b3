"""Wraps a servicer's methods once: token check on control methods, errors mapped to rich status.

Wrapping the servicer (instead of a server interceptor) keeps the per-call path to
one extra coroutine frame. Data-plane credentials are checked before this, by the one
interceptor of `gymrpc.servers.credentials` (its cost, about nothing, is in bench/README.md).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.rpc import error_details_pb2, status_pb2

from gymrpc import auth, tracing
from gymrpc.errors import GymrpcError, Internal, InvalidArgument, ResourceExhausted, Unauthenticated
from gymrpc.servers.metrics import ServerMetrics

log = logging.getLogger(__name__)

DEFAULT_MAX_INFLIGHT_CALLS = 20_000
"""Calls one server runs at once; beyond it new ones get OVERLOADED (thousands of episodes per node fit)."""
OVERLOAD_RETRY_DELAY = 0.05
"""Seconds an overloaded server asks a caller to wait before retrying (the client adds jitter)."""


class Admission:
    """Counts a server's in-flight calls and turns away those beyond `limit`, before they do anything.

    Past the limit a call fails with RESOURCE_EXHAUSTED, reason OVERLOADED and a RetryInfo delay,
    which `gymrpc.Client` honours for idempotent methods: the caller backs off instead of the
    server queueing without bound.
    """

    def __init__(self, limit: int = DEFAULT_MAX_INFLIGHT_CALLS) -> None:
        if limit < 1:
            raise ValueError(f"max in-flight calls must be at least 1, got {limit}")
        self.limit = limit
        self.inflight = 0
        self.rejected = 0

    def refusal(self, method: str) -> ResourceExhausted:
        self.rejected += 1
        return ResourceExhausted(
            f"{method}: the server already runs {self.inflight} calls (its limit); retry after the delay",
            reason="OVERLOADED",
            metadata={"method": method, "limit": str(self.limit)},
            retry_delay=OVERLOAD_RETRY_DELAY,
        )


class _Guarded:
    """Plain attribute bag that the generated `add_*_to_server` reads methods from."""


class Undecodable:
    """What a request deserializer gives for bytes that are not the method's message (`SafeDecoding`).

    gRPC answers a deserializer that raises with a bare UNKNOWN; handing this to the method instead
    lets the guard refuse it as INVALID_ARGUMENT `MALFORMED_MESSAGE`, before anything runs.
    """

    __slots__ = ("problem",)

    def __init__(self, problem: str) -> None:
        self.problem = problem


def _decoding(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def decode(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as exc:  # DecodeError (malformed bytes, invalid UTF-8), RecursionError, ...
            return Undecodable(f"{type(exc).__name__}: {exc}"[:200])

    return decode


class SafeDecoding:
    """Stands in for the server while a generated `add_*_to_server` adds a service, so that every
    request deserializer of it turns bytes that do not decode into an `Undecodable`."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """Ignored: `add_registered_method_handlers` (called with the same handlers) adds both forms."""

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        safe = {
            name: h._replace(request_deserializer=_decoding(h.request_deserializer)) for name, h in handlers.items()
        }
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, safe),))
        self._server.add_registered_method_handlers(service, safe)


async def _refuse_undecodable(request: Undecodable, context: grpc.aio.ServicerContext, method: str) -> None:
    err = InvalidArgument(
        f"{method}: the request does not decode as its message ({request.problem}); nothing was done",
        reason="MALFORMED_MESSAGE",
        metadata={"method": method},
    )
    await context.abort_with_status(err.to_status())


def guard_servicer(
    servicer: object,
    service: ServiceDescriptor,
    *,
    token: str | None,
    control_methods: Iterable[str] = (),
    admission: Admission | None = None,
    metrics: ServerMetrics | None = None,
) -> object:
    """Return an object with the servicer's RPC methods wrapped; `control_methods` need `token`.

    Every method shares `admission` (one per server; default: its own with the default limit).
    With `metrics`, every call is counted and timed; without, the call path has no metrics code at all.
    Likewise, only with tracing on (`gymrpc.tracing.enabled`) does every call get a SERVER span.
    """
    admission = admission or Admission()
    control = set(control_methods)
    unknown = control - {m.name for m in service.methods}
    if unknown:
        raise ValueError(f"{service.full_name} has no methods {sorted(unknown)}")
    guarded = _Guarded()
    for method in service.methods:
        impl = getattr(servicer, method.name)
        needs_token = token if method.name in control else None
        full = f"/{service.full_name}/{method.name}"
        wrapper = _wrap_stream if method.server_streaming else _wrap_unary
        wrapped = wrapper(impl, full, needs_token, admission)
        if metrics is not None:
            wrapped = (_measure_stream if method.server_streaming else _measure_unary)(wrapped, full, metrics)
        if tracing.enabled() and service.full_name not in tracing.UNTRACED_SERVICES:
            wrapped = (_trace_stream if method.server_streaming else _trace_unary)(wrapped, full)
        setattr(guarded, method.name, wrapped)
    return guarded


async def _check_token(context: grpc.aio.ServicerContext, token: str, method: str) -> None:
    presented = None
    for key, value in context.invocation_metadata() or ():
        if key == auth.METADATA_KEY:
            presented = value if isinstance(value, str) else value.decode()
    if not auth.check(presented, token):
        why = "missing" if presented is None else "wrong"
        err = Unauthenticated(
            f"{method} is a control call and needs 'authorization: Bearer <token>' metadata; the token was {why}",
            metadata={"method": method},
        )
        await context.abort_with_status(err.to_status())


async def _abort_for(exc: BaseException, context: grpc.aio.ServicerContext, method: str) -> None:
    if isinstance(exc, GymrpcError):
        await context.abort_with_status(exc.to_status())
    error_id = uuid.uuid4().hex[:12]
    log.error("unhandled error in %s", method, exc_info=exc, extra={"error_id": error_id, "method": method})
    err = Internal(
        f"internal error in {method} ({type(exc).__name__}); see the server log for error_id={error_id}",
        reason="INTERNAL",
        metadata={"error_id": error_id},
    )
    await context.abort_with_status(err.to_status())


def _is_abort(exc: BaseException) -> bool:
    # abort_with_status raises grpc.aio.AbortError; it must pass through untouched.
    return isinstance(exc, grpc.aio.AbortError)


def _wrap_unary(impl: Callable[..., Any], method: str, token: str | None, admission: Admission) -> Callable[..., Any]:
    if not inspect.iscoroutinefunction(impl):
        raise TypeError(f"{method}: servicer methods must be async (got {impl!r})")

    @functools.wraps(impl)
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if type(request) is Undecodable:
            await _refuse_undecodable(request, context, method)
        if admission.inflight >= admission.limit:
            await context.abort_with_status(admission.refusal(method).to_status())
        admission.inflight += 1
        try:
            if token is not None:
                await _check_token(context, token, method)
            return await impl(request, context)
        except Exception as exc:
            if _is_abort(exc):
                raise
            await _abort_for(exc, context, method)
        finally:
            admission.inflight -= 1

    return call


def _wrap_stream(impl: Callable[..., Any], method: str, token: str | None, admission: Admission) -> Callable[..., Any]:
    if not inspect.isasyncgenfunction(impl):
        raise TypeError(f"{method}: streaming servicer methods must be async generators (got {impl!r})")

    @functools.wraps(impl)
    async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if type(request) is Undecodable:
            await _refuse_undecodable(request, context, method)
        if admission.inflight >= admission.limit:
            await context.abort_with_status(admission.refusal(method).to_status())
        admission.inflight += 1
        try:
            if token is not None:
                await _check_token(context, token, method)
            async for item in impl(request, context):
                yield item
        except Exception as exc:
            if _is_abort(exc):
                raise
            await _abort_for(exc, context, method)
        finally:
            admission.inflight -= 1

    return call


def _outcome(exc: BaseException | None, context: grpc.aio.ServicerContext) -> tuple[grpc.StatusCode, str]:
    """The status a call ended with, and its ErrorReason when it failed (read back from the aborted context)."""
    if exc is None:
        return grpc.StatusCode.OK, ""
    code = context.code() if isinstance(exc, grpc.aio.AbortError) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.CANCELLED if isinstance(exc, asyncio.CancelledError) else grpc.StatusCode.UNKNOWN
    return code, _reason_of(context)


def _reason_of(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            details = status_pb2.Status.FromString(value)
            for detail in details.details:
                if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    detail.Unpack(info)
                    return info.reason
    return ""


def _measure_unary(call: Callable[..., Any], method: str, metrics: ServerMetrics) -> Callable[..., Any]:
    @functools.wraps(call)
    async def measured(request: Any, context: grpc.aio.ServicerContext) -> Any:
        started, failure = metrics.started(method), None
        try:
            response = await call(request, context)
            metrics.reply(method, request, response)
            return response
        except BaseException as exc:
            failure = exc
            raise
        finally:
            metrics.finished(method, started, *_outcome(failure, context))

    return measured


def _measure_stream(call: Callable[..., Any], method: str, metrics: ServerMetrics) -> Callable[..., Any]:
    @functools.wraps(call)
    async def measured(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        started, failure = metrics.started(method), None
        try:
            async for item in call(request, context):
                metrics.reply(method, request, item)
                yield item
        except BaseException as exc:
            failure = exc
            raise
        finally:
            metrics.finished(method, started, *_outcome(failure, context))

    return measured


def _trace_unary(call: Callable[..., Any], method: str) -> Callable[..., Any]:
    @functools.wraps(call)
    async def traced(request: Any, context: grpc.aio.ServicerContext) -> Any:
        with tracing.server_span(method, context.invocation_metadata()) as span:
            failure = None
            try:
                return await call(request, context)
            except BaseException as exc:
                failure = exc
                raise
            finally:
                tracing.end_rpc(span, *_outcome(failure, context))

    return traced


def _trace_stream(call: Callable[..., Any], method: str) -> Callable[..., Any]:
    @functools.wraps(call)
    async def traced(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        with tracing.server_span(method, context.invocation_metadata()) as span:
            failure = None
            try:
                async for item in call(request, context):
                    yield item
            except BaseException as exc:
                failure = exc
                raise
            finally:
                tracing.end_rpc(span, *_outcome(failure, context))

    return traced
