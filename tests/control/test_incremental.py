"""Incremental commits (issue 18, item 2): a commit writes what changed since the previous published one.

Store level: records whose bytes the base holds are referred to (`CheckpointManifest.segments`),
not written; reading assembles them in order, each file verified; damage or a missing base is
DATA_LOSS. End to end: a restore from an incremental checkpoint gives the same state as from a
full one, and the sweep keeps a folder an incremental checkpoint refers to.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from gymrpc import cli
from gymrpc.control import Kind, gc, store
from gymrpc.control.index import write_index
from gymrpc.errors import DataLoss, InvalidArgument
from gymrpc.v1 import checkpoint_records_pb2 as rec_pb
from tests.control.test_nonstop import EPISODES, WAIT, counter, restored, seeded

NAME = "resources/counter"


def records(n: int, changed: int | None = None) -> list[rec_pb.CheckpointRecord]:
    out = []
    for i in range(n):
        record = rec_pb.CheckpointRecord()
        record.episode_id.rollout_id = f"e{i}"
        record.resources_session.session_id = f"s{i}" + ("-changed" if i == changed else "")
        record.resources_session.replies.add(key="k", output="x" * 1000)
        out.append(record)
    return out


def write(root: Path, checkpoint_id: str, recs: list[rec_pb.CheckpointRecord], base: store.Written | None = None):
    track = store.Written(root / checkpoint_id)
    manifest = store.write_checkpoint(
        root / checkpoint_id, Kind.RESOURCES, NAME, checkpoint_id, recs, store.WriteStop(), "0", base, track
    )
    return manifest, track


def test_unchanged_records_are_referred_to_and_read_back_in_order(tmp_path: Path) -> None:
    full, c1 = write(tmp_path, "c1", records(20))
    assert not full.segments  # nothing to refer to: the old layout, which every reader reads
    changed = records(20, changed=7)
    manifest, c2 = write(tmp_path, "c2", changed, base=c1)
    assert manifest.record_count == 20
    assert manifest.size_bytes * 10 < full.size_bytes  # one record of twenty written
    assert [(s.records_path != "", s.first, s.count) for s in manifest.segments] == [
        (True, 0, 7),
        (False, 0, 1),
        (True, 8, 12),
    ]
    assert manifest.segments[0].records_path == f"c1/resources/counter/{full.records_file}"
    assert store.read_checkpoint(tmp_path / "c2", Kind.RESOURCES, NAME)[1] == changed
    # A chain: the third refers to the files that hold the bytes (c1 and c2), never to a reference.
    third, _ = write(tmp_path, "c3", changed, base=c2)
    assert third.size_bytes == 0
    assert {s.records_path.partition("/")[0] for s in third.segments} == {"c1", "c2"}
    assert store.read_checkpoint(tmp_path / "c3", Kind.RESOURCES, NAME)[1] == changed


def test_a_damaged_or_missing_base_is_data_loss(tmp_path: Path) -> None:
    full, c1 = write(tmp_path, "c1", records(5))
    write(tmp_path, "c2", records(5, changed=0), base=c1)
    base_file = tmp_path / "c1" / "resources" / "counter" / full.records_file
    data = bytearray(base_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    base_file.write_bytes(bytes(data))
    with pytest.raises(DataLoss, match="sha256"):
        store.read_checkpoint(tmp_path / "c2", Kind.RESOURCES, NAME)
    base_file.unlink()
    with pytest.raises(DataLoss, match="is missing"):
        store.read_checkpoint(tmp_path / "c2", Kind.RESOURCES, NAME)
    assert not c1.usable()  # a writer whose base is gone writes everything again


def test_a_segment_outside_the_checkpoint_root_is_data_loss(tmp_path: Path) -> None:
    _, c1 = write(tmp_path, "c1", records(3))
    manifest, _ = write(tmp_path, "c2", records(3, changed=0), base=c1)
    path = tmp_path / "c2" / "resources" / "counter" / "manifest.json"
    for bad in ["../etc/resources/x/records-" + "0" * 64 + ".bin", "c1/notakind/counter/" + manifest.records_file]:
        text = path.read_text().replace(manifest.segments[-1].records_path, bad)
        path.unlink()
        path.write_text(text)
        with pytest.raises(DataLoss, match="not a records file of this checkpoint root"):
            store.read_checkpoint(tmp_path / "c2", Kind.RESOURCES, NAME)
        manifest = store.parse_manifest(path.read_bytes(), path)


def test_an_incremental_checkpoint_restores_the_same_state_and_its_base_is_kept(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"

    async def main() -> None:
        deployment = await seeded()
        try:
            controller = deployment.controller
            first = await controller.checkpoint(
                root, episode_ids=EPISODES, checkpoint_id="c1", timeout=WAIT, incremental=True
            )
            assert not any(m.segments for m in first.manifests.values())  # no base yet: full
            await deployment.increment("resources/r0", EPISODES[0], "call-1")  # only e0 changes
            second = await controller.checkpoint(
                root, episode_ids=EPISODES, checkpoint_id="c2", timeout=WAIT, incremental=True
            )
            full = await controller.checkpoint(root, episode_ids=EPISODES, checkpoint_id="c3", timeout=WAIT)
            # r1's episode did not change: its whole record is referred to, nothing written.
            assert second.manifests["resources/r1"].size_bytes == 0
            assert second.manifests["resources/r1"].segments[0].records_path.startswith("c1/")
            written = sum(m.size_bytes for m in second.manifests.values())
            assert written < sum(m.size_bytes for m in full.manifests.values())
        finally:
            await deployment.close()

        for folder in ("c2", "c3"):  # the same state from the incremental and the full checkpoint
            async with restored(root / folder) as fresh:
                assert await counter(fresh, "resources/r0", EPISODES[0].next()) == 2
                assert await counter(fresh, "resources/r1", EPISODES[1].next()) == 1

    asyncio.run(main())
    # c1 loses its index (as if its publish had failed): the sweep still keeps it, c2 refers to it.
    (root / "c1" / "checkpoint.json").unlink()
    for path, _dirs, files in os.walk(root / "c1"):
        for name in files:
            os.utime(os.path.join(path, name), (1, 1))
    verdicts = gc.sweep(root)
    assert [(v.path.name, v.removed) for v in verdicts] == [("c1", False)]
    assert "c2 refers to its records" in verdicts[0].reason


def test_newest_published_is_the_newest_index(tmp_path: Path) -> None:
    assert gc.newest_published(tmp_path) is None
    for checkpoint_id in ("b", "a"):
        manifest, _ = write(tmp_path, checkpoint_id, records(1))
        write_index(tmp_path / checkpoint_id, checkpoint_id, [manifest])
    write(tmp_path, "z", records(1))  # unpublished
    assert gc.newest_published(tmp_path) == tmp_path / "a"


def test_keep_removes_old_published_checkpoints_but_never_one_still_referred_to(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def publish(checkpoint_id: str, changed: int, base: store.Written | None) -> store.Written:
        manifest, track = write(tmp_path, checkpoint_id, records(5, changed=changed), base)
        write_index(tmp_path / checkpoint_id, checkpoint_id, [manifest])
        return track

    c1 = publish("c1", 0, None)  # full
    c2 = publish("c2", 1, c1)  # refers to c1
    publish("c3", 2, None)  # full
    publish("c4", 3, c2)  # refers to c2 and, through it, to the files of c1 it holds
    assert gc.referenced(tmp_path) == {"c1": {"c2", "c4"}, "c2": {"c4"}}
    assert [(v.path.name, v.removed) for v in gc.sweep(tmp_path, keep=1, dry_run=True)] == [
        ("c1", False),
        ("c2", False),
        ("c3", True),
    ]
    code = cli.main(["--run-dir", str(tmp_path / "no-stack"), "ctl", "gc", str(tmp_path), "--keep", "1"])
    assert code == 0
    assert f"removed {tmp_path / 'c3'}: published, older than the checkpoints kept" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["c1", "c2", "c4"]
    assert store.read_checkpoint(tmp_path / "c4", Kind.RESOURCES, NAME)[1] == records(5, changed=3)
    (tmp_path / "c4" / "checkpoint.json").unlink()  # c4 no longer published: c3 was the newest kept
    shutil.rmtree(tmp_path / "c4")
    assert [(v.path.name, v.removed) for v in gc.sweep(tmp_path, keep=1)] == [("c1", False)]  # c2 refers to c1
    assert sorted(os.listdir(tmp_path)) == ["c1", "c2"]
    with pytest.raises(InvalidArgument):
        gc.sweep(tmp_path, keep=0)
