"""Top-level protobuf fields as raw bytes: what changed between two revisions of a record, and back.

A deterministic serialisation writes known fields in field-number order, each repeated
entry as its own tag + value. Splitting the bytes at top-level field boundaries (no
parsing of nested messages) gives, per field number, the list of entries; the bytes of
the record are those entries joined in field-number order. Between two boundaries of an
episode most fields are byte-identical and repeated ones (messages, tool calls, model
calls) only grow, so a delta holds, per changed field, how many old entries it keeps and
the new entries: a boundary costs the bytes of its change, not of the whole record.

Delta layout (little-endian): repeated (u32 field number | u32 entries kept | u32 new
entries | each new entry as u32 length + bytes). A field absent from the delta is unchanged; a
field with 0 kept and 0 new is removed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

Fields = dict[int, list[bytes]]
Values = dict[int, "int | bytes | list[bytes]"]
"""Top-level field values of a record as `Shallow` reads them: a varint as int, a length-delimited
field as its raw bytes, a repeated field as the list of those."""
try:
    from gymrpc.store._fields import revise as _native_revise
except ImportError:  # built without a C compiler: `Shallow` computes the same deltas with upb and Python
    _native_revise = None
NATIVE_BUILT = _native_revise is not None
"""Whether this install compiled the C diff (gymrpc/store/_fields.c)."""

_FIELD = struct.Struct("<III")
_U32 = struct.Struct("<I")
_NONE: list[bytes] = []


class WireError(ValueError):
    """The bytes are not a well-formed protobuf message or delta."""


def _varint(data: bytes | memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise WireError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise WireError("varint too long")


def _entry(data: bytes, start: int, end: int) -> tuple[int, int]:
    """The field number of the top-level entry at `start`, and where it ends."""
    pos = start
    tag = data[pos]
    pos += 1
    if tag >= 0x80:  # one-byte tags (fields 1-15) are the common case
        tag, pos = _varint(data, start)
    wire = tag & 7
    if wire == 2:
        size = data[pos] if pos < end else 0
        pos += 1
        if size >= 0x80:
            size, pos = _varint(data, pos - 1)
        pos += size
    elif wire == 0:
        while pos < end and data[pos] >= 0x80:
            pos += 1
        pos += 1
    elif wire == 1:
        pos += 8
    elif wire == 5:
        pos += 4
    else:
        raise WireError(f"wire type {wire} at byte {start}")
    number = tag >> 3
    if pos > end or number == 0:
        raise WireError(f"field at byte {start} runs past the end")
    return number, pos


def split(data: bytes, like: Fields | None = None) -> Fields:
    """Entries of each top-level field, in the order they appear.

    `like` (the split of a previous revision) makes it cheap: where the next bytes are an old
    field's entries (all of them: a repeated field that only grew starts with them), those
    entries are what a parse would find (entries are self-delimiting), so they are reused
    (the same bytes objects: `diff` then compares by identity) instead of parsed in Python.
    Which old field is tried next is only a guess; a wrong guess costs a parse, never a wrong
    result.
    """
    fields: Fields = {}
    pos, end = 0, len(data)
    prev = list(like.items()) if like else []
    i, count = 0, len(prev)
    while pos < end:
        if i < count:
            number, old = prev[i]
            blob = old[0] if len(old) == 1 else b"".join(old)
            if data.startswith(blob, pos):
                pos += len(blob)
                i += 1
                entries = fields.get(number)
                if entries is None:
                    fields[number] = list(old)
                else:
                    entries.extend(old)
                continue
        start = pos
        number, pos = _entry(data, start, end)
        entries = fields.get(number)
        if entries is None:
            fields[number] = [data[start:pos]]
        else:
            entries.append(data[start:pos])
        while i < count and prev[i][0] <= number:  # past this field: its old entries changed
            i += 1
    return fields


def join(fields: Fields) -> bytes:
    """The message bytes of `fields` (field-number order, as a deterministic serialisation writes them)."""
    return b"".join(b"".join(fields[number]) for number in sorted(fields))


def diff(old: Fields, new: Fields) -> bytes:
    """The delta that turns `old` into `new`."""
    parts: list[bytes] = []
    for number in sorted(old.keys() | new.keys()):
        before, after = old.get(number, _NONE), new.get(number, _NONE)
        if before == after:
            continue
        kept = 0
        limit = min(len(before), len(after))
        while kept < limit and before[kept] == after[kept]:
            kept += 1
        if kept < len(before):  # an old entry changed or went away: replace the field
            kept = 0
        added = after[kept:]
        parts.append(_FIELD.pack(number, kept, len(added)))
        for entry in added:
            parts.append(_U32.pack(len(entry)))
            parts.append(entry)
    return b"".join(parts)


def _uvarint(value: int) -> bytes:
    if value < 0x80:
        return _BYTES[value]
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_BYTES = [bytes((i,)) for i in range(0x80)]
_SCALAR_TYPES = (
    FieldDescriptor.TYPE_UINT32,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_ENUM,
    FieldDescriptor.TYPE_BOOL,
)
_BYTES_TYPES = (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES)


class Shallow:
    """The top-level fields of one message type read by upb (C) instead of `split` (Python).

    A twin message type is built with the same field numbers, every length-delimited field
    (message, string, bytes) declared `bytes` and every varint `uint64`, with explicit
    presence (proto2): parsing a record as the twin yields each top-level field's raw value
    without parsing nested messages. `diff` gives exactly the delta `diff(split(a), split(b))`
    gives (the entries are the canonical tag + value encodings a deterministic serialisation
    writes), so the on-disk format and every reader stay as they are; only the writer's CPU
    changes. Types whose top-level fields are not all varints or length-delimited are refused.
    """

    def __init__(self, descriptor: Descriptor) -> None:
        twin = descriptor_pb2.FileDescriptorProto(
            name=f"gymrpc_shallow/{descriptor.full_name}.proto", package="gymrpc_shallow", syntax="proto2"
        )
        message = twin.message_type.add(name=descriptor.name)
        self._tags: dict[int, tuple[bytes, bool, bytes]] = {}
        """Per field number: its tag, whether it is a varint, and the delta header of one new entry."""
        self._repeated = [f.number for f in descriptor.fields if f.is_repeated]
        for field in descriptor.fields:
            if field.type in _SCALAR_TYPES and not field.is_packed:
                kind, varint = FieldDescriptor.TYPE_UINT64, True
            elif field.type in _BYTES_TYPES:
                kind, varint = FieldDescriptor.TYPE_BYTES, False
            else:
                raise ValueError(f"{field.full_name}: a shallow read supports varint and length-delimited fields only")
            label = FieldDescriptor.LABEL_REPEATED if field.is_repeated else FieldDescriptor.LABEL_OPTIONAL
            message.field.add(name=field.name, number=field.number, type=kind, label=label)
            tag = _uvarint(field.number << 3 | (0 if varint else 2))
            self._tags[field.number] = (tag, varint, _FIELD.pack(field.number, 0, 1))
        pool = descriptor_pool.DescriptorPool()
        pool.Add(twin)
        self._type = message_factory.GetMessageClass(pool.FindMessageTypeByName(f"gymrpc_shallow.{descriptor.name}"))
        self._numbers = {f: f.number for f in self._type.DESCRIPTOR.fields}  # a dict hit beats the attribute

    def values(self, data: bytes, *, serialized: bool = False) -> Values | None:
        """The fields of `data`, or None (then write it whole) if it holds fields this type does not know
        or is not encoded canonically (a varint longer than needed, a singular field twice): a delta
        of values rebuilds canonical entries, so it must only ever apply to canonical bytes.

        `serialized`: `data` is protobuf's own serialisation of a message, canonical but for unknown
        fields, so the size check that catches other encoders' bytes is skipped.
        """
        try:
            message = self._type.FromString(data)
        except DecodeError:
            return None
        if len(UnknownFieldSet(message)) or (not serialized and message.ByteSize() != len(data)):
            return None  # unknown fields, or not the canonical encoding a delta by value would rebuild
        numbers = self._numbers
        found: Values = {numbers[f]: v for f, v in message.ListFields()}  # in field-number order
        for number in self._repeated:
            entries = found.get(number)
            if entries is not None:
                found[number] = list(entries)  # type: ignore[call-overload]
        return found

    def diff(self, old: Values, new: Values) -> tuple[bytes, None]:
        """The delta that turns the record of `old` into that of `new` (the layout `diff` writes), and no CRC
        (the caller computes it from the bytes)."""
        parts: list[bytes] = []
        if old.keys() == new.keys():  # the common case: both in field-number order, so pair them up
            pairs = zip(new, old.values(), new.values(), strict=True)
        else:
            numbers = sorted(old.keys() | new.keys())
            pairs = zip(numbers, [old.get(n) for n in numbers], [new.get(n) for n in numbers], strict=True)
        tags = self._tags
        for number, before, after in pairs:
            if before == after:
                continue
            if after is None:
                parts.append(_FIELD.pack(number, 0, 0))
                continue
            tag, varint, one = tags[number]
            if varint:
                entry = tag + _uvarint(after)  # type: ignore[arg-type]
                parts += (one, _U32.pack(len(entry)), entry)
                continue
            if type(after) is bytes:
                size = len(after)
                head = tag + (_BYTES[size] if size < 0x80 else _uvarint(size))
                parts += (one, _U32.pack(len(head) + size), head, after)
                continue
            kept = len(before) if type(before) is list and after[: len(before)] == before else 0  # type: ignore[arg-type]
            added = after[kept:]  # type: ignore[index]
            parts.append(_FIELD.pack(number, kept, len(added)))
            for value in added:
                size = len(value)
                head = tag + (_BYTES[size] if size < 0x80 else _uvarint(size))
                parts += (_U32.pack(len(head) + size), head, value)
        return b"".join(parts), None


@dataclass(slots=True)
class NativeState:
    """A revision as `Native` keeps it: its bytes, and once diffed against the revision before, its
    checksum per field (so the next revision's CRC reads only the fields that changed)."""

    data: bytes
    sums: bytes | None = None


class Native:
    """`diff(split(old), split(new))` in C (gymrpc/store/_fields.c), 10-20x faster than `Shallow`: a
    revision's state is its own bytes (and their per-field CRCs, `NativeState`), and the delta is computed
    without a Python object per field."""

    def values(self, data: bytes, *, serialized: bool = False) -> NativeState:
        return NativeState(data)

    def diff(self, old: NativeState, new: NativeState) -> tuple[bytes | None, int | None]:
        """The delta, or None (write `new` whole) if a record's fields are not in field-number order; and
        `zlib.crc32` of `new`'s bytes, read only where they differ from `old`'s."""
        assert _native_revise is not None
        delta, crc, new.sums = _native_revise(old.data, old.sums, new.data)
        return delta, crc


def differ(descriptor: Descriptor) -> Native | Shallow:
    """The fastest way this build has to compute the deltas of records of `descriptor`."""
    return Native() if NATIVE_BUILT else Shallow(descriptor)


def apply(base: Fields, delta: bytes) -> Fields:
    """`base` with `delta` applied, as a new mapping (`base` is not changed)."""
    fields = dict(base)
    pos, end = 0, len(delta)
    try:
        while pos < end:
            number, kept, count = _FIELD.unpack_from(delta, pos)
            pos += _FIELD.size
            entries = list(fields.get(number, _NONE)[:kept])
            if len(entries) != kept:
                raise WireError(f"delta keeps {kept} entries of field {number}, the base has {len(entries)}")
            for _ in range(count):
                (size,) = _U32.unpack_from(delta, pos)
                pos += 4
                if pos + size > end:
                    raise WireError("delta entry runs past the end")
                entries.append(delta[pos : pos + size])
                pos += size
            if entries:
                fields[number] = entries
            else:
                fields.pop(number, None)
    except struct.error:
        raise WireError("truncated delta") from None
    return fields
