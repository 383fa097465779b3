"""The table codec: one pandas DataFrame to one (compressed) Arrow IPC stream and back, exactly.

Format `gymrpc.table.arrow` version 1. A block is `b"GTB1"`, one codec byte (0 none,
1 zstd), the stream's length as a big-endian u64, then the stream, zstd-compressed as a
whole (one call per table is several times faster than Arrow's per-buffer compression,
for the same size). The stream holds one record batch whose fields are
positional (`c0`, `c1`, ... for columns, `index` for index labels, `<field>.tag` for the
value tags of object columns), so any column labels, duplicates included, survive. The
schema metadata key `gymrpc.table` holds canonical JSON describing what Arrow cannot:

    {"format": "gymrpc.table.arrow", "version": 1, "rows": n,
     "columns": {"kind": "labels", "dtype": <spec>, "labels": [...], "name": ...} | {"kind": "range", ...},
     "fields": [<dtype spec of each column>],
     "index": {"kind": "range", "start", "stop", "step", "name"} | {"kind": "labels", "dtype": <spec>, "name"}}

Round trip guarantees: dtypes (see `_columns`), column order and labels, the index (a
RangeIndex stays one; other labels, repeated or not, keep their values, dtype and name),
empty tables, and every object value including None versus NaN. Encoding is
deterministic (same frame, same bytes), which is what lets `blocks` store a table that
several sessions share once.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from gymrpc.snapshots._columns import arrow_type, decode_column, dtype_spec, encode_column, pandas_dtype
from gymrpc.snapshots._values import TableCodecError, TableCorrupt, TableUnsupported

TABLE_FORMAT = "gymrpc.table.arrow"
TABLE_FORMAT_VERSION = 1
METADATA_KEY = b"gymrpc.table"
_TOP_KEYS = frozenset({"format", "version", "rows", "columns", "fields", "index"})
_MAGIC = b"GTB1"
_HEADER = len(_MAGIC) + 1 + 8
_RAW, _ZSTD = 0, 1
_ZSTD_CODEC = pa.Codec("zstd") if pa.Codec.is_available("zstd") else None
"""One codec for every call: creating it costs about as much as compressing a small table (it is stateless)."""
_META_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
"""Canonical metadata JSON, as `json.dumps` with these options writes it, without a new encoder per table."""
_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"
"""The IPC end-of-stream marker: a continuation token and a zero message length."""
_MAX_STREAM = 1 << 32
"""4 GiB: a stated length beyond this is corruption, not a table (and must not be allocated).
Every restore path checks a block's sha256 before decoding it, so this guards direct callers only."""

__all__ = [
    "TABLE_FORMAT",
    "TABLE_FORMAT_VERSION",
    "TableCodecError",
    "TableCorrupt",
    "TableUnsupported",
    "decode_table",
    "encode_table",
]


def encode_table(frame: pd.DataFrame) -> bytes:
    """Encode a DataFrame; `TableUnsupported` names the first column, label or value it cannot keep."""
    if not isinstance(frame, pd.DataFrame):
        raise TableUnsupported(f"expected a pandas DataFrame, got {type(frame).__name__}")
    if frame.attrs:
        raise TableUnsupported("DataFrame.attrs is not snapshotted; clear it first")
    if not frame.flags.allows_duplicate_labels:
        raise TableUnsupported("frames with allows_duplicate_labels=False are not supported")
    arrays: list[pa.Array] = []
    names: list[str] = []
    specs: list[str] = []
    labels = frame.columns.tolist()
    for position, values in enumerate(column_arrays(frame)):
        where = f"column {labels[position]!r}"
        spec = dtype_spec(values.dtype, where)
        _append(arrays, names, f"c{position}", *encode_column(values, spec, where))
        specs.append(spec)
    index_doc = _encode_index(frame.index, arrays, names)
    meta = {
        "format": TABLE_FORMAT,
        "version": TABLE_FORMAT_VERSION,
        "rows": len(frame),
        "columns": _axis_labels(frame.columns, labels, "the columns"),
        "fields": specs,
        "index": index_doc,
    }
    text = _META_JSON.encode(meta)
    schema = pa.schema([(n, a.type) for n, a in zip(names, arrays, strict=True)], metadata={METADATA_KEY: text})
    # An IPC stream is its schema message, its record batches and an end marker: built from the
    # messages directly (byte for byte what `pa.ipc.new_stream` writes, without its per-call setup).
    parts = [schema.serialize()]
    if arrays:  # a table without columns or index labels is all metadata (rows come from the range)
        parts.append(pa.RecordBatch.from_arrays(arrays, schema=schema).serialize())
    parts.append(_END_OF_STREAM)
    stream = b"".join(parts)
    if _ZSTD_CODEC is None:
        body, codec = stream, _RAW
    else:
        body, codec = _ZSTD_CODEC.compress(stream, asbytes=True), _ZSTD
    return b"".join((_MAGIC, bytes((codec,)), len(stream).to_bytes(8, "big"), body))


