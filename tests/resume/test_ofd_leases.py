"""The log store's leases as OFD byte-range locks: exclusion across stores and processes, SIGKILL, the format marker."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import hashlib
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from gymrpc.errors import Aborted, FailedPrecondition
from gymrpc.launch.storage import CheckpointDirError, check_checkpoint_dir
from gymrpc.store import FilesystemEpisodeStore, LogEpisodeStore, ranges

ROOT = Path(__file__).resolve().parents[2]


def test_two_stores_on_one_folder_exclude_each_other_per_episode_only(tmp_path: Path) -> None:
    async def scenario() -> None:
        first, second = LogEpisodeStore(tmp_path, lease_retry_delay=0.25), LogEpisodeStore(tmp_path)
        held = await first.acquire("ep")
        for store in (first, second):  # the holder's own store too: one description, excluded by its set
            with pytest.raises(Aborted) as caught:
                await store.acquire("ep")
            assert caught.value.reason == "LEASE_HELD"
        assert (await _refused(first, "ep")).retry_delay == 0.25
        others = [await (first, second)[i % 2].acquire(f"other-{i}") for i in range(200)]
        assert all(lease.held for lease in others), "different episodes never block each other"
        await held.release()
        await held.release()  # idempotent
        taken = await second.acquire("ep")  # release frees it at once
        with pytest.raises(Aborted):
            await first.acquire("ep")
        await taken.release()
        for lease in others:
            await lease.release()
        again = [await second.acquire(f"other-{i}") for i in range(200)]
        for lease in again:
            await lease.release()
        await first.close()
        await second.close()

    async def _refused(store: LogEpisodeStore, rollout_id: str) -> Aborted:
        with pytest.raises(Aborted) as caught:
            await store.acquire(rollout_id)
        return caught.value

    asyncio.run(scenario())


def test_a_closed_store_drops_its_leases(tmp_path: Path) -> None:
    async def scenario() -> None:
        first, second = LogEpisodeStore(tmp_path), LogEpisodeStore(tmp_path)
        await first.acquire("ep")  # never released: closing the store drops it
        await first.close()
        lease = await second.acquire("ep")
        await lease.release()
        await second.close()

    asyncio.run(scenario())


_HOLDER = textwrap.dedent(
    """
    import asyncio, sys
    from gymrpc.errors import Aborted
    from gymrpc.store import LogEpisodeStore

    async def main():
        store = LogEpisodeStore(sys.argv[1])
        try:
            await store.acquire("parent-holds")
            print("took parent-holds", flush=True)
        except Aborted as exc:
            print("refused", exc.reason, flush=True)
        await store.acquire("child-holds")
        print("holding", flush=True)
        sys.stdin.readline()  # until killed

    asyncio.run(main())
    """
)


def test_another_process_is_excluded_and_a_sigkilled_holder_frees_its_leases_at_once(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = LogEpisodeStore(tmp_path)
        mine = await store.acquire("parent-holds")
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _HOLDER,
            str(tmp_path),
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            assert proc.stdout is not None
            assert (await proc.stdout.readline()).split() == [b"refused", b"LEASE_HELD"]
            assert (await proc.stdout.readline()).strip() == b"holding"
            with pytest.raises(Aborted) as caught:
                await store.acquire("child-holds")
            assert caught.value.reason == "LEASE_HELD"
            proc.send_signal(signal.SIGKILL)
            assert await proc.wait() == -signal.SIGKILL
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        freed = await store.acquire("child-holds")  # the kernel dropped the dead holder's lock
        await freed.release()
        await mine.release()
        await store.close()

    asyncio.run(scenario())


def test_the_leases_spread_over_64_files_and_2_to_the_62_bytes(tmp_path: Path) -> None:
    slots = {ranges.slot(hashlib.sha256(f"ep-{i}".encode()).hexdigest()) for i in range(10_000)}
    assert len(slots) == 10_000
    assert {s % ranges.FILES for s in slots} == set(range(ranges.FILES))
    assert max(s >> 2 for s in slots) < ranges.SPAN
    locks = ranges.RangeLocks(tmp_path / "leases")
    assert len(list((tmp_path / "leases").iterdir())) == ranges.FILES  # created once, never per episode
    locks.close()


# -- the folder's format --------------------------------------------------------------------------


def _format_1_agent_starting(root: Path) -> None:
    """What a format-1 `LogEpisodeStore` does first: open the first listed log's owner lock."""
    for name in sorted(os.listdir(root / "logs")):
        try:
            fd = os.open(root / "logs" / name / "owner.lock", os.O_RDWR | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            continue
        os.close(fd)
        return


def test_a_format_1_agent_cannot_start_on_a_format_2_folder(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = LogEpisodeStore(tmp_path)
        lease = await store.acquire("ep")
        await lease.release()
        await store.close()

    asyncio.run(scenario())
    with pytest.raises(IsADirectoryError, match="format-2-ofd-leases-agents-of-format-1-cannot-use-this-folder"):
        _format_1_agent_starting(tmp_path)


def test_a_format_2_store_refuses_a_folder_a_format_1_agent_is_alive_on(tmp_path: Path) -> None:
    old = tmp_path / "logs" / "host-1-abcd"
    old.mkdir(parents=True)
    fd = os.open(old / "owner.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a format-1 owner: flock only
    with pytest.raises(FailedPrecondition, match="an agent of an older version"):
        LogEpisodeStore(tmp_path)
    os.close(fd)  # it stopped: its log is adopted

    async def scenario() -> None:
        store = LogEpisodeStore(tmp_path)
        assert store.folder == old
        second = LogEpisodeStore(tmp_path)  # a live format-2 owner is no reason to refuse
        assert second.folder != old
        await second.close()
        await store.close()

    asyncio.run(scenario())


def test_the_files_store_refuses_a_log_store_folder(tmp_path: Path) -> None:
    async def scenario() -> None:
        old = FilesystemEpisodeStore(tmp_path)  # a files-store folder may become a log-store folder
        await old.close()
        store = LogEpisodeStore(tmp_path)
        await store.close()

    asyncio.run(scenario())
    with pytest.raises(FailedPrecondition, match="is the folder of a log store"):
        FilesystemEpisodeStore(tmp_path)


# -- the start-up storage check --------------------------------------------------------------------


def test_the_storage_check_proves_ofd_locks_or_refuses_with_the_way_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert check_checkpoint_dir(tmp_path / "ok")
    assert sorted(p.name for p in (tmp_path / "ok").iterdir()) == []  # the probes are gone

    def unsupported(folder: Path) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(ranges, "check", unsupported)
    with pytest.raises(CheckpointDirError, match=r"OFD locks .*Invalid argument.*--resume-store files"):
        check_checkpoint_dir(tmp_path / "no-ofd")
    assert check_checkpoint_dir(tmp_path / "no-ofd", ofd=False)  # the files store needs only flock
