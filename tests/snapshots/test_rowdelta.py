"""Row-level table deltas: exact on random tables and edits, refused when they could not be, versioned manifests."""

from __future__ import annotations

import json
import random

import numpy as np
import pandas as pd
import pytest

from gymrpc.snapshots import (
    BlockStore,
    BundleCorrupt,
    SessionManifest,
    TableSet,
    collect,
    decode_delta,
    decode_session,
    delta_base,
    digest_of,
    encode_delta,
    encode_table,
    frame_differences,
    pack,
    parse_records,
    restore_sessions,
    unpack,
    write_checkpoint,
)
from tests.snapshots.frames import random_frame


def _edit(rng: random.Random, frame: pd.DataFrame) -> pd.DataFrame:
    """Change a few cells (to values of the same column), drop a row, append a copy of a row under a new label."""
    out = frame.copy()
    for _ in range(rng.randrange(1, 4)):
        i, j, k = rng.randrange(len(out)), rng.randrange(out.shape[1]), rng.randrange(len(out))
        out.iat[i, j] = out.iat[k, j]
    if len(out) > 3 and rng.random() < 0.5:
        out = out.drop(out.index[rng.randrange(len(out))])
    if rng.random() < 0.5 and out.index.dtype.kind in "iu":
        row = out.iloc[[rng.randrange(len(out))]].copy()
        row.index = pd.Index([int(out.index.max()) + 1], dtype=out.index.dtype, name=out.index.name)
        out = pd.concat([out, row])
    return out


def test_random_edits_round_trip_exactly_or_fall_back() -> None:
    deltas = 0
    for seed in range(300):
        rng = random.Random(seed)
        base = random_frame(rng)
        if len(base) < 4 or not base.index.is_unique or base.shape[1] == 0:
            continue  # a delta needs rows and unique labels
        edited = _edit(rng, base)
        data = encode_delta(base, digest_of(encode_table(base)), edited)
        if data is None:
            continue  # a dtype the edit changed, or too many rows changed: the whole table is stored
        deltas += 1
        assert frame_differences(decode_delta(data, base), edited) == [], seed
    assert deltas >= 20, f"only {deltas} random edits were stored as deltas"


def test_nan_none_dtypes_and_index_are_kept() -> None:
    base = pd.DataFrame(
        {
            "s": pd.Series(["a", None, float("nan"), "d"] * 50, dtype=object),
            "f": np.arange(200, dtype=float),
            "b": [True, False] * 100,
        }
    )
    base.index.name = "row"
    edited = base.copy()
    edited.iat[0, 0] = float("nan")  # None vs NaN must stay what it is
    edited.iat[1, 0] = float("nan")
    edited.iat[3, 1] = float("nan")
    edited = edited.drop(index=7)
    data = encode_delta(base, "0" * 64, edited)
    assert data is not None
    assert delta_base(data) == "0" * 64
    restored = decode_delta(data, base)
    assert frame_differences(restored, edited) == []
    assert restored["s"].iloc[1] != restored["s"].iloc[1], "NaN stays NaN"
    assert restored["s"].iloc[2] != restored["s"].iloc[2]
    assert len(data) < len(encode_table(edited)) / 2


def test_no_delta_for_a_changed_dtype_repeated_labels_or_mostly_new_rows() -> None:
    base = pd.DataFrame({"x": np.arange(10), "y": list("abcdefghij")})
    assert encode_delta(base, "0" * 64, base.astype({"x": float})) is None
    repeated = base.copy()
    repeated.index = [0, 0, *range(2, 10)]
    assert encode_delta(base, "0" * 64, repeated) is None
    rewritten = base.assign(y=list("klmnopqrst"))
    assert encode_delta(base, "0" * 64, rewritten) is None


def _tables() -> TableSet:
    rows = 1000
    frame = pd.DataFrame({"k": [f"customer-{i:05d}-{i * 7919 % 10007}" for i in range(rows)], "n": np.arange(rows)})
    block = encode_table(frame)
    return TableSet({"t": frame, "u": frame.copy()}, {"t": (digest_of(block), block), "u": (digest_of(block), block)})


def test_a_session_pays_for_its_changed_rows_and_old_readers_refuse_it() -> None:
    tables = _tables()
    untouched = tables.export()
    assert json.loads(untouched.manifest.to_json())["version"] == 1, "no delta: old readers still read it"
    frame = tables.get("t").copy()
    frame.iat[5, 0] = "changed"
    tables.set("t", frame)
    exported = tables.export()
    doc = json.loads(exported.manifest.to_json())
    assert doc["version"] == 2
    delta_digest = exported.manifest.tables["t"]
    assert doc["tables"]["t"] == [delta_digest, exported.manifest.tables["u"]]
    changed_rows = len(encode_table(frame.iloc[[5]]))
    assert len(exported.blocks[delta_digest]) < 2 * changed_rows
    payload = pack(exported)
    restored = decode_session(unpack(payload).manifest, unpack(payload).blocks.__getitem__)
    assert frame_differences(restored["t"], frame) == []
    # what a version-1 reader checks first: the format version
    assert (doc["format"], doc["version"]) != ("gymrpc.session-tables", 1)
    doc["version"] = 3
    with pytest.raises(BundleCorrupt, match="v3"):
        SessionManifest.from_json(json.dumps(doc).encode())


def test_checkpoint_of_delta_sessions_stores_the_base_once_and_restores_exactly(tmp_path) -> None:  # type: ignore[no-untyped-def]
    sessions = {}
    for i in range(5):
        tables = _tables()
        frame = tables.get("t").copy()
        frame.iat[i, 0] = f"session {i}"
        tables.set("t", frame)
        sessions[f"s{i}"] = tables
    exports = {sid: t.export() for sid, t in sessions.items()}
    assert len(collect(exports).blocks) == 6, "one shared base block and five small deltas"
    store = BlockStore(tmp_path / "blocks")
    records = write_checkpoint(store, exports)
    restored = restore_sessions(parse_records(records), store.get, lambda sid, exported, frames: frames)
    for sid, tables in sessions.items():
        for name in ("t", "u"):
            assert frame_differences(restored[sid][name], tables.get(name)) == [], (sid, name)
