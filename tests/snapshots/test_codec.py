"""The table codec: exact round trips over random frames, the cases that matter, and refusals."""

from __future__ import annotations

import json
import random

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from gymrpc.snapshots import (
    TableCorrupt,
    TableUnsupported,
    decode_table,
    encode_table,
    frame_differences,
    frame_fingerprint,
)
from gymrpc.snapshots.codec import METADATA_KEY, _stream
from tests.snapshots.frames import random_frame

SEEDS = range(400)


@pytest.mark.parametrize("seed", [SEEDS[i::8] for i in range(8)], ids=lambda s: f"seeds{s[0]}")
def test_random_frames_round_trip_exactly_and_encode_deterministically(seed: range) -> None:
    for s in seed:
        frame = random_frame(random.Random(s))
        data = encode_table(frame)
        back = decode_table(data)
        assert frame_differences(frame, back) == [], f"seed {s}"
        assert frame_fingerprint(frame) == frame_fingerprint(back)
        assert encode_table(back) == data, f"seed {s}: encoding is not deterministic"


def test_none_and_nan_stay_apart_in_object_columns() -> None:
    frame = pd.DataFrame({"phone": pd.Series(["1-800", float("nan"), None], dtype=object)})
    back = decode_table(encode_table(frame))
    values = list(back["phone"])
    assert values[0] == "1-800"
    assert values[2] is None
    assert isinstance(values[1], float)
    assert values[1] != values[1]


def test_the_comparison_itself_tells_none_from_nan_and_types_apart() -> None:
    base = pd.DataFrame({"a": pd.Series([float("nan"), 1, "x"], dtype=object)})
    for other in ([None, 1, "x"], [float("nan"), 1.0, "x"], [float("nan"), True, "x"]):
        assert frame_differences(base, pd.DataFrame({"a": pd.Series(other, dtype=object)}))
    assert base["a"].equals(pd.Series([None, 1, "x"], dtype=object))  # why pandas' own equals is not enough


def test_index_labels_repeated_and_named_and_ranges_survive() -> None:
    frame = pd.DataFrame({"x": ["a", "b", "c"]}, dtype=object)
    frame.index = pd.Index([298, 299, 0], name="row")
    back = decode_table(encode_table(frame))
    assert list(back.index) == [298, 299, 0]
    assert back.index.name == "row"
    assert back.index.dtype == "int64"
    stepped = pd.DataFrame({"x": [1, 2]}, index=pd.RangeIndex(10, 4, -3))
    assert type(decode_table(encode_table(stepped)).index) is pd.RangeIndex
    assert frame_differences(stepped, decode_table(encode_table(stepped))) == []


@pytest.mark.parametrize(
    "frame",
    [
        pd.DataFrame(columns=["file_path"], dtype=object),
        pd.DataFrame(),
        pd.DataFrame(index=pd.RangeIndex(4)),
        pd.DataFrame({"n": np.array([], dtype="int32")}, index=pd.Index([], dtype=object)),
    ],
    ids=["no-rows", "nothing", "no-columns", "typed-empty"],
)
def test_empty_tables(frame: pd.DataFrame) -> None:
    assert frame_differences(frame, decode_table(encode_table(frame))) == []


def test_dtypes_survive_including_ints_turned_float_by_a_nan() -> None:
    frame = pd.DataFrame(
        {
            "count": pd.Series([1, 2, None]).astype("float64"),
            "flag": np.array([True, False, True]),
            "u8": np.array([0, 255, 7], dtype="uint8"),
            "when": pd.to_datetime(["2023-11-30 23:59:00", None, "2020-01-01 00:00:00"]),
            "nullable": pd.array([1, None, 3], dtype="Int64"),
            "text": pd.Series(["a", None, "b"], dtype="str"),
            "neg_zero": np.array([-0.0, 0.0, np.inf]),
        }
    )
    back = decode_table(encode_table(frame))
    assert frame_differences(frame, back) == []
    assert list(back.dtypes.astype(str)) == list(frame.dtypes.astype(str))
    assert np.signbit(back["neg_zero"].iloc[0])


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (pd.DataFrame({"c": pd.Categorical(["a"])}), "dtype"),
        (pd.DataFrame({"t": pd.to_datetime(["2020-01-01"]).tz_localize("UTC")}), "dtype"),
        (pd.DataFrame({"v": pd.Series([(1, 2)], dtype=object)}), "tuple"),
        (pd.DataFrame({"v": pd.Series([pd.Timestamp("2020-01-01")], dtype=object)}), "Timestamp"),
        (pd.DataFrame({"v": pd.Series([{1: "int key"}], dtype=object)}), "keys"),
        (pd.DataFrame({"v": [1]}, index=pd.MultiIndex.from_tuples([(1, 2)])), "MultiIndex"),
        (pd.DataFrame({("a", "b"): [1]}), "MultiIndex"),
    ],
)
def test_what_cannot_round_trip_is_refused_on_encode(frame: pd.DataFrame, message: str) -> None:
    with pytest.raises(TableUnsupported, match=message):
        encode_table(frame)


