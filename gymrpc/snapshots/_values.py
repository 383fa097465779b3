"""Exact encoding of the Python values an object-dtype column can hold.

Arrow has one kind of null, but an object column distinguishes `None` from a float NaN
(the reference's JSON round trip once lost that difference) and may hold ints, bools or
JSON values that a model passed as tool arguments. So an object column becomes a string
column plus, only when it holds anything but strings, an int8 tag per row:

    TAG_STR   the value is the string itself
    TAG_NONE  None                        (string slot null)
    TAG_NAN   float('nan'), the canonical bit pattern every pandas NaN has (string slot null)
    TAG_OTHER a tagged JSON text in the string slot, one of
              ["int", n] | ["float", "<16 hex digits of the IEEE bits>"] | ["bool", b]
              | ["np", "<dtype.str>", "<hex bytes>"] (a numpy scalar) | ["json", <list or dict>]

Anything else (Timestamps, Decimals, tuples, custom objects) raises `TableUnsupported`
when encoding, rather than coming back as something else.
"""

from __future__ import annotations

import json
import math
import struct
from itertools import repeat
from typing import Any

import numpy as np
import pandas as pd

TAG_STR, TAG_NONE, TAG_NAN, TAG_OTHER = 0, 1, 2, 3
_CANONICAL_NAN_BITS = struct.unpack("<Q", struct.pack("<d", float("nan")))[0]
_TAG_FLOAT = 4
"""Provisional tag of any float while tagging: the canonical NaN becomes TAG_NAN, other floats TAG_OTHER."""
_NONE_TYPE = type(None)
_NONE = np.array(None, dtype=object)
"""None as a 0-d object array: `np.equal(values, _NONE)` finds the None rows of an object column."""
_FIRST_TAG = {str: TAG_STR, _NONE_TYPE: TAG_NONE, float: _TAG_FLOAT}
_NUMPY_KINDS = frozenset("biufcmM")


class TableCodecError(ValueError):
    """Base of the table codec's errors."""


class TableUnsupported(TableCodecError):
    """The table holds a dtype, label or value this codec cannot reproduce exactly (raised on encode)."""


class TableCorrupt(TableCodecError):
    """Bytes that are not a table this codec wrote (raised on decode); nothing is returned."""


