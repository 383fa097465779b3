"""`gymrpc.store`: atomic durable records, the revision guard, leases, corruption, expiry, id validation."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gymrpc.errors import Aborted, DataLoss, FailedPrecondition, InvalidArgument
from gymrpc.store import SCHEMA_VERSION, EpisodeCheckpoint, FilesystemEpisodeStore, codec
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2
from tests.resume.helpers import files, record_path

ROOT = Path(__file__).resolve().parents[2]


def _record(rollout_id: str = "ep", step: int = 0, **fields: object) -> EpisodeCheckpoint:
    fields.setdefault("phase", agent_pb.EPISODE_PHASE_READY_FOR_MODEL)
    return EpisodeCheckpoint(
        schema_version=SCHEMA_VERSION,
        episode_id=common_pb2.EpisodeId(rollout_id=rollout_id),
        step=step,
        messages=[common_pb2.Message(role=common_pb2.ROLE_USER, content=f"step {step}")],
        **fields,  # type: ignore[arg-type]
    )


async def _save(store: FilesystemEpisodeStore, record: EpisodeCheckpoint) -> None:
    async with store.lease(record.episode_id.rollout_id) as lease:
        await store.save(lease, record)


async def _load(store: FilesystemEpisodeStore, rollout_id: str = "ep") -> EpisodeCheckpoint | None:
    async with store.lease(rollout_id) as lease:
        return await store.load(lease)


def test_save_and_load_round_trip_with_revisions_and_hashed_paths(tmp_path: Path) -> None:
    async def scenario() -> tuple[EpisodeCheckpoint | None, EpisodeCheckpoint]:
        store = FilesystemEpisodeStore(tmp_path)
        record = _record()
        await _save(store, record)
        record.step = 1
        await _save(store, record)
        loaded = await _load(store)
        await store.close()
        return loaded, record

    loaded, saved = asyncio.run(scenario())
    assert loaded == saved
    assert loaded.revision == 2
    assert loaded.updated_at.seconds > 0
    path = record_path(tmp_path, "ep")
    assert path.exists()
    assert "ep" not in path.name
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_revision_guard_refuses_a_stale_save_and_leaves_the_record(tmp_path: Path) -> None:
    async def scenario() -> tuple[Aborted, EpisodeCheckpoint]:
        store = FilesystemEpisodeStore(tmp_path)
        current = _record()
        await _save(store, current)
        await _save(store, current)  # revision 2 on disk
        stale = _record(step=9, revision=1)
        before = files(tmp_path)
        with pytest.raises(Aborted) as caught:
            await _save(store, stale)
        assert files(tmp_path) == before
        assert stale.revision == 1, "a failed save leaves the record as it was"
        fresh = _record(rollout_id="other", revision=3)  # nothing stored: only revision 0 may be saved
        with pytest.raises(Aborted):
            await _save(store, fresh)
        await store.close()
        return caught.value, current

    err, _current = asyncio.run(scenario())
    assert err.reason == "CHECKPOINT_CONFLICT"
    assert err.retry_delay is None
    assert err.metadata["stored_revision"] == "2"
    assert not record_path(tmp_path, "other").exists()


CRASH_BETWEEN_TEMP_AND_RENAME = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from gymrpc.store import FilesystemEpisodeStore
    from tests.resume.test_store import _record, _save

    async def main():
        store = FilesystemEpisodeStore(sys.argv[1])
        await _save(store, _record(step=1))
        os.replace = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # die right before the rename
        await _save(store, _record(step=2, revision=1))

    asyncio.run(main())
    """
)


