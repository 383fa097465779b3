"""Strict equality of DataFrames, independent of the codec, for tests and equivalence checks.

`DataFrame.equals` treats None and NaN as equal and ignores the index type, so it cannot
prove that a snapshot round trip was exact. Here two frames are equal only when their
column labels, index (type, dtype, name, labels), dtypes and every value agree, values
compared by type and bits (None is not NaN, 1 is not 1.0 or True, -0.0 is not 0.0).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import numpy as np
import pandas as pd


def value_token(value: Any) -> tuple[Any, ...]:
    """A hashable, exact description of one Python value (type plus bits)."""
    kind = type(value)
    if kind is float:
        return ("float", struct.pack("<d", value).hex())
    if kind in (str, int, bool):
        return (kind.__name__, value)
    if value is None:
        return ("None",)
    if value is pd.NA:
        return ("NA",)
    if isinstance(value, np.generic):
        return ("np", value.dtype.str, value.tobytes().hex())
    if kind in (list, tuple):
        return (kind.__name__, *(value_token(v) for v in value))
    if kind is dict:
        return ("dict", *((value_token(k), value_token(v)) for k, v in value.items()))
    return (f"{kind.__module__}.{kind.__qualname__}", repr(value))


def _array_tokens(values: Any) -> tuple[Any, ...]:
    if isinstance(values, np.ndarray) and values.dtype.kind in "biufcmM":
        return ("bits", values.dtype.str, np.ascontiguousarray(values).tobytes().hex())
    return tuple(value_token(v) for v in np.asarray(values, dtype=object))


def _index_tokens(index: pd.Index) -> tuple[Any, ...]:
    if type(index) is pd.RangeIndex:
        return ("range", index.start, index.stop, index.step, value_token(index.name))
    return (type(index).__name__, str(index.dtype), value_token(index.name), _array_tokens(index.to_numpy()))


def frame_differences(left: pd.DataFrame, right: pd.DataFrame, limit: int = 5) -> list[str]:
    """Human-readable differences, at most `limit`; empty when the frames are strictly equal."""
    out: list[str] = []
    if left.shape != right.shape:
        return [f"shape {left.shape} vs {right.shape}"]
    if _index_tokens(left.columns) != _index_tokens(right.columns):
        return [f"columns differ: {left.columns!r} vs {right.columns!r}"]
    if _index_tokens(left.index) != _index_tokens(right.index):
        out.append(f"index differs: {left.index!r} vs {right.index!r}"[:300])
    for position, label in enumerate(left.columns):
        a, b = left.iloc[:, position], right.iloc[:, position]
        if a.dtype != b.dtype or str(a.dtype) != str(b.dtype):
            out.append(f"column {label!r}: dtype {a.dtype} vs {b.dtype}")
        elif _array_tokens(a.to_numpy()) != _array_tokens(b.to_numpy()):
            left_values, right_values = a.to_numpy(dtype=object), b.to_numpy(dtype=object)
            rows = [i for i in range(len(a)) if value_token(left_values[i]) != value_token(right_values[i])]
            first = rows[0] if rows else 0
            out.append(
                f"column {label!r}: {len(rows)} values differ, first at row {first}: "
                f"{left_values[first]!r} vs {right_values[first]!r}"
            )
        if len(out) >= limit:
            break
    return out[:limit]


def frame_fingerprint(frame: pd.DataFrame) -> str:
    """sha256 over the same exact description `frame_differences` compares."""
    digest = hashlib.sha256()
    digest.update(repr(_index_tokens(frame.columns)).encode())
    digest.update(repr(_index_tokens(frame.index)).encode())
    for position in range(frame.shape[1]):
        column = frame.iloc[:, position]
        digest.update(str(column.dtype).encode())
        digest.update(repr(_array_tokens(column.to_numpy())).encode())
    return digest.hexdigest()
