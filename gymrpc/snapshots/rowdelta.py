"""Row-level table deltas: a changed table as its base block plus the rows that differ from it.

A session's tables start as shared seed blocks; a tool call changes a few rows. A delta
block names the base block (by digest) and holds the final row order as runs (`base`
rows start..start+n, or `rows` start..start+n) plus one ordinary table block (`codec`)
with the changed and added rows, so a session's bytes follow its changes. Removed rows are
simply not in any run.

    b"GTD1" + base digest (64 hex) + u32 big-endian header length + header JSON + rows block

Header: {"runs": [[0 | 1, start, count], ...], "rows": n, "index": {"kind": "range", "start",
"stop", "step"} | {"kind": "labels"}}. A delta is written only for a frame with the base's
columns and dtypes and unique index labels on both sides; otherwise the caller stores the
whole table. A row counts as unchanged only if every cell has the same bits (fixed-width
dtypes) or the same type and `compare.value_token` (objects: None is not NaN, -0.0 is not
0.0, 1 is not True); every other row is stored by the codec itself, so exactness (dtypes,
index, None versus NaN) is the codec's, unchanged.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pandas as pd
from pandas.api.types import infer_dtype

from gymrpc.snapshots._values import TableCorrupt
from gymrpc.snapshots.codec import column_arrays, decode_table, encode_table
from gymrpc.snapshots.compare import value_token

DELTA_MAGIC = b"GTD1"
_DIGEST = 64
_BASE, _ROWS = 0, 1


def delta_base(data: bytes) -> str | None:
    """The base block's digest if `data` is a delta block, else None."""
    if data[: len(DELTA_MAGIC)] != DELTA_MAGIC:
        return None
    return data[len(DELTA_MAGIC) : len(DELTA_MAGIC) + _DIGEST].decode("ascii", "replace")


_SIMPLE_TYPES = np.array([str, int, bool, type(None)], dtype=object)
"""Types whose `==` is exact once the types agree (floats are not: -0.0 == 0.0, NaN != NaN)."""
_TYPE = np.frompyfunc(type, 1, 1)
_FLOAT: Any = float


