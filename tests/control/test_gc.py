"""Unpublished checkpoint folders are removed (issue 18, item 2), with real files.

A publish that fails leaves no folder behind once every member confirmed its write ended, even a
write still held when the controller gives up (writes wait on events, never on sleeps). The
sweep (`gc.sweep`, `gymrpc ctl gc`) removes only index-less checkpoint folders older than the
newest published one, and refuses paths that are not a checkpoint root.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gymrpc import cli
from gymrpc.control import Kind, gc, store
from gymrpc.control.index import INDEX, write_index
from gymrpc.controller import CoordinationError
from gymrpc.errors import FailedPrecondition, InvalidArgument, NotFound
from gymrpc.pbtime import timestamp
from gymrpc.v1 import checkpoint_records_pb2 as rec_pb
from gymrpc.v1 import participant_service_pb2 as pb
from tests.control.test_nonstop import EPISODES, NAMES, WAIT, Gate, counter, restored, seeded


def failing(monkeypatch: pytest.MonkeyPatch, name: str, errno_: int = 13) -> None:
    """Every records write of `name` fails (EACCES by default: a retry will not help)."""
    real = store.write_checkpoint

    def write(root: Path, kind: Kind, member: str, *args: Any) -> Any:
        if member == name:
            raise PermissionError(errno_, "Permission denied (injected)", str(root))
        return real(root, kind, member, *args)

    monkeypatch.setattr(store, "write_checkpoint", write)


@pytest.mark.parametrize("nonstop", [True, False])
def test_a_failed_publish_leaves_no_folder_and_the_next_checkpoint_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nonstop: bool
) -> None:
    failing(monkeypatch, "resources/r1")

    async def main() -> None:
        deployment = await seeded()
        try:
            with pytest.raises(CoordinationError) as caught:
                await deployment.controller.checkpoint(
                    tmp_path, episode_ids=EPISODES, checkpoint_id="c1", timeout=WAIT, nonstop=nonstop
                )
            assert caught.value.operation == ("persist" if nonstop else "commit")
            assert not (tmp_path / "c1").exists()  # the other members' manifests went with it
            assert os.listdir(tmp_path) == []
            monkeypatch.undo()
            result = await deployment.controller.checkpoint(
                tmp_path, episode_ids=EPISODES, checkpoint_id="c2", timeout=WAIT, nonstop=nonstop
            )
            assert result.committed
            assert not (tmp_path / "c2" / gc.LEASE).exists()  # the lease ends with the publish
        finally:
            await deployment.close()

        async with restored(tmp_path / "c2") as fresh:
            assert await counter(fresh, "resources/r0", EPISODES[0].next()) == 1

    asyncio.run(main())


def test_discard_stops_a_write_still_running_before_removing_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch, held={"resources/r1"})
    stopped = threading.Event()
    real_stop = store.WriteStop.stop

    def stop(self: store.WriteStop) -> None:
        real_stop(self)
        stopped.set()

    monkeypatch.setattr(store.WriteStop, "stop", stop)

    async def main() -> None:
        deployment = await seeded()
        controller = deployment.controller
        folder = tmp_path / "c1"
        try:
            assert (await controller.prepare("c1", timeout=WAIT)).prepared
            await controller.capture("c1", folder, EPISODES, timeout=WAIT)
            await controller.resume("c1")
            # Start every write (a persist does), and let all but r1's finish.
            held = deployment.client.participant("resources/r1")
            persisting = asyncio.ensure_future(held.Persist(gc_request("c1"), timeout=WAIT))
            for name in [n for n in NAMES if n != "resources/r1"]:
                await deployment.client.participant(name).Persist(gc_request("c1"), timeout=WAIT)
            await gate.wait(gate.entered, ["resources/r1"])  # r1's write has begun and is held
            assert (folder / "resources" / "r0" / "manifest.json").exists()
            discarding = asyncio.ensure_future(controller.discard("c1", folder, timeout=WAIT))
            assert await asyncio.to_thread(stopped.wait, WAIT)  # r1's write is told to stop ...
            assert not discarding.done()  # ... and the discard waits for it to end
            assert folder.exists()
            gate.release.set()
            assert await asyncio.wait_for(discarding, WAIT) is True
            assert gate.written["resources/r1"].is_set()
            assert not folder.exists()  # and the stopped write created nothing after the removal
            with pytest.raises(FailedPrecondition) as caught:  # the persist waiting for it learns so
                await persisting
            assert caught.value.reason == "STALE_CHECKPOINT"
            with pytest.raises(FailedPrecondition) as caught:  # and it is never written again
                await held.Persist(gc_request("c1"), timeout=WAIT)
            assert caught.value.reason == "STALE_CHECKPOINT"
            assert not folder.exists()
            statuses = await deployment.statuses()
            assert all("persisting" not in s.details for s in statuses.values()), statuses
        finally:
            await deployment.close()

    asyncio.run(main())


def gc_request(checkpoint_id: str) -> pb.PersistRequest:
    return pb.PersistRequest(checkpoint_id=checkpoint_id, deadline=timestamp(time.time() + WAIT))


# -- the sweep -------------------------------------------------------------------------------------


def member_write(folder: Path, checkpoint_id: str, name: str = "resources/counter") -> store.pb.CheckpointManifest:
    record = rec_pb.CheckpointRecord()
    record.episode_id.rollout_id = "e0"
    return store.write_checkpoint(folder, Kind.RESOURCES, name, checkpoint_id, [record], store.WriteStop())


def published(folder: Path, checkpoint_id: str) -> float:
    """A published checkpoint: one member's manifest and the index; returns the index's time."""
    index = write_index(folder, checkpoint_id, [member_write(folder, checkpoint_id)])
    return index.create_time.ToNanoseconds() / 1e9


def age(folder: Path, when: float) -> None:
    """Set the modification time of the folder and everything in it (no sleeping to make them old)."""
    for path, dirs, files in os.walk(folder):
        for name in (*dirs, *files):
            os.utime(os.path.join(path, name), (when, when))
    os.utime(folder, (when, when))


def test_the_sweep_removes_only_unpublished_folders_older_than_the_newest_published(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpts"
    published(root / "c1", "c1")  # an older published checkpoint is never touched
    c2 = published(root / "c2", "c2")
    age(root / "c1", c2 - 200)
    member_write(root / "failed-a", "failed-a")  # index-less, older: garbage
    age(root / "failed-a", c2 - 100)
    member_write(root / "failed-b", "failed-b")
    (root / "failed-b" / "resources" / "counter" / "manifest.json").unlink()  # a half write: records only
    age(root / "failed-b", c2 - 100)
    member_write(root / "leased", "leased")  # older, but its publish lease still runs
    gc.write_lease(root / "leased", "leased", c2 + 3600)
    age(root / "leased", c2 - 100)
    member_write(root / "newer", "newer")  # as new as c2: may still be written
    age(root / "newer", c2 + 1)
    (root / "notes").mkdir()  # not a checkpoint folder: left alone
    (root / "notes" / "todo.txt").write_text("mine\n")
    age(root / "notes", c2 - 100)
    (root / "link").symlink_to(root / "failed-a", target_is_directory=True)

    assert [(v.path.name, v.removed) for v in gc.sweep(root, dry_run=True)] == [
        ("failed-a", True),
        ("failed-b", True),
        ("leased", False),
        ("newer", False),
    ]
    assert (root / "failed-a").exists()  # a dry run removes nothing

    code = cli.main(["--run-dir", str(tmp_path / "no-stack"), "ctl", "gc", str(root)])
    out = capsys.readouterr().out
    assert code == 0
    assert out.splitlines()[:2] == [
        f"removed {root / 'failed-a'}: unpublished, older than the newest published checkpoint",
        f"removed {root / 'failed-b'}: unpublished, older than the newest published checkpoint",
    ]
    assert "kept" in out.splitlines()[2]
    assert "lease" in out.splitlines()[2]
    assert sorted(os.listdir(root)) == ["c1", "c2", "leased", "link", "newer", "notes"]
    assert (root / "c1" / INDEX).exists()
    assert (root / "notes" / "todo.txt").exists()


def test_the_sweep_removes_nothing_without_a_published_checkpoint(tmp_path: Path) -> None:
    member_write(tmp_path / "failed", "failed")
    age(tmp_path / "failed", 1_000_000)
    assert [(v.path.name, v.removed) for v in gc.sweep(tmp_path)] == [("failed", False)]
    assert (tmp_path / "failed").exists()


def test_bad_roots_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    published(tmp_path / "c1", "c1")
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path, target_is_directory=True)
    for root, error in [
        ("relative/path", InvalidArgument),
        (f"{tmp_path}/../x", InvalidArgument),
        ("/", InvalidArgument),
        (str(tmp_path / "missing"), NotFound),
        (str(tmp_path / "file"), InvalidArgument),
        (str(tmp_path / "link"), InvalidArgument),
        (str(tmp_path / "c1"), InvalidArgument),  # a checkpoint folder, not its root
        (str(tmp_path / "c1" / "resources"), InvalidArgument),
    ]:
        with pytest.raises(error):
            gc.sweep(root)
    code = cli.main(["--run-dir", str(tmp_path / "no-stack"), "ctl", "gc", str(tmp_path / "c1")])
    assert code == 1
    assert "is a checkpoint folder, not a checkpoint root" in capsys.readouterr().err
    assert (tmp_path / "c1" / INDEX).exists()


def test_remove_unpublished_never_removes_a_published_or_foreign_folder(tmp_path: Path) -> None:
    published(tmp_path / "c1", "c1")
    with pytest.raises(FailedPrecondition):
        gc.remove_unpublished(tmp_path / "c1", "c1")
    member_write(tmp_path / "c2", "other")  # a manifest of another checkpoint
    with pytest.raises(FailedPrecondition):
        gc.remove_unpublished(tmp_path / "c2", "c2")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "data.txt").write_text("x")
    with pytest.raises(FailedPrecondition):
        gc.remove_unpublished(tmp_path / "mine", "mine")
    assert gc.remove_unpublished(tmp_path / "absent", "absent") is False
    member_write(tmp_path / "c3", "c3")
    assert gc.remove_unpublished(tmp_path / "c3", "c3") is True
    assert sorted(os.listdir(tmp_path)) == ["c1", "c2", "mine"]
