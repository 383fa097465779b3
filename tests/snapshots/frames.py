"""Random DataFrames for property tests of the table codec (seeded, so every failure reproduces).

`random_frame(rng)` draws the things the codec must keep: every supported dtype, object
columns mixing str, None, NaN, ints, floats (-0.0, inf), bools, numpy scalars and JSON
values, empty tables, column labels (str, int, repeated; object, str, int64 or range
columns index) and indexes (ranges with any start and step, repeated, named, object,
str, float, datetime labels).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pandas as pd

_TEXT = ["", "a", "Ünïcödé ✓", "line\nbreak", "\\n literal", "nan", "None", "x" * 40, "\x00nul"]


def _object_value(rng: random.Random) -> Any:
    kind = rng.randrange(12)
    if kind < 5:
        return rng.choice(_TEXT) + str(rng.randrange(100))
    return [
        None,
        float("nan"),
        rng.randrange(-(2**70), 2**70),
        rng.choice([0.5, -0.0, float("inf"), -1e300, 1e-310]),
        rng.random() < 0.5,
        np.int64(rng.randrange(-5, 5)),
        rng.choice([{"k": [1, "v", None]}, [True, 2.5], np.float32(1.25), np.bool_(True)]),
    ][kind - 5]


def random_column(rng: random.Random, rows: int) -> Any:
    kind = rng.randrange(11)
    if kind == 0:
        return pd.Series([_object_value(rng) for _ in range(rows)], dtype=object)
    if kind == 1:  # the workplace case: strings with NaN (CSV gaps) and None (added rows)
        pool = ["x", "Y", float("nan"), None]
        return pd.Series([rng.choice(pool) for _ in range(rows)], dtype=object)
    if kind == 2:
        return pd.Series(np.array([rng.random() < 0.5 for _ in range(rows)], dtype=bool))
    if kind == 3:
        dtype = rng.choice(["int8", "int64", "uint16", "uint64"])
        info = np.iinfo(dtype)
        return pd.Series(np.array([rng.randint(int(info.min), int(info.max)) for _ in range(rows)], dtype=dtype))
    if kind == 4:  # an int column that met a NaN: float64
        values = [float(rng.randrange(100)) if rng.random() < 0.7 else float("nan") for _ in range(rows)]
        return pd.Series(np.array(values, dtype=rng.choice(["float64", "float32", "float16"])))
    if kind == 5:
        unit = rng.choice(["s", "ms", "us", "ns"])
        values = [
            np.datetime64(rng.randrange(0, 2**31), "s") if rng.random() < 0.8 else np.datetime64("NaT")
            for _ in range(rows)
        ]
        return pd.Series(np.array(values, dtype=f"datetime64[{unit}]"))
    if kind == 6:
        values = [np.timedelta64(rng.randrange(-1000, 1000), "s") for _ in range(rows)]
        return pd.Series(np.array(values, dtype="timedelta64[ms]"))
    if kind == 7:
        storage, na = rng.choice([("pyarrow", np.nan), ("python", np.nan), ("python", pd.NA), ("pyarrow", pd.NA)])
        values = [rng.choice(_TEXT) if rng.random() < 0.8 else None for _ in range(rows)]
        return pd.Series(pd.array(values, dtype=pd.StringDtype(storage, na_value=na)))
    if kind == 8:
        dtype = rng.choice(["Int64", "UInt8", "Float64", "boolean"])
        values = [rng.randrange(0, 2) if rng.random() < 0.7 else None for _ in range(rows)]
        return pd.Series(pd.array(values, dtype=dtype))
    if kind == 9:
        return pd.Series([rng.choice(_TEXT) for _ in range(rows)], dtype=object)
    return pd.Series(np.array([rng.uniform(-1e9, 1e9) for _ in range(rows)]))


def random_index(rng: random.Random, rows: int) -> pd.Index:
    kind = rng.randrange(7)
    name = rng.choice([None, "idx", 3])
    if kind == 0:
        step = rng.choice([1, 2, -3])
        start = rng.randrange(-10, 10)
        return pd.RangeIndex(start, start + step * rows, step, name=name)
    if kind == 1:  # repeated labels, as calendar events get from `pd.concat` without ignore_index
        return pd.Index([rng.randrange(max(rows // 2, 1)) for _ in range(rows)], dtype="int64", name=name)
    if kind == 2:
        return pd.Index([rng.choice(["a", "b", None, float("nan"), 7]) for _ in range(rows)], dtype=object, name=name)
    if kind == 3:
        return pd.Index([f"r{rng.randrange(5)}" for _ in range(rows)], dtype="str", name=name)
    if kind == 4:
        return pd.Index([rng.random() for _ in range(rows)], dtype="float64", name=name)
    if kind == 5:
        return pd.DatetimeIndex([np.datetime64(rng.randrange(0, 10**9), "s") for _ in range(rows)], name=name)
    return pd.RangeIndex(rows, name=name)


def random_columns(rng: random.Random, width: int) -> pd.Index:
    kind = rng.randrange(4)
    if kind == 0:
        return pd.RangeIndex(width)
    if kind == 1:
        return pd.Index([rng.randrange(1000) for _ in range(width)], dtype="int64")
    labels = [rng.choice(["a", "b", "inbox/outbox", "é", ""]) + str(rng.randrange(3)) for _ in range(width)]
    return pd.Index(labels, dtype=object if kind == 2 else "str", name=rng.choice([None, "cols"]))


def random_frame(rng: random.Random) -> pd.DataFrame:
    rows = rng.choice([0, 1, 2, 5, 17, 64])
    width = rng.choice([0, 1, 3, 6])
    frame = pd.DataFrame({i: random_column(rng, rows) for i in range(width)})
    if width == 0:
        frame = pd.DataFrame(index=pd.RangeIndex(rows))
    frame.index = random_index(rng, rows)
    frame.columns = random_columns(rng, width)
    return frame