def _float_bits(value: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", value))[0]


def tag_values(values: np.ndarray, where: str) -> tuple[np.ndarray, np.ndarray | None]:
    """String slots and int8 tags; when every value is exactly a str, the input itself and no tags.

    Vectorized over the column (this is most of an encode's Python work): only values that are
    neither str, None nor the canonical NaN, which are rare, go through Python one by one.
    """
    kinds = list(map(type, values))
    rows, strings = len(kinds), kinds.count(str)  # exact types: a str subclass (np.str_) must not pass as str
    if strings == rows:
        return values, None
    floats = kinds.count(float)
    if strings + kinds.count(_NONE_TYPE) + floats == rows:
        gaps = _tag_gaps(values, floats)
        if gaps is not None:
            return gaps
    tags = np.fromiter(map(_FIRST_TAG.get, kinds, repeat(TAG_OTHER)), dtype=np.int8, count=rows)
    nans = np.flatnonzero(tags == _TAG_FLOAT)
    if len(nans):  # object -> float64 keeps each float's bits, so only the canonical NaN matches
        bits = values[nans].astype(np.float64).view(np.uint64)
        tags[nans] = np.where(bits == _CANONICAL_NAN_BITS, TAG_NAN, TAG_OTHER)
    slots = values.copy()
    slots[tags != TAG_STR] = None
    for row in np.flatnonzero(tags == TAG_OTHER):
        slots[row] = _encode_other(values[row], f"{where} row {row}")
    return slots, tags


def _tag_gaps(values: np.ndarray, floats: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Strings with gaps that are None or the canonical NaN (CSV gaps, fields a new row left out).

    The usual mixed column, tagged by two C-level scans; None when some float is not the
    canonical NaN (a number, or a NaN with other bits), which the general path keeps exactly.
    """
    if not floats:  # only str and None
        return values, np.equal(values, _NONE).astype(np.int8)  # TAG_NONE where None; Arrow nulls those slots
    with np.errstate(invalid="ignore"):  # comparing a signalling NaN sets the invalid flag
        nones = np.equal(values, _NONE)
    tags = nones.astype(np.int8)
    nans = pd.isna(values) & ~nones
    rows = np.flatnonzero(nans)
    if len(rows) != floats or not (values[rows].astype(np.float64).view(np.uint64) == _CANONICAL_NAN_BITS).all():
        return None
    tags[rows] = TAG_NAN
    slots = values.copy()
    slots[rows] = None
    return slots, tags


def _encode_other(value: Any, where: str) -> str:
    kind = type(value)
    if kind is bool:
        doc: list[Any] = ["bool", value]
    elif kind is int:
        doc = ["int", value]
    elif kind is float:
        doc = ["float", f"{_float_bits(value):016x}"]
    elif isinstance(value, np.generic) and value.dtype.kind in _NUMPY_KINDS:
        doc = ["np", value.dtype.str, value.tobytes().hex()]
    elif kind is list or kind is dict:
        _check_json_tree(value, where)
        doc = ["json", value]
    else:
        raise TableUnsupported(f"{where}: a {kind.__module__}.{kind.__qualname__} cannot be snapshotted exactly")
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _check_json_tree(value: Any, where: str) -> None:
    """Lists and dicts survive JSON only if every leaf is a JSON-native type and every key a str."""
    kind = type(value)
    if kind is list:
        for item in value:
            _check_json_tree(item, where)
    elif kind is dict:
        for key, item in value.items():
            if type(key) is not str:
                raise TableUnsupported(f"{where}: dict keys must be str to round-trip, got {key!r}")
            _check_json_tree(item, where)
    elif kind is float:
        if not math.isfinite(value):
            raise TableUnsupported(f"{where}: a non-finite float inside a list or dict cannot be snapshotted")
    elif kind not in (str, int, bool) and value is not None:
        raise TableUnsupported(f"{where}: a {kind.__qualname__} inside a list or dict cannot be snapshotted")


def untag_values(slots: np.ndarray, nulls: np.ndarray, tags: np.ndarray | None, where: str) -> np.ndarray:
    """Inverse of `tag_values`: an object ndarray holding exactly the encoded values.

    `nulls` marks the null string slots; a slot must be null exactly where the tag says None or NaN.
    """
    out = np.asarray(slots, dtype=object)
    if tags is None:
        if nulls.any():
            raise TableCorrupt(f"{where}: a null string without a tag")
        return out
    if len(tags) and (tags.min() < TAG_STR or tags.max() > TAG_OTHER):
        raise TableCorrupt(f"{where}: unknown value tag")
    if not np.array_equal(nulls, (tags == TAG_NONE) | (tags == TAG_NAN)):
        raise TableCorrupt(f"{where}: null strings do not match the None and NaN tags")
    out = out.copy()
    out[tags == TAG_NONE] = None
    out[tags == TAG_NAN] = float("nan")  # one (immutable) NaN object for the column's NaN rows
    for row in np.flatnonzero(tags == TAG_OTHER):
        out[row] = _decode_other(out[row], f"{where} row {row}")
    return out


def _decode_other(text: str, where: str) -> Any:
    try:
        doc = json.loads(text)
        kind = doc[0]
        if kind == "bool" and len(doc) == 2 and type(doc[1]) is bool:
            return doc[1]
        if kind == "int" and len(doc) == 2 and type(doc[1]) is int:
            return doc[1]
        if kind == "float" and len(doc) == 2 and len(doc[1]) == 16:
            return struct.unpack("<d", struct.pack("<Q", int(doc[1], 16)))[0]
        if kind == "np" and len(doc) == 3:
            dtype = np.dtype(doc[1])
            raw = bytes.fromhex(doc[2])
            if dtype.kind not in _NUMPY_KINDS or len(raw) != dtype.itemsize:
                raise ValueError("bad numpy scalar")
            return np.frombuffer(raw, dtype=dtype)[0]
        if kind == "json" and len(doc) == 2 and type(doc[1]) in (list, dict):
            return doc[1]
    except (ValueError, TypeError, IndexError, KeyError, RecursionError) as exc:  # a snapshot comes from a caller
        raise TableCorrupt(f"{where}: tagged value does not decode: {exc}") from None
    raise TableCorrupt(f"{where}: tagged value {text[:60]!r} is not one this codec writes")
