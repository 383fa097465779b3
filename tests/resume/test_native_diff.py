"""The C diff (gymrpc/store/_fields.c) against its Python reference: the same delta for every pair of
messages, None where `fields.join` would not give the bytes back, never a crash on bad bytes, and the
new record's CRC equal to `zlib.crc32` of its bytes, whatever per-field sums it was given."""

from __future__ import annotations

import shutil
import sysconfig
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gymrpc.store import EpisodeCheckpoint, fields

native = pytest.importorskip(
    "gymrpc.store._fields",
    reason="the C diff was not built (no C compiler); the store uses fields.Shallow instead",
)


def test_the_c_diff_is_built_where_a_compiler_is() -> None:
    """The extension is optional at install; where a compiler exists a missing build is a packaging bug."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler})")
    assert isinstance(fields.differ(EpisodeCheckpoint.DESCRIPTOR), fields.Native)


_varint = fields._uvarint


def _diff(old: bytes, new: bytes) -> bytes | None:
    return native.revise(old, None, new)[0]


@st.composite
def _entry(draw: st.DrawFn, number: int) -> bytes:
    wire = draw(st.sampled_from([0, 1, 2, 5]))
    tag = _varint(number << 3 | wire)
    if wire == 0:
        return tag + _varint(draw(st.integers(0, 2**64 - 1)))
    if wire == 1:
        return tag + draw(st.binary(min_size=8, max_size=8))
    if wire == 5:
        return tag + draw(st.binary(min_size=4, max_size=4))
    value = draw(st.binary(max_size=300))
    return tag + _varint(len(value)) + value


@st.composite
def _message(draw: st.DrawFn) -> bytes:
    """Fields in field-number order (as a deterministic serialisation writes them), some repeated."""
    numbers = sorted(draw(st.sets(st.integers(1, 2**29 - 1) | st.integers(1, 20), max_size=12)))
    return b"".join(draw(_entry(n)) for n in numbers for _ in range(draw(st.integers(1, 4))))


@st.composite
def _revision(draw: st.DrawFn, base: bytes) -> bytes:
    """`base` edited as an episode edits its record: fields grown, replaced, dropped, added."""
    split = fields.split(base)
    for number in list(split):
        action = draw(st.sampled_from(["keep", "keep", "grow", "replace", "drop"]))
        if action == "grow":
            split[number] = split[number] + [draw(_entry(number)) for _ in range(draw(st.integers(1, 3)))]
        elif action == "replace":
            split[number] = [draw(_entry(number))]
        elif action == "drop":
            del split[number]
    for number in draw(st.sets(st.integers(1, 40), max_size=3)):
        split.setdefault(number, [draw(_entry(number))])
    return fields.join(split)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_the_c_diff_writes_the_python_delta(data: st.DataObject) -> None:
    old = data.draw(_message())
    new = data.draw(_revision(old))
    delta = _diff(old, new)
    assert delta == fields.diff(fields.split(old), fields.split(new))
    assert fields.join(fields.apply(fields.split(old), delta)) == new
    assert _diff(new, new) == b""


@settings(max_examples=300, deadline=None)
@given(_message(), st.binary(max_size=64))
def test_bad_bytes_give_none_never_a_wrong_delta(good: bytes, junk: bytes) -> None:
    """A truncated or garbled message, or one whose fields are out of order, is written whole."""
    for bad in (good + junk, good[: len(good) // 2], junk + good):
        try:
            split = fields.split(bad)
        except fields.WireError:
            split = None
        delta = _diff(good, bad)
        if split is None or fields.join(split) != bad:
            assert delta is None
        elif delta is not None:  # None (a whole write) is always allowed; a delta must be the Python one
            assert delta == fields.diff(fields.split(good), split)
    assert _diff(b"\x10\x01\x08\x01", b"") is None  # field 2 before field 1
    assert _diff(b"", b"\x0a\x05ab") is None  # runs past the end
    assert _diff(b"", b"\x0b") is None  # wire type 3 (groups) is refused
    assert _diff(b"", b"\x12" + b"\xff" * 9 + b"\x02") is None  # a length past 64 bits
    assert _diff(b"", b"\x80\x80\x80\x80\x80\x08") is None  # a 6-byte tag: protobuf never writes one
    long_value = b"\x08" + b"\xff" * 12 + b"\x01"  # a 13-byte varint value: skipped as the Python split skips it
    assert _diff(b"", long_value) == fields.diff({}, fields.split(long_value))
    with pytest.raises(TypeError):
        native.revise("text", None, b"")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        native.revise(b"", "sums", b"")  # type: ignore[arg-type]


def test_records_of_hundreds_of_entries() -> None:
    """Past the 64 entries the C split keeps on the stack: a long conversation growing, then cut."""
    turns = [b"\x62" + bytes([n % 100]) + bytes(n % 100) for n in range(300)]  # field 12, length-delimited
    head = b"\x08\x01\x10\x07"
    for old, new in [(turns[:150], turns[:300]), (turns[:300], turns[:200]), ([], turns), (turns, [])]:
        before, after = head + b"".join(old), head + b"".join(new)
        delta = _diff(before, after)
        assert delta == fields.diff(fields.split(before), fields.split(after))
        assert fields.join(fields.apply(fields.split(before), delta)) == after


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_crc_of_every_revision_is_zlibs_with_the_sums_carried_along(data: st.DataObject) -> None:
    """A chain of revisions as a save makes them: each call gets the sums of the one before, and its CRC
    (read only where the record changed) and sums are those computed from scratch."""
    old, sums = data.draw(_message()), None
    for _ in range(data.draw(st.integers(1, 6))):
        new = data.draw(_revision(old))
        delta, crc, new_sums = native.revise(old, sums, new)
        assert (delta, crc) == (fields.diff(fields.split(old), fields.split(new)), zlib.crc32(new))
        assert native.revise(old, None, new)[2] == new_sums
        old, sums = new, new_sums


@settings(max_examples=200, deadline=None)
@given(_message(), st.binary(max_size=48))
def test_sums_that_do_not_fit_the_old_records_fields_are_ignored(old: bytes, junk: bytes) -> None:
    """Sums are only ever those `revise` returned for the same bytes (`fields.NativeState` keeps them
    together); sums cut short, garbled, or of a record with other fields are still caught and
    computed afresh, not trusted into a wrong CRC."""
    own = native.revise(b"", None, old)[2]
    longer = native.revise(b"", None, old + b"\xf8\xff\xff\xff\x0f\x01")[2]  # one more field (the largest number)
    for sums in (own[:-24], own + own[:24], junk, longer, own):
        delta, crc, _ = native.revise(old, sums, old)
        assert (delta, crc) == (b"", zlib.crc32(old))


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 63, 64, 65, 4095, 1 << 20])
def test_the_crc_of_long_histories(size: int) -> None:
    """Every length the slicing-by-8 loop and its tail meet, and a megabyte grown entry by entry."""
    value = bytes(range(256)) * (size // 256 + 1)
    record = b"\x6a" + _varint(size) + value[:size]  # field 13, length-delimited
    assert native.revise(b"", None, record)[1] == zlib.crc32(record)
    grown, sums = record, native.revise(b"", None, record)[2]
    for step in range(5):
        longer = grown + b"\x6a" + _varint(step + 1) + value[: step + 1]
        _, crc, sums = native.revise(grown, sums, longer)
        assert crc == zlib.crc32(longer)
        grown = longer