def test_attrs_are_refused_rather_than_dropped() -> None:
    frame = pd.DataFrame({"a": [1]})
    frame.attrs["source"] = "csv"
    with pytest.raises(TableUnsupported, match="attrs"):
        encode_table(frame)


def _sample() -> bytes:
    return encode_table(pd.DataFrame({"a": pd.Series(["x", None, float("nan")], dtype=object), "b": [1, 2, 3]}))


@pytest.mark.parametrize("cut", [0, 1, 8, 100, -1, -9])
def test_truncated_bytes_are_corrupt(cut: int) -> None:
    data = _sample()
    with pytest.raises(TableCorrupt):
        decode_table(data[:cut])


def _block(stream: bytes) -> bytes:
    """Frame a raw Arrow IPC stream as an uncompressed table block."""
    return b"GTB1\x00" + len(stream).to_bytes(8, "big") + stream


def _rewrite(data: bytes, edit) -> bytes:  # type: ignore[no-untyped-def]
    """Re-emit a valid block whose metadata or fields were edited (a well-formed lie)."""
    reader = pa.ipc.open_stream(_stream(data))
    batch = reader.read_next_batch()
    meta = json.loads(reader.schema.metadata[METADATA_KEY])
    arrays, names = list(batch.columns), list(batch.schema.names)
    meta, arrays, names = edit(meta, arrays, names)
    schema = pa.schema(
        [pa.field(n, a.type) for n, a in zip(names, arrays, strict=True)], metadata={METADATA_KEY: json.dumps(meta)}
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=schema))
    return _block(sink.getvalue().to_pybytes())


@pytest.mark.parametrize(
    "edit",
    [
        lambda m, a, n: ({**m, "version": 2}, a, n),
        lambda m, a, n: ({**m, "rows": 4}, a, n),
        lambda m, a, n: ({**m, "fields": ["int64", "int64"]}, a, n),
        lambda m, a, n: ({**m, "extra": 1}, a, n),
        lambda m, a, n: (m, [a[0], pa.array([0, 9, 2], pa.int8()), a[2]], n),  # unknown tag
        lambda m, a, n: (m, [a[0], pa.array([0, 0, 2], pa.int8()), a[2]], n),  # a null tagged as a string
        lambda m, a, n: (m, [pa.array(["x", "y", None]), a[1], a[2]], n),  # a string where a null was
        lambda m, a, n: (m, [a[0], a[2]], [n[0], n[2]]),  # tags dropped
        lambda m, a, n: (m, [*a, pa.array([1, 2, 3])], [*n, "c9"]),  # an extra field
        lambda m, a, n: ({**m, "index": {"kind": "range", "start": 0, "stop": 3, "step": 0, "name": None}}, a, n),
    ],
    ids=[
        "version",
        "rows",
        "fields",
        "extra-key",
        "bad-tag",
        "tag-null",
        "null-slot",
        "no-tags",
        "extra-field",
        "step0",
    ],
)
def test_well_formed_streams_that_lie_are_corrupt(edit) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TableCorrupt):
        decode_table(_rewrite(_sample(), edit))


def test_foreign_arrow_streams_are_corrupt() -> None:
    sink = pa.BufferOutputStream()
    table = pa.table({"a": [1, 2]})
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(TableCorrupt, match="magic"):
        decode_table(sink.getvalue().to_pybytes())
    with pytest.raises(TableCorrupt, match="metadata"):
        decode_table(_block(sink.getvalue().to_pybytes()))


@pytest.mark.parametrize(
    "header", [b"GTB1\x07" + bytes(8), b"GTB1\x01" + (2**40).to_bytes(8, "big"), b"GTB1\x00" + bytes(8)]
)
def test_bad_block_headers_are_corrupt(header: bytes) -> None:
    with pytest.raises(TableCorrupt):
        decode_table(header + b"payload")