def column_arrays(frame: pd.DataFrame) -> list[Any]:
    """Each column's array (ndarray or ExtensionArray), by position.

    `frame.items()` builds a Series per column, about a fifth of encoding a small table, so
    this reads the block manager directly, falling back to `items()` if pandas ever drops
    `iget_values` (a test checks that both encode alike).
    """
    get = getattr(getattr(frame, "_mgr", None), "iget_values", None)
    if get is None:
        arrays = (column.array for _, column in frame.items())
        return [a.to_numpy() if type(a) is pd.arrays.NumpyExtensionArray else a for a in arrays]  # not StringArray
    return [get(position) for position in range(frame.shape[1])]


def _stream(data: bytes) -> pa.Buffer:
    """The IPC stream inside a block; `TableCorrupt` for a bad header or body."""
    if len(data) < _HEADER or data[: len(_MAGIC)] != _MAGIC:
        raise TableCorrupt("not a gymrpc table block (bad magic)")
    codec, size = data[len(_MAGIC)], int.from_bytes(data[len(_MAGIC) + 1 : _HEADER], "big")
    body = data[_HEADER:]
    if codec == _RAW and size == len(body):
        return pa.py_buffer(body)
    if codec == _ZSTD and size <= _MAX_STREAM and _ZSTD_CODEC is not None:
        try:
            return _ZSTD_CODEC.decompress(body, decompressed_size=size)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise TableCorrupt(f"table block does not decompress: {exc}") from None
    raise TableCorrupt(f"table block header is invalid (codec {codec}, length {size})")


def _append(arrays: list[pa.Array], names: list[str], name: str, data: pa.Array, tags: pa.Array | None) -> None:
    arrays.append(data)
    names.append(name)
    if tags is not None:
        arrays.append(tags)
        names.append(f"{name}.tag")


def _encode_index(index: pd.Index, arrays: list[pa.Array], names: list[str]) -> dict[str, Any]:
    if isinstance(index, pd.MultiIndex):
        raise TableUnsupported("MultiIndex is not supported")
    name = _label(index.name, "the index name")
    if type(index) is pd.RangeIndex:
        return {"kind": "range", "start": index.start, "stop": index.stop, "step": index.step, "name": name}
    spec = dtype_spec(index.dtype, "the index")
    _append(arrays, names, "index", *encode_column(index.array, spec, "the index"))
    return {"kind": "labels", "dtype": spec, "name": name}


def _axis_labels(columns: pd.Index, values: list[Any], where: str) -> dict[str, Any]:
    """Column labels live in the metadata: str or int labels, in an object, str, int64 or range index."""
    if isinstance(columns, pd.MultiIndex):
        raise TableUnsupported(f"{where}: a MultiIndex is not supported")
    name = _label(columns.name, f"{where} name")
    if type(columns) is pd.RangeIndex:
        return {"kind": "range", "start": columns.start, "stop": columns.stop, "step": columns.step, "name": name}
    spec = dtype_spec(columns.dtype, where)
    if spec not in ("object", "int64") and not spec.startswith("string["):
        raise TableUnsupported(f"{where}: labels of dtype {spec} are not supported")
    labels = [_label(label, f"{where} label") for label in values]
    label_type = int if spec == "int64" else str
    if not all(type(label) is label_type for label in labels):
        raise TableUnsupported(f"{where}: labels must all be str (or all int in an int64 index)")
    return {"kind": "labels", "dtype": spec, "labels": labels, "name": name}


def _label(value: Any, where: str) -> str | int | None:
    if value is None or type(value) in (str, int):
        return value
    if isinstance(value, np.integer):
        return int(value)
    raise TableUnsupported(f"{where} {value!r}: only None, str and int labels are supported")


def decode_table(data: bytes) -> pd.DataFrame:
    """Decode bytes written by `encode_table`; `TableCorrupt` for anything else (nothing is returned)."""
    stream = _stream(data)
    try:
        reader = pa.ipc.open_stream(stream)
        batches = list(reader)
        schema = reader.schema
    except (pa.ArrowException, OSError, ValueError, TypeError) as exc:
        raise TableCorrupt(f"not an Arrow IPC stream: {exc}") from None
    meta = _metadata(schema)
    rows = meta["rows"]
    if len(batches) > 1 or (batches and batches[0].num_rows != rows) or (not batches and schema.names):
        raise TableCorrupt("the stream must hold exactly one record batch of the stated length")
    columns = dict(zip(schema.names, batches[0].columns, strict=True)) if batches else {}
    expected: list[str] = []
    values = [_decode_field(columns, f"c{i}", spec, expected) for i, spec in enumerate(meta["fields"])]
    index = _decode_index(meta["index"], columns, rows, expected)
    if schema.names != expected:
        raise TableCorrupt(f"fields {schema.names} do not match the metadata (expected {expected})")
    labels = _decode_axis(meta["columns"], len(values))
    try:
        # Built on a plain RangeIndex and relabelled after, so repeated index labels never trigger alignment.
        base = pd.RangeIndex(rows)
        series = {
            i: pd.Series(v, index=base, dtype=pandas_dtype(spec), copy=False)
            for i, (v, spec) in enumerate(zip(values, meta["fields"], strict=True))
        }
        frame = pd.DataFrame(series) if series else pd.DataFrame(index=base)
        frame.index = index
        frame.columns = labels
    except (ValueError, TypeError) as exc:
        raise TableCorrupt(f"fields do not form a table: {exc}") from None
    return frame


