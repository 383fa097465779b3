"""The encoder's fast paths against the plain definitions they replace, over seeded random inputs.

Vectorized tagging must classify every value exactly as the row-by-row definition does
(down to which NaN bit patterns count as the canonical NaN), the block-manager shortcut must
encode exactly like `DataFrame.items()`, and the stream built from IPC messages must be byte
for byte what `pa.ipc.new_stream` writes. (Seeded `random` rather than hypothesis, which is not
a dependency here: every failure names its seed.)
"""

from __future__ import annotations

import random
import struct
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from gymrpc.snapshots import TableUnsupported, decode_table, encode_table, frame_differences
from gymrpc.snapshots._values import TAG_NAN, TAG_NONE, TAG_OTHER, TAG_STR, _encode_other, tag_values
from gymrpc.snapshots.codec import _stream, column_arrays
from tests.snapshots.frames import random_frame


class Text(str):
    """A str subclass: it must not pass as a str (it would come back as one)."""


def _nan_with_bits(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


CANONICAL_NAN_BITS = struct.unpack("<Q", struct.pack("<d", float("nan")))[0]
_VALUES: list[Any] = [
    "x",
    "",
    "Ünïcödé ✓",
    "nan",
    None,
    float("nan"),
    np.nan,
    -float("nan"),  # sign bit set: not the canonical NaN, kept by its bits
    _nan_with_bits(0x7FF8000000000001),  # a NaN payload
    _nan_with_bits(0x7FF0000000000001),  # a signalling NaN
    -0.0,
    0.5,
    float("inf"),
    7,
    2**70,
    True,
    np.float64("nan"),  # a numpy scalar (a float subclass): not the Python NaN
    np.int64(3),
    np.bool_(False),
    [1, "a", None],
    {"k": [True, 2.5]},
]
_REFUSED: list[Any] = [Text("x"), np.str_("x"), (1, 2), pd.Timestamp("2020-01-01"), b"bytes"]


def reference_tag_values(values: np.ndarray, where: str) -> tuple[list[Any] | None, list[int] | None]:
    """The per-row definition the vectorized `tag_values` replaced (None, None: every value is a str)."""
    if all(type(v) is str for v in values):
        return None, None
    slots: list[Any] = []
    tags: list[int] = []
    for row, value in enumerate(values):
        if type(value) is str:
            slots.append(value)
            tags.append(TAG_STR)
        elif value is None:
            slots.append(None)
            tags.append(TAG_NONE)
        elif type(value) is float and struct.unpack("<Q", struct.pack("<d", value))[0] == CANONICAL_NAN_BITS:
            slots.append(None)
            tags.append(TAG_NAN)
        else:
            slots.append(_encode_other(value, f"{where} row {row}"))
            tags.append(TAG_OTHER)
    return slots, tags


def _column(rng: random.Random) -> np.ndarray:
    rows = rng.choice([0, 1, 2, 7, 64, 300])
    mostly = rng.choice(["str", "str+gaps", "anything"])
    values: list[Any] = []
    for _ in range(rows):
        if mostly == "str" or (mostly == "str+gaps" and rng.random() < 0.8):
            values.append(rng.choice(_VALUES[:4]) + str(rng.randrange(9)))
        elif mostly == "str+gaps":
            values.append(rng.choice([None, float("nan")]))
        else:
            values.append(rng.choice(_VALUES))
    if values and rng.random() < 0.1:
        values[rng.randrange(len(values))] = rng.choice(_REFUSED)
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _outcome(fn: Any, values: np.ndarray) -> tuple[str, Any, Any]:
    try:
        slots, tags = fn(values, "column 'c'")
    except TableUnsupported as exc:
        return "refused", str(exc), None
    if tags is None:
        return "all str", None, None
    listed = [None if s is None else s for s in slots]
    return "tagged", listed, [int(t) for t in tags]


@pytest.mark.parametrize("block", range(8))
def test_vectorized_tagging_matches_the_row_by_row_definition(block: int) -> None:
    for seed in range(block * 250, (block + 1) * 250):
        values = _column(random.Random(seed))
        expected = _outcome(reference_tag_values, values)
        got = _outcome(tag_values, values)
        assert got == expected, f"seed {seed}"


def test_every_nan_but_the_canonical_one_keeps_its_bits() -> None:
    odd = [-float("nan"), _nan_with_bits(0x7FF8000000000001), _nan_with_bits(0x7FF0000000000001)]
    frame = pd.DataFrame({"v": pd.Series([float("nan"), *odd, None], dtype=object)})
    back = decode_table(encode_table(frame))["v"].tolist()
    assert back[-1] is None
    bits = [struct.unpack("<Q", struct.pack("<d", v))[0] for v in back[:-1]]
    assert bits == [CANONICAL_NAN_BITS, *(struct.unpack("<Q", struct.pack("<d", v))[0] for v in odd)]
    assert all(type(v) is float for v in back[:-1])


@pytest.mark.parametrize("value", _REFUSED, ids=lambda v: type(v).__name__)
def test_lookalikes_of_str_are_refused_wherever_they_sit(value: Any) -> None:
    for rows in (["a", "b", value], [value], ["a", None, value, float("nan")]):
        frame = pd.DataFrame({"v": pd.Series(rows, dtype=object)})
        with pytest.raises(TableUnsupported, match=f"row {rows.index(value)}"):
            encode_table(frame)


def test_the_block_manager_shortcut_encodes_like_items(monkeypatch: pytest.MonkeyPatch) -> None:
    frames = [random_frame(random.Random(seed)) for seed in range(300)]
    fast = [encode_table(frame) for frame in frames]
    from pandas.core.internals.managers import BlockManager

    calls: list[int] = []
    items = pd.DataFrame.items

    def counted(frame: pd.DataFrame) -> Any:
        calls.append(1)
        return items(frame)

    monkeypatch.setattr(pd.DataFrame, "items", counted)
    monkeypatch.delattr(BlockManager, "iget_values")
    for seed, (frame, data) in enumerate(zip(frames, fast, strict=True)):
        assert encode_table(frame) == data, f"seed {seed}"
    assert len(calls) == len(frames)  # the fallback ran


def test_column_arrays_are_the_columns_by_position() -> None:
    frame = pd.DataFrame({"a": [1, 2], "b": ["x", None]}, dtype=object)
    frame["c"] = np.array([True, False])
    frame.columns = ["a", "a", "c"]  # repeated labels: only positions tell them apart
    arrays = column_arrays(frame)
    assert [list(a) for a in arrays] == [[1, 2], ["x", None], [True, False]]
    assert [a.dtype for a in arrays] == list(frame.dtypes)


def _writer_stream(stream: pa.Buffer) -> bytes:
    """The same schema and batch re-written by Arrow's own stream writer."""
    reader = pa.ipc.open_stream(stream)
    batches = list(reader)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, reader.schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def test_streams_are_byte_for_byte_what_the_ipc_writer_writes() -> None:
    for seed in range(300):
        frame = random_frame(random.Random(seed))
        stream = _stream(encode_table(frame))
        assert stream.to_pybytes() == _writer_stream(stream), f"seed {seed}"
    for empty in (pd.DataFrame(), pd.DataFrame(index=pd.RangeIndex(3))):
        stream = _stream(encode_table(empty))
        assert stream.to_pybytes() == _writer_stream(stream)
        assert frame_differences(empty, decode_table(encode_table(empty))) == []
