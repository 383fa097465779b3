"""Content-addressed blocks, session bundles and many-session checkpoints: stored once, restored all or nothing."""

from __future__ import annotations

import random
from pathlib import Path

import pandas as pd
import pytest

from gymrpc.snapshots import (
    BlockCorrupt,
    BlockMissing,
    BlockStore,
    BundleCorrupt,
    CheckpointInvalid,
    SessionManifest,
    TableSet,
    collect,
    decode_session,
    digest_of,
    encode_session,
    frame_differences,
    pack,
    parse_records,
    restore_sessions,
    unpack,
    write_checkpoint,
)
from tests.snapshots.frames import random_frame


def _tables(seed: int) -> dict[str, pd.DataFrame]:
    rng = random.Random(seed)
    return {f"t{i}": random_frame(rng) for i in range(3)}


def test_block_store_round_trip_and_dedupe(tmp_path: Path) -> None:
    store = BlockStore(tmp_path)
    digest = store.put(b"block")
    assert digest == digest_of(b"block")
    assert store.put(b"block") == digest
    assert store.get(digest) == b"block"
    assert len(list(tmp_path.rglob("*"))) == 2  # one fan-out folder, one file


def test_block_store_reports_missing_and_corrupt_blocks(tmp_path: Path) -> None:
    store = BlockStore(tmp_path, durable=False)
    digest = store.put(b"original")
    with pytest.raises(BlockMissing):
        store.get(digest_of(b"never stored"))
    store.path(digest).write_bytes(b"tampered")
    with pytest.raises(BlockCorrupt):
        store.get(digest)
    with pytest.raises(ValueError, match="digest"):
        store.get("../../etc/passwd")


def test_session_payload_round_trip() -> None:
    tables = _tables(1)
    exported = encode_session(tables, {"task_id": "t"})
    session = unpack(pack(exported))
    assert session.manifest == exported.manifest
    decoded = decode_session(session.manifest, session.blocks.__getitem__)
    assert all(frame_differences(tables[n], decoded[n]) == [] for n in tables)


def test_every_damaged_or_truncated_payload_is_refused() -> None:
    payload = pack(encode_session(_tables(2), {"k": 1}))
    rng = random.Random(0)
    for _ in range(300):  # one flipped bit anywhere: header, manifest (its hash) or a block (its digest)
        at = rng.randrange(len(payload))
        flipped = payload[:at] + bytes([payload[at] ^ (1 << rng.randrange(8))]) + payload[at + 1 :]
        with pytest.raises(BundleCorrupt):
            unpack(flipped)
    for cut in (0, 4, 9, len(payload) // 2, len(payload) - 1):
        with pytest.raises(BundleCorrupt):
            unpack(payload[:cut])
    with pytest.raises(BundleCorrupt, match="unexpected bytes"):
        unpack(payload + b"\0")


def test_manifests_are_validated() -> None:
    good = SessionManifest({"t": digest_of(b"x")}, {"a": 1})
    assert SessionManifest.from_json(good.to_json()) == good
    for bad in (b"{", b"[]", good.to_json().replace(b'"version":1', b'"version":3'), b'{"tables": {}}'):
        with pytest.raises(BundleCorrupt):
            SessionManifest.from_json(bad)
    with pytest.raises(BundleCorrupt, match="digest"):
        SessionManifest.from_json(SessionManifest({"t": "../x"}).to_json())


def _sessions(count: int, touched: int) -> dict[str, TableSet]:
    """`count` sessions sharing seed tables; the first `touched` each changed one table."""
    seed = {name: frame for name, frame in _tables(3).items()}
    sets = {}
    for i in range(count):
        tables = TableSet({n: f.copy() for n, f in seed.items()})
        if i < touched:
            tables.set("t0", pd.concat([tables.get("t0"), tables.get("t0").head(1)]))
        sets[f"s{i}"] = tables
    return sets


def test_a_checkpoint_stores_each_distinct_block_once(tmp_path: Path) -> None:
    sessions = _sessions(100, touched=0)
    one = sessions["s0"].export()
    bundle = collect({sid: t.export({"sid": sid}) for sid, t in sessions.items()})
    manifests, blocks = bundle.size()
    assert len(bundle.blocks) == 3
    assert blocks == sum(len(b) for b in one.blocks.values())  # one copy, whatever the number of sessions
    assert manifests / 100 < 400
    records = write_checkpoint(BlockStore(tmp_path, durable=False), {sid: t.export() for sid, t in sessions.items()})
    assert len(list(tmp_path.rglob("*/*"))) == 3
    assert len(records) == 100


def test_changed_tables_add_only_their_own_blocks() -> None:
    bundle = collect({sid: t.export() for sid, t in _sessions(10, touched=4).items()})
    assert len(bundle.blocks) == 4  # 3 seed blocks + the one table the 4 touched sessions changed alike


def test_restore_builds_every_session_with_its_own_tables(tmp_path: Path) -> None:
    store = BlockStore(tmp_path, durable=False)
    sessions = _sessions(5, touched=2)
    records = write_checkpoint(store, {sid: t.export({"sid": sid}) for sid, t in sessions.items()})
    built = restore_sessions(parse_records(records), store.get, lambda sid, exported, tables: (sid, exported, tables))
    assert sorted(built) == sorted(sessions)
    for sid, (_, exported, tables) in built.items():
        assert exported.manifest.meta == {"sid": sid}
        for name in tables:
            assert frame_differences(sessions[sid].get(name), tables[name]) == []
    assert built["s3"][2]["t1"] is not built["s4"][2]["t1"]  # shared block, separate frames


@pytest.mark.parametrize("damage", ["missing", "corrupt", "build"])
def test_one_bad_session_restores_nothing(tmp_path: Path, damage: str) -> None:
    store = BlockStore(tmp_path, durable=False)
    sessions = _sessions(3, touched=1)
    manifests = parse_records(write_checkpoint(store, {sid: t.export() for sid, t in sessions.items()}))
    victim = manifests["s0"].tables["t0"]  # only s0 changed t0, so only s0 uses this block
    built_any: list[str] = []

    def build(sid: str, exported: object, tables: object) -> str:
        if damage == "build" and sid == "s1":
            raise ValueError("rejected by the environment")
        built_any.append(sid)
        return sid

    if damage == "missing":
        store.path(victim).unlink()
    elif damage == "corrupt":
        store.path(victim).write_bytes(b"not the block")
    with pytest.raises(CheckpointInvalid) as caught:
        restore_sessions(manifests, store.get, build)
    assert set(caught.value.problems) == ({"s1"} if damage == "build" else {"s0"})


def test_tableset_reencodes_only_changed_tables() -> None:
    tables = TableSet(_tables(4))
    first = tables.export()
    assert tables.changed() == []
    tables.set("t1", tables.get("t1").copy())  # same content, new version: encoded again, same digest
    assert tables.changed() == ["t1"]
    assert tables.export().manifest == first.manifest
    tables.clear()
    assert list(tables) == []