def _metadata(schema: pa.Schema) -> dict[str, Any]:
    raw = (schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise TableCorrupt(f"no {METADATA_KEY.decode()} metadata: not written by this codec")
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise TableCorrupt(f"table metadata is not JSON: {exc}") from None
    if not isinstance(meta, dict) or set(meta) != _TOP_KEYS:
        raise TableCorrupt(f"table metadata must have exactly the keys {sorted(_TOP_KEYS)}")
    if (meta["format"], meta["version"]) != (TABLE_FORMAT, TABLE_FORMAT_VERSION):
        raise TableCorrupt(
            f"table format {meta['format']!r} v{meta['version']!r} is not {TABLE_FORMAT} v{TABLE_FORMAT_VERSION}"
        )
    if not _is_count(meta["rows"]) or not isinstance(meta["fields"], list):
        raise TableCorrupt("table metadata: 'rows' must be a count and 'fields' a list")
    return meta


def _decode_field(columns: dict[str, pa.Array], name: str, spec: Any, expected: list[str]) -> Any:
    where = f"field {name}"
    data = columns.get(name)
    if data is None or data.type != arrow_type(spec, where):
        raise TableCorrupt(f"{where}: missing or not of the Arrow type its dtype {spec!r} needs")
    expected.append(name)
    tags = columns.get(f"{name}.tag")
    if tags is not None:
        if spec != "object" or tags.type != pa.int8():
            raise TableCorrupt(f"{where}: unexpected value tags")
        expected.append(f"{name}.tag")
    try:
        return decode_column(spec, data, tags, where)
    except TableCodecError:
        raise
    except (ValueError, TypeError, pa.ArrowException) as exc:
        raise TableCorrupt(f"{where}: {exc}") from None


def _decode_index(doc: Any, columns: dict[str, pa.Array], rows: int, expected: list[str]) -> pd.Index:
    if not isinstance(doc, dict) or doc.get("kind") not in ("range", "labels"):
        raise TableCorrupt("index metadata must be a range or labels description")
    name = _decoded_label(doc.get("name"), "index name")
    if doc["kind"] == "range":
        index = _range(doc, {"kind", "start", "stop", "step", "name"}, "index")
        if len(index) != rows:
            raise TableCorrupt(f"the RangeIndex has {len(index)} labels for {rows} rows")
        return index
    if set(doc) != {"kind", "dtype", "name"}:
        raise TableCorrupt("labels index metadata must have the keys kind, dtype, name")
    labels = _decode_field(columns, "index", doc["dtype"], expected)
    return pd.Index(labels, dtype=pandas_dtype(doc["dtype"]), name=name, copy=False)


def _decode_axis(doc: Any, width: int) -> pd.Index:
    if not isinstance(doc, dict):
        raise TableCorrupt("column metadata must be an object")
    name = _decoded_label(doc.get("name"), "columns name")
    if doc.get("kind") == "range":
        labels = _range(doc, {"kind", "start", "stop", "step", "name"}, "columns")
    elif doc.get("kind") == "labels" and set(doc) == {"kind", "dtype", "labels", "name"}:
        spec = doc["dtype"]
        if not isinstance(doc["labels"], list) or not all(type(v) in (str, int) for v in doc["labels"]):
            raise TableCorrupt("column labels must be a list of str or int")
        arrow_type(spec, "columns")
        labels = pd.Index(doc["labels"], dtype=pandas_dtype(spec), name=name)
    else:
        raise TableCorrupt("column metadata must be a range or labels description")
    if len(labels) != width:
        raise TableCorrupt(f"{len(labels)} column labels for {width} fields")
    return labels


def _range(doc: dict[str, Any], keys: set[str], where: str) -> pd.RangeIndex:
    if set(doc) != keys or not all(_is_int(doc[k]) for k in ("start", "stop", "step")) or doc["step"] == 0:
        raise TableCorrupt(f"{where}: a range needs integer start, stop and a non-zero step")
    return pd.RangeIndex(doc["start"], doc["stop"], doc["step"], name=_decoded_label(doc["name"], where))


def _decoded_label(value: Any, where: str) -> str | int | None:
    if value is None or type(value) in (str, int):
        return value
    raise TableCorrupt(f"{where} must be null, a string or an integer")


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0