def test_a_crash_between_temp_write_and_rename_keeps_the_old_record(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CRASH_BETWEEN_TEMP_AND_RENAME, str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    path = record_path(tmp_path, "ep")
    temp = path.with_name(f".{path.name}.tmp")
    assert temp.exists(), "the new bytes were written to the temp file"

    async def scenario() -> EpisodeCheckpoint | None:
        store = FilesystemEpisodeStore(tmp_path)
        loaded = await _load(store)
        await store.close()
        return loaded

    loaded = asyncio.run(scenario())
    assert loaded is not None
    assert (loaded.step, loaded.revision) == (1, 1)
    assert not temp.exists(), "taking the lease removes a dead writer's temp file"


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda b: b[: len(b) // 2], id="truncated"),
        pytest.param(lambda b: b[:-3] + bytes([b[-3] ^ 1]) + b[-2:], id="bit-flip"),
        pytest.param(lambda b: b"", id="empty"),
        pytest.param(lambda b: b"{not a record}" * 10, id="garbage"),
        pytest.param(lambda b: b[:8] + b"\x09\x00" + b[10:], id="header-version"),
        pytest.param(lambda b: b + b"\x00", id="trailing-bytes"),
    ],
)
def test_corrupt_records_are_data_loss_and_stay_untouched(tmp_path: Path, damage: object) -> None:
    async def scenario() -> DataLoss:
        store = FilesystemEpisodeStore(tmp_path)
        await _save(store, _record())
        path = record_path(tmp_path, "ep")
        path.write_bytes(damage(path.read_bytes()))  # type: ignore[operator]
        before = files(tmp_path)
        with pytest.raises(DataLoss) as caught:
            await _load(store)
        if len(path.read_bytes()) < codec.HEADER_SIZE or b"GYMRPCEC\x01" not in path.read_bytes():
            with pytest.raises(DataLoss):  # the revision guard cannot read the header: nothing is overwritten
                await _save(store, _record(revision=1))
        assert files(tmp_path) == before
        await store.close()
        return caught.value

    err = asyncio.run(scenario())
    assert "is corrupt" in err.message
    assert err.code.name == "DATA_LOSS"


