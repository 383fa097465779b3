"""Conversions between float seconds and protobuf Timestamp / Duration."""

from __future__ import annotations

from google.protobuf import duration_pb2, timestamp_pb2


def timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def set_duration(target: duration_pb2.Duration, seconds: float) -> None:
    """`target.CopyFrom(duration(seconds))` for seconds >= 0 without building a message (hot paths)."""
    target.seconds, target.nanos = divmod(int(seconds * 1e9), 1_000_000_000)


def seconds(value: duration_pb2.Duration | timestamp_pb2.Timestamp) -> float:
    return value.ToNanoseconds() / 1e9


MAX_TIMESTAMP_SECONDS = 253_402_300_799
"""9999-12-31T23:59:59Z, the last second a Timestamp may hold (and the first is year 1)."""
MIN_TIMESTAMP_SECONDS = -62_135_596_800
MAX_DURATION_SECONDS = 315_576_000_000


def request_seconds(value: duration_pb2.Duration | timestamp_pb2.Timestamp, field: str) -> float:
    """`seconds` of a value from a request, checked first: INVALID_ARGUMENT naming `field` when it is not
    a valid Timestamp / Duration (nanos out of range, signs that disagree, past year 9999)."""
    from gymrpc.errors import InvalidArgument

    if isinstance(value, timestamp_pb2.Timestamp):
        ok = MIN_TIMESTAMP_SECONDS <= value.seconds <= MAX_TIMESTAMP_SECONDS and 0 <= value.nanos < 1_000_000_000
    else:
        ok = (
            abs(value.seconds) <= MAX_DURATION_SECONDS
            and abs(value.nanos) < 1_000_000_000
            and (value.seconds == 0 or value.nanos == 0 or (value.seconds > 0) == (value.nanos > 0))
        )
    if not ok:
        raise InvalidArgument(
            f"{field} ({value.seconds} s, {value.nanos} ns) is not a valid {type(value).__name__}",
            metadata={"field": field},
        )
    return seconds(value)
