"""Row-level table deltas: a changed table as its base block plus the rows that differ from it.

A session's tables start as shared seed blocks; a tool call changes a few rows. A delta
block names the base block (by digest) and holds the final row order as runs (`base`
rows start..start+n, or `rows` start..start+n) plus one ordinary table block (`codec`)
with the changed and added rows, so a session's bytes follow its changes. Removed rows are
simply not in any run.

    b"GTD1" + base digest (64 hex) + u32 big-endian header length + header JSON + rows block

Header: {"runs": [[0 | 1, start, count], ...], "rows": n, "index": {"kind": "range", "start",
"stop", "step"} | {"kind": "labels"}}. A delta is written only for a frame with the base's
columns and dtypes and unique index labels on both sides, and only after decoding it
back gives exactly the frame (`compare.frame_differences`); otherwise the caller stores
the whole table. So exactness (dtypes, index, None versus NaN) is the codec's, unchanged.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import numpy as np
import pandas as pd

from gymrpc.snapshots._values import TableCorrupt
from gymrpc.snapshots.codec import decode_table, encode_table
from gymrpc.snapshots.compare import frame_differences

DELTA_MAGIC = b"GTD1"
_DIGEST = 64
_BASE, _ROWS = 0, 1


def delta_base(data: bytes) -> str | None:
    """The base block's digest if `data` is a delta block, else None."""
    if data[: len(DELTA_MAGIC)] != DELTA_MAGIC:
        return None
    return data[len(DELTA_MAGIC) : len(DELTA_MAGIC) + _DIGEST].decode("ascii", "replace")


def _same(a: Any, b: Any) -> bool:
    """Equal in type and value (NaN equals NaN of the same type; None is not NaN)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def _unchanged(base: pd.DataFrame, positions: np.ndarray, frame: pd.DataFrame) -> np.ndarray:
    """Per row of `frame`: its base row (`positions`, -1 for none) holds the same values."""
    keep = positions >= 0
    rows = np.flatnonzero(keep)
    at = positions[keep]
    same = np.ones(len(rows), dtype=bool)
    for j in range(frame.shape[1]):
        a = base.iloc[:, j].to_numpy()[at]
        b = frame.iloc[:, j].to_numpy()[rows]
        if a.dtype.kind in "fc":
            same &= (a == b) | (np.isnan(a) & np.isnan(b))
        elif a.dtype.kind in "biuMm" and a.dtype == b.dtype:
            same &= a == b
        else:
            same &= np.fromiter((_same(x, y) for x, y in zip(a, b, strict=True)), dtype=bool, count=len(rows))
    out = np.zeros(len(frame), dtype=bool)
    out[rows] = same
    return out


def encode_delta(base: pd.DataFrame, base_digest: str, frame: pd.DataFrame) -> bytes | None:
    """A delta block turning `base` (the table of block `base_digest`) into `frame`, or None if none applies."""
    if not base.columns.equals(frame.columns) or list(base.dtypes) != list(frame.dtypes):
        return None
    if not (base.index.is_unique and frame.index.is_unique) or base.index.dtype != frame.index.dtype:
        return None
    positions = base.index.get_indexer(frame.index)
    from_base = _unchanged(base, positions, frame)
    runs: list[list[int]] = []
    new_rows: list[int] = []
    for i in range(len(frame)):
        if from_base[i]:
            p = int(positions[i])
            if runs and runs[-1][0] == _BASE and runs[-1][1] + runs[-1][2] == p:
                runs[-1][2] += 1
            else:
                runs.append([_BASE, p, 1])
        else:
            k = len(new_rows)
            new_rows.append(i)
            if runs and runs[-1][0] == _ROWS:
                runs[-1][2] += 1
            else:
                runs.append([_ROWS, k, 1])
    if len(new_rows) * 2 > len(frame):
        return None  # most rows changed: the whole table is as small and simpler
    index: dict[str, Any] = {"kind": "labels"}
    if isinstance(frame.index, pd.RangeIndex):
        index = {"kind": "range", "start": frame.index.start, "stop": frame.index.stop, "step": frame.index.step}
    header = json.dumps(
        {"runs": runs, "rows": len(frame), "index": index}, sort_keys=True, separators=(",", ":")
    ).encode()
    rows = encode_table(frame.iloc[new_rows])
    data = b"".join([DELTA_MAGIC, base_digest.encode("ascii"), struct.pack(">I", len(header)), header, rows])
    try:
        if frame_differences(decode_delta(data, base), frame):
            return None
    except (TableCorrupt, ValueError, TypeError):
        return None
    return data


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
    pieces = []
    for run in runs:
        if not (isinstance(run, list) and len(run) == 3 and all(isinstance(x, int) and x >= 0 for x in run)):
            raise TableCorrupt(f"table delta run {run!r}")
        kind, start, count = run
        source = base if kind == _BASE else rows if kind == _ROWS else None
        if source is None or start + count > len(source):
            raise TableCorrupt(f"table delta run {run!r} is outside its table")
        pieces.append(source.iloc[start : start + count])
    frame = pd.concat(pieces) if pieces else base.iloc[:0].copy()
    if len(frame) != total:
        raise TableCorrupt(f"table delta gives {len(frame)} rows, its header says {total}")
    for j, dtype in enumerate(base.dtypes):
        if frame.dtypes.iloc[j] != dtype:
            frame.isetitem(j, frame.iloc[:, j].astype(dtype))
    if index.get("kind") == "range":
        frame.index = pd.RangeIndex(index["start"], index["stop"], index["step"], name=base.index.name)
    return frame.copy()