def test_a_record_of_another_episode_at_its_path_is_data_loss(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = FilesystemEpisodeStore(tmp_path)
        await _save(store, _record("a"))
        record_path(tmp_path, "b").write_bytes(record_path(tmp_path, "a").read_bytes())
        with pytest.raises(DataLoss, match="belongs to episode 'a'"):
            await _load(store, "b")
        await store.close()

    asyncio.run(scenario())


def test_ttl_expiry_of_completed_records(tmp_path: Path) -> None:
    def completed(rollout_id: str, expires_in: float) -> EpisodeCheckpoint:
        record = _record(rollout_id, phase=agent_pb.EPISODE_PHASE_COMPLETED)
        record.expires_at.FromNanoseconds(time.time_ns() + int(expires_in * 1e9))
        return record

    async def scenario() -> None:
        store = FilesystemEpisodeStore(tmp_path)
        for record in (completed("old", -1), completed("young", 3600), _record("running"), completed("held", -1)):
            await _save(store, record)
        await _save(store, completed("loaded", -1))
        assert await _load(store, "loaded") is None, "an expired record reads as absent"
        assert not record_path(tmp_path, "loaded").exists()
        async with store.lease("orphan"):
            pass  # a lock file without a record
        async with store.lease("held"):
            assert await store.delete_expired() == 1  # "old"; "held" is leased right now
        assert [r for r in ("old", "young", "running", "held") if record_path(tmp_path, r).exists()] == [
            "young",
            "running",
            "held",
        ]
        assert not record_path(tmp_path, "orphan").with_suffix(".lock").exists()
        assert await store.delete_expired() == 1  # "held", now free
        await store.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("bad", ["../escape", "..", ".", "/etc/passwd", "a/b", "", "x" * 129, "-lead", "sp ace", "é"])
def test_invalid_ids_are_refused_before_touching_the_filesystem(tmp_path: Path, bad: str) -> None:
    root = tmp_path / "store"

    async def scenario() -> None:
        store = FilesystemEpisodeStore(root)
        with pytest.raises(InvalidArgument):
            await store.acquire(bad)
        await store.close()

    FilesystemEpisodeStore(root).committer.close()
    before = sorted(tmp_path.rglob("*"))
    asyncio.run(scenario())
    assert sorted(tmp_path.rglob("*")) == before


def test_lease_is_exclusive_in_process_across_processes_and_dies_with_its_holder(tmp_path: Path) -> None:
    holder = textwrap.dedent(
        """
        import asyncio, sys, time
        from gymrpc.store import FilesystemEpisodeStore

        async def main():
            store = FilesystemEpisodeStore(sys.argv[1])
            await store.acquire("ep")
            print("held", flush=True)
            time.sleep(600)

        asyncio.run(main())
        """
    )

    store = FilesystemEpisodeStore(tmp_path, lease_retry_delay=0.5)

    async def in_process() -> None:
        async with store.lease("ep"):
            with pytest.raises(Aborted) as caught:
                await store.acquire("ep")
            assert (caught.value.reason, caught.value.retry_delay) == ("LEASE_HELD", 0.5)

    async def refused() -> None:
        with pytest.raises(Aborted, match="lease is held"):
            await store.acquire("ep")

    async def free_again() -> None:
        lease = await store.acquire("ep")  # the kernel dropped the dead holder's lock
        await lease.release()
        await lease.release()  # idempotent
        with pytest.raises(FailedPrecondition):
            await store.load(lease)
        await store.close()

    asyncio.run(in_process())
    proc = subprocess.Popen(
        [sys.executable, "-c", holder, str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"held"
        asyncio.run(refused())
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        asyncio.run(free_again())
    finally:
        proc.kill()
        proc.wait()


def test_concurrent_saves_share_fsyncs_and_all_are_durable(tmp_path: Path) -> None:
    async def scenario() -> tuple[list[EpisodeCheckpoint | None], FilesystemEpisodeStore]:
        store = FilesystemEpisodeStore(tmp_path)
        records = [_record(f"ep-{i}", step=i) for i in range(300)]
        await asyncio.gather(*(_save(store, r) for r in records))
        loaded = await asyncio.gather(*(_load(store, f"ep-{i}") for i in range(300)))
        await store.close()
        return loaded, store

    loaded, store = asyncio.run(scenario())
    assert [r.step for r in loaded if r is not None] == list(range(300))
    stats = store.committer.stats
    assert stats.writes == 300
    assert stats.failures == 0
    assert stats.batches < 300, "concurrent saves were not batched"
    assert stats.fsyncs < 2 * 300


def test_syncfs_mode_is_durable_too(tmp_path: Path) -> None:
    async def scenario() -> EpisodeCheckpoint | None:
        store = FilesystemEpisodeStore(tmp_path, sync="filesystem")
        await asyncio.gather(*(_save(store, _record(f"ep-{i}")) for i in range(50)))
        loaded = await _load(store, "ep-7")
        await store.close()
        return loaded

    assert asyncio.run(scenario()) is not None


def test_archive_moves_the_record_with_its_reason(tmp_path: Path) -> None:
    store = FilesystemEpisodeStore(tmp_path)
    asyncio.run(_save(store, _record()))
    original = record_path(tmp_path, "ep").read_bytes()

    async def scenario() -> tuple[str | None, str | None]:
        async with store.lease("ep") as lease:
            with pytest.raises(InvalidArgument):
                await store.archive(lease, "../../x")
            where = await store.archive(lease, "policy_mismatch")
            assert await store.load(lease) is not None, "the record stays until it is replaced"
        async with store.lease("other") as lease:
            again = await store.archive(lease, "policy_mismatch")
        await store.close()
        return where, again

    where, again = asyncio.run(scenario())
    assert where is not None
    assert where.endswith(".policy_mismatch.ckpt")
    assert Path(where).read_bytes() == original
    assert again is None


def test_header_repeats_revision_and_expiry(tmp_path: Path) -> None:
    record = _record(revision=7)
    record.expires_at.FromSeconds(123)
    header = codec.decode_header(codec.encode(record), tmp_path / "x")
    assert (header.revision, header.expires_at_ns) == (7, 123 * 10**9)
