"""Snapshots written by the version-1 codec must decode, today and later, to exactly the same frames."""

from __future__ import annotations

import pytest

from gymrpc.snapshots import (
    TABLE_FORMAT_VERSION,
    decode_session,
    decode_table,
    encode_table,
    frame_differences,
    unpack,
)
from gymrpc.snapshots.codec import _stream
from tests.snapshots.golden_frames import FRAMES, GOLDEN, SESSION_META, SESSION_PAYLOAD, SESSION_TABLES


@pytest.mark.parametrize("name", sorted(FRAMES))
def test_golden_tables_still_decode_exactly(name: str) -> None:
    data = (GOLDEN / f"{name}.v1.arrow").read_bytes()
    assert frame_differences(FRAMES[name](), decode_table(data)) == []


@pytest.mark.parametrize("name", sorted(FRAMES))
def test_todays_encoder_still_writes_the_golden_streams(name: str) -> None:
    """Same frame, same Arrow stream as the v1 encoder wrote (so blocks keep their content addresses).

    Compared before compression: the zstd bytes may legitimately change with the zstd library.
    """
    golden = _stream((GOLDEN / f"{name}.v1.arrow").read_bytes())
    assert _stream(encode_table(FRAMES[name]())).to_pybytes() == golden.to_pybytes()


def test_golden_session_payload_still_unpacks_and_decodes() -> None:
    session = unpack((GOLDEN / SESSION_PAYLOAD).read_bytes())
    assert dict(session.manifest.meta) == SESSION_META
    tables = decode_session(session.manifest, session.blocks.__getitem__)
    assert sorted(tables) == sorted(SESSION_TABLES)
    for name in SESSION_TABLES:
        assert frame_differences(FRAMES[name](), tables[name]) == []


def test_every_golden_file_is_covered() -> None:
    expected = {f"{name}.v{TABLE_FORMAT_VERSION}.arrow" for name in FRAMES} | {SESSION_PAYLOAD}
    assert {p.name for p in GOLDEN.iterdir()} == expected
