"""Records file, then manifest: last, create-only, verified in full before anything is returned."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gymrpc.control import store
from gymrpc.control.types import EpisodeKey, Kind
from gymrpc.errors import Aborted, DataLoss, InvalidArgument, NotFound
from gymrpc.v1 import checkpoint_records_pb2 as rec_pb
from gymrpc.v1 import common_pb2

NAME = "resources/counter"


def records(*counts: int) -> list[rec_pb.CheckpointRecord]:
    return [
        rec_pb.CheckpointRecord(
            episode_id=EpisodeKey(f"r{i}", 0).to_pb(),
            resources_session=rec_pb.ResourcesSessionRecord(
                session_id=f"r{i}-a0", snapshot=common_pb2.SessionSnapshot(payload=str(count).encode())
            ),
        )
        for i, count in enumerate(counts)
    ]


def write(root: Path, checkpoint_id: str = "c1", recs: list | None = None) -> store.pb.CheckpointManifest:
    return store.write_checkpoint(
        root, Kind.RESOURCES, NAME, checkpoint_id, records(1, 2) if recs is None else recs, store.WriteStop()
    )


def folder(root: Path) -> Path:
    return root / "resources" / "counter"


def test_round_trip_and_layout(tmp_path: Path) -> None:
    manifest = write(tmp_path)
    assert manifest.record_count == 2
    assert manifest.records_file == f"records-{manifest.sha256}.bin"
    files = sorted(p.name for p in folder(tmp_path).iterdir())
    assert files == ["manifest.json", manifest.records_file]  # no temporaries left behind
    read, got = store.read_checkpoint(tmp_path, Kind.RESOURCES, NAME)
    assert store.manifests_equal(read, manifest)
    assert got == records(1, 2)
    assert [EpisodeKey.of(e) for e in read.episode_ids] == [EpisodeKey("r0", 0), EpisodeKey("r1", 0)]


def test_the_manifest_lists_each_episode_once_in_first_record_order(tmp_path: Path) -> None:
    """Several records under one episode (a session, then the table blocks it names first)."""
    blocks = [
        rec_pb.CheckpointRecord(
            episode_id=EpisodeKey(rollout, 0).to_pb(), table_block=rec_pb.TableBlock(sha256=f"{i}" * 64, data=b"x")
        )
        for i, rollout in enumerate(["r1", "r0", "r1"])
    ]
    recs = [*records(1, 2)[::-1], *blocks]  # r1's session first, then blocks of r1, r0, r1
    manifest = write(tmp_path, recs=recs)
    assert manifest.record_count == 5
    assert [EpisodeKey.of(e) for e in manifest.episode_ids] == [EpisodeKey("r1", 0), EpisodeKey("r0", 0)]
    read, got = store.read_checkpoint(tmp_path, Kind.RESOURCES, NAME)  # the reader checks the records, not the list
    assert store.manifests_equal(read, manifest)
    assert got == recs
    assert store.manifests_equal(write(tmp_path, recs=recs), manifest)  # a retried commit replays it


def test_manifest_is_create_only(tmp_path: Path) -> None:
    first = write(tmp_path)
    again = write(tmp_path)  # the same commit retried: the existing manifest is the reply
    assert again.create_time == first.create_time
    before = (folder(tmp_path) / "manifest.json").read_bytes()
    with pytest.raises(Aborted) as caught:
        write(tmp_path, recs=records(1, 3))
    assert caught.value.reason == "CHECKPOINT_CONFLICT"
    with pytest.raises(Aborted, match="already holds a different commit"):
        write(tmp_path, checkpoint_id="c2")
    assert (folder(tmp_path) / "manifest.json").read_bytes() == before
    assert store.read_checkpoint(tmp_path, Kind.RESOURCES, NAME)[1] == records(1, 2)


def test_no_manifest_means_no_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(*args: object) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(store, "_create_manifest", crash)
    with pytest.raises(OSError, match="disk gone"):
        write(tmp_path)
    assert not (folder(tmp_path) / "manifest.json").exists()
    with pytest.raises(NotFound, match="not a committed checkpoint"):
        store.read_checkpoint(tmp_path, Kind.RESOURCES, NAME)


def test_a_stopped_write_publishes_nothing(tmp_path: Path) -> None:
    stop = store.WriteStop()
    stop.stop()
    with pytest.raises(store.WriteStopped):
        store.write_checkpoint(tmp_path, Kind.RESOURCES, NAME, "c1", records(1), stop)
    assert not folder(tmp_path).exists()  # stopped before it began: not even its folder (it may be being deleted)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "extra"])
def test_damaged_records_are_data_loss(tmp_path: Path, damage: str) -> None:
    manifest = write(tmp_path)
    path = folder(tmp_path) / manifest.records_file
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[:-3]))
    elif damage == "delete":
        path.unlink()
    else:
        path.write_bytes(bytes(data) + b"\x00")
    with pytest.raises(DataLoss):
        store.read_checkpoint(tmp_path, Kind.RESOURCES, NAME)


def test_manifest_count_must_match_the_file(tmp_path: Path) -> None:
    write(tmp_path)
    path = folder(tmp_path) / "manifest.json"
    data = json.loads(path.read_text())
    data["record_count"] = "3"
    path.write_text(json.dumps(data))
    with pytest.raises(DataLoss, match="holds 2 records"):
        store.read_checkpoint(tmp_path, Kind.RESOURCES, NAME)


@pytest.mark.parametrize("text", ["not json", '{"unknown_field": 1}', '{"schema_version": 9}'])
def test_foreign_manifests_are_refused(tmp_path: Path, text: str) -> None:
    write(tmp_path)
    (folder(tmp_path) / "manifest.json").write_text(text)
    with pytest.raises(DataLoss):
        store.read_checkpoint(tmp_path, Kind.RESOURCES, NAME)


def test_a_manifest_of_another_kind_is_refused(tmp_path: Path) -> None:
    store.write_checkpoint(tmp_path, Kind.MODEL, "model/counter", "c1", records(1), store.WriteStop())
    shutil.copytree(tmp_path / "model" / "counter", folder(tmp_path))
    with pytest.raises(DataLoss, match="belongs to PARTICIPANT_KIND_MODEL"):
        store.read_checkpoint(tmp_path, Kind.RESOURCES, NAME)


@pytest.mark.parametrize("value", ["", "relative/dir", "/a/../b", "/a//b", "/a/\x00b"])
def test_checkpoint_dirs_are_validated(value: str) -> None:
    with pytest.raises(InvalidArgument):
        store.check_checkpoint_dir(value)
    assert store.check_checkpoint_dir("/tmp/ckpt/") == Path("/tmp/ckpt")
