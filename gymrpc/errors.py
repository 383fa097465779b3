"""One exception tree for every gymrpc error, mapped to and from gRPC status at one boundary.

Servers raise `GymrpcError` subclasses; the server bootstrap turns them into a
`google.rpc.Status` with an `ErrorInfo` (domain `gymrpc.v1`, a reason from
`gymrpc.v1.ErrorReason`) and, where a retry later will succeed, a `RetryInfo`.
Clients turn any `grpc.RpcError` back into the same class with `from_rpc_error`,
so callers catch `gymrpc.errors.Aborted` rather than parse status strings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "gymrpc.v1"
MAX_MESSAGE_CHARS = 2000
"""A status message longer than this is cut: it travels in `grpc-message`, a header that gRPC limits."""
MAX_METADATA_ENTRIES = 16
MAX_METADATA_CHARS = 512
"""ErrorInfo metadata is bounded too: it travels in the `grpc-status-details-bin` trailer."""

_BY_CODE: dict[grpc.StatusCode, type[GymrpcError]] = {}


class GymrpcError(Exception):
    """Base of all gymrpc errors: a gRPC code, a reason, a message and metadata.

    Exceptions pickle (Ray and multiprocessing move them between processes).
    """

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.UNKNOWN
    default_reason: ClassVar[str] = "UNKNOWN"

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        metadata: Mapping[str, str] | None = None,
        retry_delay: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason
        self.metadata = dict(metadata or {})
        self.retry_delay = retry_delay

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _BY_CODE.setdefault(cls.code, cls)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.reason, self.metadata, self.retry_delay))

    def __str__(self) -> str:
        return f"{self.code.name} {self.reason}: {self.message}"

    def to_status(self) -> grpc.Status:
        """The rich status a server sends for this error, its message and metadata bounded."""
        metadata = {k[:64]: str(v)[:MAX_METADATA_CHARS] for k, v in list(self.metadata.items())[:MAX_METADATA_ENTRIES]}
        details = [_pack(error_details_pb2.ErrorInfo(reason=self.reason, domain=DOMAIN, metadata=metadata))]
        if self.retry_delay is not None:
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(int(self.retry_delay * 1e9))
            details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
        message = self.message if len(self.message) <= MAX_MESSAGE_CHARS else self.message[:MAX_MESSAGE_CHARS] + " ..."
        status = status_pb2.Status(code=self.code.value[0], message=message, details=details)
        return rpc_status.to_status(status)


def _rebuild(
    cls: type[GymrpcError], message: str, reason: str, metadata: dict[str, str], retry_delay: float | None
) -> GymrpcError:
    return cls(message, reason=reason, metadata=metadata, retry_delay=retry_delay)


def _pack(message: Any) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


class Cancelled(GymrpcError):
    code = grpc.StatusCode.CANCELLED
    default_reason = "CANCELLED"


class InvalidArgument(GymrpcError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    default_reason = "INVALID_REQUEST"


class DeadlineExceeded(GymrpcError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    default_reason = "DEADLINE_EXCEEDED"


class NotFound(GymrpcError):
    code = grpc.StatusCode.NOT_FOUND
    default_reason = "NOT_FOUND"


class AlreadyExists(GymrpcError):
    code = grpc.StatusCode.ALREADY_EXISTS
    default_reason = "ALREADY_EXISTS"


class PermissionDenied(GymrpcError):
    code = grpc.StatusCode.PERMISSION_DENIED
    default_reason = "PERMISSION_DENIED"


class ResourceExhausted(GymrpcError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    default_reason = "RESOURCE_EXHAUSTED"


class FailedPrecondition(GymrpcError):
    code = grpc.StatusCode.FAILED_PRECONDITION
    default_reason = "FAILED_PRECONDITION"


class Aborted(GymrpcError):
    code = grpc.StatusCode.ABORTED
    default_reason = "ABORTED"


class OutOfRange(GymrpcError):
    code = grpc.StatusCode.OUT_OF_RANGE
    default_reason = "OUT_OF_RANGE"


class Unimplemented(GymrpcError):
    code = grpc.StatusCode.UNIMPLEMENTED
    default_reason = "UNIMPLEMENTED"


class Internal(GymrpcError):
    code = grpc.StatusCode.INTERNAL
    default_reason = "INTERNAL"


class Unavailable(GymrpcError):
    code = grpc.StatusCode.UNAVAILABLE
    default_reason = "UNAVAILABLE"


class RegistryUnavailable(Unavailable):
    """The registry itself does not answer: the whole stack is likely gone, not one server restarting.

    Raised by `RegistryClient` for each failed registry call (retried like any UNAVAILABLE), and
    by `Client` once the registry has not answered for `RetryPolicy.registry_grace` seconds while
    a call needed it (or at the call's deadline). Metadata: `registry` (its target).
    """

    default_reason = "REGISTRY_UNAVAILABLE"


class DataLoss(GymrpcError):
    code = grpc.StatusCode.DATA_LOSS
    default_reason = "CORRUPT_SNAPSHOT"


class Unauthenticated(GymrpcError):
    code = grpc.StatusCode.UNAUTHENTICATED
    default_reason = "UNAUTHENTICATED"


class UnknownError(GymrpcError):
    code = grpc.StatusCode.UNKNOWN
    default_reason = "UNKNOWN"


def error_class(code: grpc.StatusCode) -> type[GymrpcError]:
    """The exception class for a status code."""
    return _BY_CODE.get(code, UnknownError)


def session_lost(err: GymrpcError, session_id: str) -> bool:
    """The resources role no longer has session `session_id` (its server restarted, or a failed run's
    cleanup closed it): nothing there holds the episode's state any more."""
    if err.metadata.get("session_id") != session_id:
        return False
    return isinstance(err, NotFound) or (isinstance(err, FailedPrecondition) and err.reason == "SESSION_CLOSED")


def from_rpc_error(exc: grpc.RpcError) -> GymrpcError:
    """Turn a failed call into a `GymrpcError`, reading `ErrorInfo` and `RetryInfo` details."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    message = (exc.details() if hasattr(exc, "details") else None) or str(code.name)
    reason, metadata, retry_delay = None, {}, None
    for detail in _details(exc):
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason, metadata = info.reason, dict(info.metadata)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            retry_delay = retry.retry_delay.ToNanoseconds() / 1e9
    return error_class(code)(message, reason=reason or code.name, metadata=metadata, retry_delay=retry_delay)


def _details(exc: grpc.RpcError) -> list[any_pb2.Any]:
    trailers = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == rpc_status.GRPC_DETAILS_METADATA_KEY:
            status = status_pb2.Status.FromString(value)
            return list(status.details)
    return []
