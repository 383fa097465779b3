"""Which weights produced which completion tokens: (version, first token, last token) spans.

Built as tokens arrive, one delta at a time, so a generation that straddles a weight update
reports exactly where the new weights took over.
"""

from __future__ import annotations

from collections.abc import Iterable

from gymrpc.v1 import common_pb2

Span = tuple[str, int, int]
"""(weight version, index of the first completion token, index of the last, inclusive)."""


def extend(spans: list[Span], version: str, count: int) -> None:
    """Add `count` tokens produced by `version` after the tokens the spans already cover."""
    if count <= 0:
        return
    start = spans[-1][2] + 1 if spans else 0
    if spans and spans[-1][0] == version:
        spans[-1] = (version, spans[-1][1], start + count - 1)
    else:
        spans.append((version, start, start + count - 1))


def to_pb(spans: Iterable[Span]) -> list[common_pb2.WeightVersionSpan]:
    return [common_pb2.WeightVersionSpan(weight_version=v, first_token=a, last_token=b) for v, a, b in spans]


def of_pb(spans: Iterable[common_pb2.WeightVersionSpan]) -> list[Span]:
    return [(s.weight_version, s.first_token, s.last_token) for s in spans]
