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
from typing import Any

import numpy as np

TAG_STR, TAG_NONE, TAG_NAN, TAG_OTHER = 0, 1, 2, 3
_CANONICAL_NAN_BITS = struct.unpack("<Q", struct.pack("<d", float("nan")))[0]
_NUMPY_KINDS = frozenset("biufcmM")


class TableCodecError(ValueError):
    """Base of the table codec's errors."""


class TableUnsupported(TableCodecError):
    """The table holds a dtype, label or value this codec cannot reproduce exactly (raised on encode)."""


class TableCorrupt(TableCodecError):
    """Bytes that are not a table this codec wrote (raised on decode); nothing is returned."""


def _float_bits(value: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", value))[0]


def is_canonical_nan(value: Any) -> bool:
    return type(value) is float and value != value and _float_bits(value) == _CANONICAL_NAN_BITS


def tag_values(values: np.ndarray, where: str) -> tuple[Any, list[int] | None]:
    """String slots (the input itself when every value is a str) and tags (None in that case)."""
    if len(values) == 0 or set(map(type, values)) == {str}:
        return values, None
    types = [type(v) for v in values]
    slots: list[str | None] = []
    tags: list[int] = []
    for row, (value, kind) in enumerate(zip(values, types, strict=True)):
        if kind is str:
            slots.append(value)
            tags.append(TAG_STR)
        elif value is None:
            slots.append(None)
            tags.append(TAG_NONE)
        elif is_canonical_nan(value):
            slots.append(None)
            tags.append(TAG_NAN)
        else:
            slots.append(_encode_other(value, f"{where} row {row}"))
            tags.append(TAG_OTHER)
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
    for row in np.flatnonzero(tags != TAG_STR):
        tag = int(tags[row])
        if tag == TAG_OTHER:
            out[row] = _decode_other(out[row], f"{where} row {row}")
        else:
            out[row] = None if tag == TAG_NONE else float("nan")
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
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise TableCorrupt(f"{where}: tagged value does not decode: {exc}") from None
    raise TableCorrupt(f"{where}: tagged value {text[:60]!r} is not one this codec writes")
