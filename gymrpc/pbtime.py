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


def seconds(value: duration_pb2.Duration | timestamp_pb2.Timestamp) -> float:
    return value.ToNanoseconds() / 1e9
