"""Restore reads at most what a manifest promises, regular files only, and stops at its deadline.

Probes against a real resources server process under a memory ceiling (`RLIMIT_AS` 2 GiB): a
records file that is a symlink to `/dev/zero` (it used to be read without end until the kernel
killed the server), a manifest that is one, a records file longer than its manifest says, and a
forged 64 GiB (sparse) records file that matches its manifest's size, whose read must stop when
the restore's deadline passes: by the time the server answers DEADLINE_EXCEEDED it no longer has
the file open. After each probe the server is the same process, healthy, its participant status
and the checkpoint files are unchanged, and it still takes the good checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
from pathlib import Path

import grpc
import pytest

from gymrpc import safeio
from gymrpc.pbtime import timestamp
from gymrpc.v1 import participant_service_pb2 as pb
from gymrpc.v1 import participant_service_pb2_grpc as pb_grpc
from tests.control.test_bad_input import E0, E1, committed, restore_request
from tests.security.helpers import (
    CONTROL,
    ServerProcess,
    channel,
    comparable,
    healthy,
    participant_status,
    refused,
    tree,
)

MEMORY_CEILING = 2 << 30
DATA_LOSS = grpc.StatusCode.DATA_LOSS


def records_of(folder: Path) -> Path:
    return next((folder / "resources" / "r").glob("records-*.bin"))


def test_hostile_records_files_are_refused_within_a_memory_ceiling(tmp_path: Path) -> None:
    folder = asyncio.run(committed(tmp_path / "ckpt"))

    def damaged(label: str) -> Path:
        copy = tmp_path / label
        shutil.copytree(folder, copy, symlinks=True)
        return copy

    zero = damaged("zero")
    target = records_of(zero)
    target.unlink()
    target.symlink_to("/dev/zero")
    zero_manifest = damaged("zero-manifest")
    (zero_manifest / "resources" / "r" / "manifest.json").unlink()
    (zero_manifest / "resources" / "r" / "manifest.json").symlink_to("/dev/zero")
    longer = damaged("longer")
    with open(records_of(longer), "ab") as out:
        out.write(b"\0" * 4096)
    fifo = damaged("fifo")
    records_of(fifo).unlink()
    os.mkfifo(fifo / "resources" / "r" / records_of(folder).name)

    server = ServerProcess(
        "gymrpc.servers.resources",
        "resources/r",
        ["--environment", "counter"],
        tmp_path / "run",
        memory_limit=MEMORY_CEILING,
    )

    async def main() -> None:
        async with channel(server.address) as ch:
            stub = pb_grpc.ParticipantServiceStub(ch)
            before, files = comparable(await participant_status(server.address)), tree(tmp_path)
            for copy, says in [
                (zero, "regular file"),
                (zero_manifest, "cannot be read"),
                (longer, "more than the"),
                (fifo, "regular file"),
            ]:
                await refused(
                    stub.Restore(restore_request(copy), timeout=60, metadata=CONTROL), DATA_LOSS, "CORRUPT_SNAPSHOT",
                    says=says,
                )  # fmt: skip
                assert server.alive()
                assert await healthy(server.address)
                assert comparable(await participant_status(server.address)) == before, copy.name
                assert tree(tmp_path) == files, copy.name
            # Nothing was installed: the same process still takes the good checkpoint.
            reply = await stub.Restore(restore_request(folder, "good"), timeout=60, metadata=CONTROL)
            assert {(e.rollout_id, e.attempt) for e in reply.restored} == {tuple(E0.next()), tuple(E1.next())}

    try:
        asyncio.run(main())
    finally:
        server.stop()


def test_a_restore_read_stops_when_its_deadline_passes(tmp_path: Path) -> None:
    folder = asyncio.run(committed(tmp_path / "ckpt"))
    forged = tmp_path / "forged"
    shutil.copytree(folder, forged)
    part = forged / "resources" / "r"
    manifest = json.loads((part / "manifest.json").read_text())
    records_of(forged).unlink()
    digest = "ab" * 32
    huge = part / f"records-{digest}.bin"
    with open(huge, "wb") as out:
        out.truncate(64 << 30)  # sparse: costs no disk, and far more than the ceiling to read whole
    manifest.update(sha256=digest, records_file=huge.name, size_bytes=str(64 << 30))
    (part / "manifest.json").write_text(json.dumps(manifest))

    server = ServerProcess(
        "gymrpc.servers.resources",
        "resources/r",
        ["--environment", "counter"],
        tmp_path / "run",
        memory_limit=MEMORY_CEILING,
    )

    async def main() -> None:
        async with channel(server.address) as ch:
            stub = pb_grpc.ParticipantServiceStub(ch)
            before, files = comparable(await participant_status(server.address)), tree(tmp_path)
            request = restore_request(forged)
            request.deadline.CopyFrom(timestamp(time.time() + 3))
            await refused(
                stub.Restore(request, timeout=60, metadata=CONTROL),
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "DEADLINE_EXCEEDED",
                says="nothing was installed",
            )
            # The answer came after the read had stopped: the file is closed, the server unchanged.
            assert str(huge) not in server.open_files()
            assert server.alive()
            assert await healthy(server.address)
            assert comparable(await participant_status(server.address)) == before
            assert tree(tmp_path) == files
            good = pb.RestoreRequest()
            good.CopyFrom(restore_request(folder, "good"))
            reply = await stub.Restore(good, timeout=60, metadata=CONTROL)
            assert len(reply.restored) == 2

    try:
        asyncio.run(main())
    finally:
        server.stop()


def test_read_regular_refuses_what_is_not_a_bounded_regular_file(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_bytes(b"x" * 10)
    assert safeio.read_regular(plain, limit=10) == b"x" * 10
    link = tmp_path / "link"
    link.symlink_to(plain)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, says in [
        (link, "cannot be opened"),  # O_NOFOLLOW: even a link to a good file
        (fifo, "not a regular file"),  # and the open did not block on the FIFO
        (tmp_path, "not a regular file"),
    ]:
        with pytest.raises(safeio.UnsafeFile, match=says):
            safeio.read_regular(path, limit=1 << 20)
    with pytest.raises(safeio.UnsafeFile, match="more than the 9"):
        safeio.read_regular(plain, limit=9)
    with pytest.raises(safeio.UnsafeFile, match="not the 11"):
        safeio.read_regular(plain, limit=100, size=11)
    with pytest.raises(safeio.UnsafeFile, match="sha256"):
        safeio.read_regular(plain, limit=100, size=10, sha256="0" * 64)
    with pytest.raises(FileNotFoundError):
        safeio.read_regular(tmp_path / "missing", limit=1)
    stop = threading.Event()
    stop.set()
    with pytest.raises(safeio.ReadStopped):
        safeio.read_regular(plain, limit=10, stop=stop)
