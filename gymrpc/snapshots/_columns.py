"""One column (or index) of a table to and from Arrow arrays, keeping its pandas dtype exactly.

Every supported dtype has a spec string stored in the table's metadata; decoding checks
that the Arrow arrays have exactly the type that spec implies, so a payload that decodes
is one this module wrote. Supported: object (values tagged, see `_values`), numpy bool,
ints, uints and floats (NaN kept as a value, never as null), naive datetime64 and
timedelta64 of any unit (NaT as null), pandas string dtypes (`str` and `string`, either
storage and either missing value), and the nullable Int/UInt/Float/boolean dtypes.
Categoricals, tz-aware datetimes, periods, intervals and the like raise `TableUnsupported`.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from gymrpc.snapshots._values import TableCorrupt, TableUnsupported, tag_values, untag_values

_NUMPY = frozenset(
    ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64"]
)
_TIME = re.compile(r"(datetime64|timedelta64)\[(s|ms|us|ns)\]")
_STRING = re.compile(r"string\[(python|pyarrow),(nan|NA)\]")
_MASKED = {
    "Int8": "int8",
    "Int16": "int16",
    "Int32": "int32",
    "Int64": "int64",
    "UInt8": "uint8",
    "UInt16": "uint16",
    "UInt32": "uint32",
    "UInt64": "uint64",
    "Float32": "float32",
    "Float64": "float64",
    "boolean": "bool",
}
_NUMPY_SPECS: dict[np.dtype, str] = {}
Column = Any
"""A numpy ndarray or a pandas ExtensionArray: what a Series or an Index holds."""


def dtype_spec(dtype: Any, where: str) -> str:
    """The spec string of a supported dtype; `TableUnsupported` for anything else."""
    if isinstance(dtype, np.dtype):
        if dtype.kind == "O":
            return "object"
        known = _NUMPY_SPECS.get(dtype)  # numpy's `dtype.name` is Python code, a few µs per column
        if known is not None:
            return known
        if dtype.name in _NUMPY or _TIME.fullmatch(dtype.name):
            _NUMPY_SPECS[dtype] = dtype.name  # bounded: only supported dtypes are kept
            return dtype.name
    elif isinstance(dtype, pd.StringDtype):
        return f"string[{dtype.storage},{'NA' if dtype.na_value is pd.NA else 'nan'}]"
    elif isinstance(dtype, pd.api.extensions.ExtensionDtype) and dtype.name in _MASKED:
        return dtype.name
    raise TableUnsupported(f"{where}: dtype {dtype!r} is not supported by the table codec")


def pandas_dtype(spec: str) -> Any:
    """Inverse of `dtype_spec` (the spec was validated by `arrow_type`)."""
    if spec == "object" or spec in _NUMPY or _TIME.fullmatch(spec):
        return np.dtype(spec)
    match = _STRING.fullmatch(spec)
    if match:
        return pd.StringDtype(match.group(1), na_value=pd.NA if match.group(2) == "NA" else np.nan)
    return pd.api.types.pandas_dtype(spec)


def arrow_type(spec: Any, where: str) -> pa.DataType:
    """The Arrow type the value array of a column with this spec must have; `TableCorrupt` if unknown."""
    if not isinstance(spec, str):
        raise TableCorrupt(f"{where}: dtype spec must be a string")
    known = _ARROW_TYPES.get(spec)
    if known is None:
        known = _ARROW_TYPES[spec] = _arrow_type(spec, where)  # bounded: only valid specs are kept
    return known


_ARROW_TYPES: dict[str, pa.DataType] = {}


def _arrow_type(spec: str, where: str) -> pa.DataType:
    if spec == "object" or _STRING.fullmatch(spec):
        return pa.string()
    if spec in _NUMPY:
        return pa.from_numpy_dtype(np.dtype(spec))
    if spec in _MASKED:
        return pa.from_numpy_dtype(np.dtype(_MASKED[spec]))
    match = _TIME.fullmatch(spec)
    if match:
        unit = match.group(2)
        return pa.timestamp(unit) if match.group(1) == "datetime64" else pa.duration(unit)
    raise TableCorrupt(f"{where}: unknown dtype spec {spec!r}")


def encode_column(values: Column, spec: str, where: str) -> tuple[pa.Array, pa.Array | None]:
    """The value array and, for object columns holding non-strings, the int8 tag array.

    No per-row Python: object columns are tagged vectorized (`tag_values`), and string and
    nullable columns pass their missing values to Arrow as a mask.
    """
    if spec == "object":
        slots, tags = tag_values(np.asarray(values, dtype=object), where)
        data = pa.array(slots, type=pa.string())
        return data, None if tags is None else pa.array(tags, type=pa.int8())
    if spec.startswith("string["):
        objects = np.asarray(values, dtype=object)
        return pa.array(objects, type=pa.string(), mask=np.asarray(values.isna(), dtype=bool)), None
    if spec in _MASKED:
        numpy_dtype = np.dtype(_MASKED[spec])
        data = values.to_numpy(dtype=numpy_dtype, na_value=numpy_dtype.type(0))
        return pa.array(data, mask=np.asarray(values.isna(), dtype=bool), type=arrow_type(spec, where)), None
    return pa.array(np.asarray(values), type=arrow_type(spec, where)), None


def decode_column(spec: str, data: pa.Array, tags: pa.Array | None, where: str) -> Column:
    """Inverse of `encode_column`; the caller has checked the arrays' types against `arrow_type`."""
    if spec == "object":
        tag_array = None
        if tags is not None:
            if tags.null_count:
                raise TableCorrupt(f"{where}: null value tags")
            tag_array = tags.to_numpy()
        nulls = np.asarray(data.is_null().to_numpy(zero_copy_only=False), dtype=bool)
        return untag_values(data.to_numpy(zero_copy_only=False), nulls, tag_array, where)
    if tags is not None:
        raise TableCorrupt(f"{where}: value tags on a {spec} column")
    if _STRING.fullmatch(spec):
        return pd.array(data.to_numpy(zero_copy_only=False), dtype=pandas_dtype(spec))
    if spec in _MASKED:
        mask = np.asarray(data.is_null().to_numpy(zero_copy_only=False), dtype=bool)
        zero = pa.scalar(False if pa.types.is_boolean(data.type) else 0, type=data.type)
        filled = data.fill_null(zero).to_numpy(zero_copy_only=False)
        dtype = pandas_dtype(spec)
        return dtype.construct_array_type()(filled.copy(), mask)
    if _TIME.fullmatch(spec):
        return data.to_numpy(zero_copy_only=False).astype(np.dtype(spec), copy=False)
    if data.null_count:
        raise TableCorrupt(f"{where}: nulls in a {spec} column")
    return data.to_numpy(zero_copy_only=False).copy()