def _same_objects(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per cell: same type and value, by `compare.value_token` wherever `==` could mislead."""
    if infer_dtype(a, skipna=False) == "string" == infer_dtype(b, skipna=False):  # only str: `==` is exact
        return np.asarray(a == b, dtype=bool)
    types_a, types_b = _TYPE(a), _TYPE(b)
    same_type = np.asarray(types_a == types_b, dtype=bool)
    try:
        equal = np.asarray(a == b, dtype=bool)
        if equal.shape != a.shape:
            raise ValueError("not elementwise")
    except (TypeError, ValueError):
        equal = np.array([_equal(x, y) for x, y in zip(a, b, strict=True)], dtype=bool)
    same = equal & same_type
    floats = np.flatnonzero(same_type & np.asarray(types_a == _FLOAT, dtype=bool))
    if len(floats):  # Python floats (NaN gaps): same bits, as value_token compares them
        bits_a = a[floats].astype(np.float64).view(np.int64)
        same[floats] = bits_a == b[floats].astype(np.float64).view(np.int64)
    simple = np.asarray(np.isin(types_a, _SIMPLE_TYPES), dtype=bool)
    tricky = np.flatnonzero(same_type & ~simple & np.asarray(types_a != _FLOAT, dtype=bool))
    for i in tricky:
        same[i] = value_token(a[i]) == value_token(b[i])
    return same


def _equal(x: Any, y: Any) -> bool:
    try:
        return bool(x == y)
    except (TypeError, ValueError):
        return False


def _unchanged(base: pd.DataFrame, positions: np.ndarray, frame: pd.DataFrame) -> np.ndarray:
    """Per row of `frame`: its base row (`positions`, -1 for none) holds exactly the same values."""
    keep = positions >= 0
    rows = np.flatnonzero(keep)
    at = positions[keep]
    same = np.ones(len(rows), dtype=bool)
    for column_a, column_b in zip(column_arrays(base), column_arrays(frame), strict=True):
        a, b = np.asarray(column_a)[at], np.asarray(column_b)[rows]
        if a.dtype == b.dtype and a.dtype.kind in "biufcmM":  # fixed width: compare the bits
            width = a.dtype.itemsize
            bits_a = np.ascontiguousarray(a).view(np.uint8).reshape(len(a), width)
            bits_b = np.ascontiguousarray(b).view(np.uint8).reshape(len(b), width)
            same &= (bits_a == bits_b).all(axis=1)
        else:
            same &= _same_objects(np.asarray(a, dtype=object), np.asarray(b, dtype=object))
    out = np.zeros(len(frame), dtype=bool)
    out[rows] = same
    return out


def changed_rows(base: pd.DataFrame, frame: pd.DataFrame) -> list[int]:
    """Positions of `frame`'s rows that are not in `base` unchanged (by index label); both need unique labels."""
    positions = base.index.get_indexer(frame.index)
    return np.flatnonzero(~_unchanged(base, positions, frame)).tolist()


def _runs(from_base: np.ndarray, positions: np.ndarray) -> list[list[int]]:
    """The row order as runs, computed on arrays (no per-row Python): a run breaks where the
    source changes or, within base rows, where the base positions stop being consecutive."""
    n = len(from_base)
    if n == 0:
        return []
    breaks = np.ones(n, dtype=bool)
    breaks[1:] = (from_base[1:] != from_base[:-1]) | (from_base[1:] & (positions[1:] != positions[:-1] + 1))
    starts = np.flatnonzero(breaks)
    counts = np.diff(np.append(starts, n))
    row_at = np.cumsum(~from_base) - 1  # position of each changed row among the new rows
    base_run = from_base[starts]
    first = np.where(base_run, positions[starts], row_at[starts])
    kinds = np.where(base_run, _BASE, _ROWS)
    return np.stack([kinds, first, counts], axis=1).astype(np.int64).tolist()


def encode_delta(base: pd.DataFrame, base_digest: str, frame: pd.DataFrame) -> bytes | None:
    """A delta block turning `base` (the table of block `base_digest`) into `frame`, or None if none applies."""
    if not base.columns.equals(frame.columns) or list(base.dtypes) != list(frame.dtypes):
        return None
    if not (base.index.is_unique and frame.index.is_unique) or base.index.dtype != frame.index.dtype:
        return None
    positions = base.index.get_indexer(frame.index)
    from_base = _unchanged(base, positions, frame)
    new_rows = np.flatnonzero(~from_base)
    if len(new_rows) * 2 > len(frame):
        return None  # most rows changed: the whole table is as small and simpler
    runs = _runs(from_base, positions)
    index: dict[str, Any] = {"kind": "labels"}
    if isinstance(frame.index, pd.RangeIndex):
        index = {"kind": "range", "start": frame.index.start, "stop": frame.index.stop, "step": frame.index.step}
    header = json.dumps(
        {"runs": runs, "rows": len(frame), "index": index}, sort_keys=True, separators=(",", ":")
    ).encode()
    rows = encode_table(frame.iloc[new_rows])
    return b"".join([DELTA_MAGIC, base_digest.encode("ascii"), struct.pack(">I", len(header)), header, rows])


def decode_delta(data: bytes, base: pd.DataFrame) -> pd.DataFrame:
    """The table a delta block describes, given its base table; `TableCorrupt` if the block is malformed."""
    at = len(DELTA_MAGIC) + _DIGEST
    if data[: len(DELTA_MAGIC)] != DELTA_MAGIC or len(data) < at + 4:
        raise TableCorrupt("not a gymrpc table delta block")
    (size,) = struct.unpack(">I", data[at : at + 4])
    try:
        header = json.loads(data[at + 4 : at + 4 + size])
        runs, total, index = header["runs"], header["rows"], header["index"]
    except (ValueError, KeyError, TypeError) as exc:
        raise TableCorrupt(f"table delta header: {exc}") from None
    rows = decode_table(data[at + 4 + size :])
    take = []
    for run in runs:
        if not (isinstance(run, list) and len(run) == 3 and all(isinstance(x, int) and x >= 0 for x in run)):
            raise TableCorrupt(f"table delta run {run!r}")
        kind, start, count = run
        source = len(base) if kind == _BASE else len(rows) if kind == _ROWS else -1
        if start + count > source:
            raise TableCorrupt(f"table delta run {run!r} is outside its table")
        take.append(np.arange(start, start + count) + (len(base) if kind == _ROWS else 0))
    if sum(len(t) for t in take) != total:
        raise TableCorrupt(f"table delta gives {sum(len(t) for t in take)} rows, its header says {total}")
    if not rows.columns.equals(base.columns) or list(rows.dtypes) != list(base.dtypes):
        raise TableCorrupt("table delta rows do not have the base table's columns and dtypes")
    both = pd.concat([base, rows]) if len(rows) else base
    frame = both.iloc[np.concatenate(take) if take else np.arange(0)]
    for j, dtype in enumerate(base.dtypes):
        if frame.dtypes.iloc[j] != dtype:
            frame.isetitem(j, frame.iloc[:, j].astype(dtype))
    if index.get("kind") == "range":
        frame.index = pd.RangeIndex(index["start"], index["stop"], index["step"], name=base.index.name)
    return frame.copy()
