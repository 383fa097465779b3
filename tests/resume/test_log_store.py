"""`LogEpisodeStore`: group-committed log, deltas, recovery at every byte, SIGKILL, compaction, shared folders.

The crash-consistency test records a run (several episodes, interleaved saves, deltas and
full frames, a deletion), noting after every acknowledged save how long the log was and
what each episode's record was. It then cuts the log at every byte offset (a crash that
kept only that prefix) and flips every byte (media damage), and recovers with the store's
own scan and record reconstruction: nothing acknowledged before the cut may be lost, no
record may differ from one that was saved, and a damaged byte makes at most its own
episode DATA_LOSS, never a wrong or older record. Sampled offsets go through real opens of
the store on real files.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from gymrpc.errors import Aborted, DataLoss, Unavailable
from gymrpc.store import EpisodeCheckpoint, FilesystemEpisodeStore, LogEpisodeStore, frames, read_record
from gymrpc.store.log import _record_from
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2
from tests.resume.test_store import _record

ROOT = Path(__file__).resolve().parents[2]


def _grow(record: EpisodeCheckpoint, step: int) -> None:
    record.step = step
    record.messages.append(common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, content=f"turn {step} " * 8))


async def _save(store: LogEpisodeStore, record: EpisodeCheckpoint) -> None:
    async with store.lease(record.episode_id.rollout_id) as lease:
        await store.save(lease, record)


async def _load(store: LogEpisodeStore, rollout_id: str) -> EpisodeCheckpoint | None:
    async with store.lease(rollout_id) as lease:
        return await store.load(lease)


def _segment(root: Path) -> Path:
    (segment,) = (root / "logs").glob("*/*.seg")
    return segment


def _is_file(path: str) -> bool:
    return Path(path).is_file()


@pytest.mark.parametrize("differ", ["native", "shallow"])
def test_saves_are_deltas_one_fsync_per_batch_and_survive_a_reopen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, differ: str
) -> None:
    """Either way of computing deltas (C, or upb and Python where no compiler built the C one) writes a log
    that reads back the same."""
    from gymrpc.store import fields, log

    if differ == "shallow":
        monkeypatch.setattr(log, "_DIFFER", fields.Shallow(EpisodeCheckpoint.DESCRIPTOR))
    elif not isinstance(log._DIFFER, fields.Native):
        pytest.skip("the C diff (gymrpc/store/_fields.c) was not built: no C compiler")

    async def scenario() -> tuple[dict[str, EpisodeCheckpoint], LogEpisodeStore]:
        store = LogEpisodeStore(tmp_path)
        records = {f"ep-{i}": _record(f"ep-{i}") for i in range(40)}

        async def run(record: EpisodeCheckpoint) -> None:
            async with store.lease(record.episode_id.rollout_id) as lease:
                assert await store.load(lease) is None
                for step in range(6):
                    _grow(record, step)
                    await store.save(lease, record)

        await asyncio.gather(*(run(r) for r in records.values()))
        await store.close()
        return records, store

    records, store = asyncio.run(scenario())
    stats = store.stats
    assert stats.writes == 240
    assert stats.failures == 0
    assert stats.fsyncs - stats.zero_syncs == stats.batches < stats.writes, "saves of concurrent episodes share a sync"
    assert stats.delta_frames > stats.full_frames, "a boundary stores what changed, not the whole record"

    async def reopened() -> dict[str, EpisodeCheckpoint | None]:
        again = LogEpisodeStore(tmp_path)
        loaded = {rid: await _load(again, rid) for rid in records}
        await again.close()
        return loaded

    loaded = asyncio.run(reopened())
    assert loaded == records
    assert all(r.revision == 6 for r in records.values())
    assert read_record(tmp_path, "ep-3") == records["ep-3"]


@pytest.mark.parametrize("differ", ["native", "shallow"])
def test_rl_records_with_long_token_traces_read_back_through_their_deltas(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, differ: str
) -> None:
    """The agent's `EncodedCheckpoint` of an RL episode: model calls of thousands of token ids appended, a
    session snapshot of a few KiB replaced, the first message rewritten once. Every delta's CRC of the
    whole record (kept per field by the C diff: short fields read again, long ones combined, the longest
    checksummed by zlib) must be the one a load recomputes, or the load is DATA_LOSS."""
    from gymrpc.store import fields, log
    from gymrpc.store.encoded import encoded

    if differ == "shallow":
        monkeypatch.setattr(log, "_DIFFER", fields.Shallow(EpisodeCheckpoint.DESCRIPTOR))
    elif not isinstance(log._DIFFER, fields.Native):
        pytest.skip("the C diff (gymrpc/store/_fields.c) was not built: no C compiler")
    rng = random.Random(3)

    async def scenario() -> dict[str, EpisodeCheckpoint]:
        store = LogEpisodeStore(tmp_path)
        saved = {}
        for e in range(3):
            plain = _record(f"rl-{e}")
            record = encoded(plain)
            async with store.lease(plain.episode_id.rollout_id) as lease:
                for step in range(12):
                    call = agent_pb.ModelCallRecord(step=step)
                    call.tokens.prompt_token_ids.extend(rng.randrange(150_000) for _ in range(rng.randrange(100, 3000)))
                    record.model_calls.append(call.SerializeToString(deterministic=True))
                    reply = common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, content="x" * rng.randrange(700))
                    record.messages.append(reply.SerializeToString(deterministic=True))
                    snapshot = common_pb2.SessionSnapshot(format_name="t", payload=rng.randbytes(rng.randrange(6000)))
                    record.resource_snapshot = snapshot.SerializeToString(deterministic=True)
                    if step == 7:
                        record.messages[0] = common_pb2.Message(content="rewritten " * 60).SerializeToString()
                    record.step = step
                    await store.save(lease, record)
            saved[plain.episode_id.rollout_id] = EpisodeCheckpoint.FromString(record.SerializeToString())
        assert store.stats.delta_frames >= 30, "the boundaries were written as deltas"
        await store.close()
        return saved

    saved = asyncio.run(scenario())

    async def reopened() -> dict[str, EpisodeCheckpoint | None]:
        again = LogEpisodeStore(tmp_path)
        loaded = {rid: await _load(again, rid) for rid in saved}
        await again.close()
        return loaded

    assert asyncio.run(reopened()) == saved


Records = dict[str, EpisodeCheckpoint]


def _save_and_reopen(root: Path, count: int) -> tuple[Records, dict[str, EpisodeCheckpoint | None]]:
    """`count` episodes saved three times each, concurrently; then what a fresh store reads back."""

    async def scenario() -> tuple[Records, dict[str, EpisodeCheckpoint | None]]:
        store = LogEpisodeStore(root)
        records = {f"ep-{i}": _record(f"ep-{i}") for i in range(count)}

        async def run(record: EpisodeCheckpoint) -> None:
            async with store.lease(record.episode_id.rollout_id) as lease:
                for step in range(3):
                    _grow(record, step)
                    await store.save(lease, record)

        await asyncio.gather(*(run(r) for r in records.values()))
        await store.close()
        again = LogEpisodeStore(root)
        loaded = {rid: await _load(again, rid) for rid in records}
        await again.close()
        return records, loaded

    return asyncio.run(scenario())


def test_a_filesystem_without_per_write_sync_gets_write_then_fdatasync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch is one `pwritev2(RWF_DSYNC)`; where the filesystem refuses the flag, `pwritev` + `fdatasync`."""
    real_pwritev, real_fdatasync = os.pwritev, os.fdatasync
    calls = {"flagged": 0, "plain": 0, "fdatasync": 0}

    def pwritev(fd: int, buffers: list[bytes], offset: int, flags: int = 0) -> int:
        if flags:
            calls["flagged"] += 1
            raise OSError(errno.EOPNOTSUPP, "not supported")
        calls["plain"] += 1
        return real_pwritev(fd, buffers, offset)

    def fdatasync(fd: int) -> None:
        calls["fdatasync"] += 1
        real_fdatasync(fd)

    monkeypatch.setattr(os, "pwritev", pwritev)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    records, loaded = _save_and_reopen(tmp_path, 8)
    assert loaded == records
    assert calls["flagged"] == 1, "the refusal is remembered: the flag is tried once"
    assert calls["plain"] >= 1
    assert calls["fdatasync"] >= calls["plain"], "every plain write is followed by a sync"


def test_a_short_write_is_finished_and_synced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_pwritev = os.pwritev
    short = {"writes": 0}

    def pwritev(fd: int, buffers: list[bytes], offset: int, flags: int = 0) -> int:
        data = b"".join(buffers)
        if len(data) > 1 and short["writes"] < 3:  # the kernel took only half (a signal, a nearly full disk)
            short["writes"] += 1
            data = data[: len(data) // 2]
        return real_pwritev(fd, [data], offset, flags)

    monkeypatch.setattr(os, "pwritev", pwritev)
    records, loaded = _save_and_reopen(tmp_path, 8)
    assert short["writes"] == 3
    assert loaded == records


def test_a_failed_write_stops_saves_and_loses_nothing_acknowledged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a failed write the log's durability is unknown: every later save answers UNAVAILABLE, and a
    restarted store still reads every save acknowledged before it."""

    async def scenario() -> tuple[EpisodeCheckpoint, list[BaseException]]:
        store = LogEpisodeStore(tmp_path)
        kept = _record("kept")
        _grow(kept, 1)
        await _save(store, kept)
        real_pwritev = os.pwritev

        def full_disk(fd: int, buffers: list[bytes], offset: int, flags: int = 0) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "pwritev", full_disk)
        errors: list[BaseException] = []
        for rid in ("lost-1", "lost-2"):
            try:
                await _save(store, _record(rid))
            except Unavailable as exc:
                errors.append(exc)
        monkeypatch.setattr(os, "pwritev", real_pwritev)
        try:
            await _save(store, _record("after"))
        except Unavailable as exc:
            errors.append(exc)
        await store.close()
        return kept, errors

    kept, errors = asyncio.run(scenario())
    assert len(errors) == 3, "the failed batch and every save after it are refused"
    assert all("failed a write" in str(e) for e in errors)

    async def reopened() -> list[EpisodeCheckpoint | None]:
        again = LogEpisodeStore(tmp_path)
        loaded = [await _load(again, rid) for rid in ("kept", "lost-1", "after")]
        await again.close()
        return loaded

    assert asyncio.run(reopened()) == [kept, None, None]


def test_a_batch_waits_for_more_saves_only_while_another_can_come(tmp_path: Path) -> None:
    """The commit delay gathers saves into one sync, and ends as soon as every lease held has a save waiting.

    The delays are long (1 s) so that a wait which should have ended early shows as a full delay in the
    counters, not as a slow test."""

    async def scenario() -> None:
        store = LogEpisodeStore(tmp_path / "alone", commit_delay=1.0)
        record = _record()
        async with store.lease("ep") as lease:
            for step in range(20):
                _grow(record, step)
                await store.save(lease, record)
        assert (store.stats.batches, store.stats.full_delays) == (20, 0), "one episode alone never waits"
        assert await _load(store, "ep") == record
        await store.close()

        store = LogEpisodeStore(tmp_path / "together", commit_delay=1.0)
        records = [_record(f"ep-{i}") for i in range(8)]
        async with contextlib.AsyncExitStack() as stack:
            leases = [await stack.enter_async_context(store.lease(r.episode_id.rollout_id)) for r in records]
            await asyncio.gather(*(store.save(lease, r) for lease, r in zip(leases, records, strict=True)))
        assert (store.stats.batches, store.stats.full_delays) == (1, 0), "eight episodes, eight saves: one sync"
        await store.close()

        store = LogEpisodeStore(tmp_path / "waits", commit_delay=0.05)
        async with store.lease("busy"), store.lease("ep") as lease:  # "busy" may save any moment: worth waiting
            await store.save(lease, record := _record())
        assert (store.stats.batches, store.stats.full_delays) == (1, 1)
        assert await _load(store, "ep") == record
        await store.close()

    asyncio.run(scenario())


def test_a_lease_whose_save_was_cancelled_stays_held_until_the_frame_is_written(tmp_path: Path) -> None:
    """A caller cancelled while its save waits for the disk leaves the frame queued: it is written all the
    same. Until it is, nobody may take the episode: a retry would read the record without it and write the
    same version again, which the log's index ignores, so the retry's later deltas would apply to the wrong
    record (DATA_LOSS at the next load). The commit thread's write is held back until the test lets it go."""

    async def scenario() -> None:
        store = LogEpisodeStore(tmp_path)
        record = _record()
        go = threading.Event()
        write = store._write_durably
        async with store.lease("ep") as lease:
            await store.save(lease, record)
            store._write_durably = lambda *args: go.wait() and write(*args)  # type: ignore[method-assign]
            _grow(record, 1)
            saving = asyncio.ensure_future(store.save(lease, record))
            await asyncio.sleep(0)  # the save runs up to its wait: its frame is handed to the commit thread
            saving.cancel()
            with pytest.raises(asyncio.CancelledError):
                await saving
        with pytest.raises(Aborted) as refused:
            await store.acquire("ep")
        assert refused.value.reason == "LEASE_HELD", "the cancelled save is still on its way to the disk"
        go.set()
        loaded = None
        for _ in range(3000):  # the frame lands within milliseconds; a busy machine gets 30 s
            with contextlib.suppress(Aborted):
                loaded = await _load(store, "ep")
                break
            await asyncio.sleep(0.01)
        assert loaded is not None
        assert (loaded.revision, loaded.step) == (2, 1), "the queued frame was written"
        async with store.lease("ep") as lease:  # a retry goes on from it, with a delta that rebuilds
            _grow(loaded, 2)
            await store.save(lease, loaded)
        await store.close()
        reopened = LogEpisodeStore(tmp_path)
        assert await _load(reopened, "ep") == loaded
        await reopened.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("delay", [-0.001, 1.5])
def test_a_commit_delay_out_of_range_is_refused(tmp_path: Path, delay: float) -> None:
    with pytest.raises(ValueError, match=r"commit_delay must be 0-1\.0 s"):
        LogEpisodeStore(tmp_path, commit_delay=delay)
    assert not (tmp_path / "logs").exists(), "refused before anything was created"


def test_revision_guard_and_lease_contention(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = LogEpisodeStore(tmp_path, lease_retry_delay=0.5)
        record = _record()
        await _save(store, record)
        await _save(store, record)
        stale = _record(step=9, revision=1)
        with pytest.raises(Aborted) as caught:
            await _save(store, stale)
        assert caught.value.reason == "CHECKPOINT_CONFLICT"
        assert caught.value.metadata["stored_revision"] == "2"
        assert stale.revision == 1, "a refused save leaves the record as it was"
        with pytest.raises(Aborted):
            await _save(store, _record("other", revision=3))  # nothing stored: only revision 0 may be saved
        async with store.lease("ep"):
            with pytest.raises(Aborted) as held:
                await store.acquire("ep")
            assert held.value.reason == "LEASE_HELD"
            assert held.value.retry_delay == 0.5
        assert await _load(store, "ep") == record
        assert await _load(store, "other") is None
        await store.close()

    asyncio.run(scenario())


def test_expired_records_are_deleted_archives_kept_and_ids_restart(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = LogEpisodeStore(tmp_path)
        done = _record("done", phase=agent_pb.EPISODE_PHASE_COMPLETED)
        done.expires_at.FromSeconds(1)  # long past
        await _save(store, done)
        await _save(store, _record("open"))
        async with store.lease("done") as lease:
            where = await store.archive(lease, "policy_mismatch")
        assert where is not None
        assert _is_file(where)
        assert await store.delete_expired() == 1
        assert await _load(store, "done") is None
        fresh = _record("done")
        await _save(store, fresh)  # a deleted record starts again at revision 0
        assert fresh.revision == 1
        await store.close()
        again = LogEpisodeStore(tmp_path)
        assert await _load(again, "done") == fresh
        assert (await _load(again, "open")) is not None
        await again.close()

    asyncio.run(scenario())


def test_two_processes_share_a_folder_and_take_episodes_over(tmp_path: Path) -> None:
    """Two stores (two logs, as two agent replicas) on one folder: the newest write of an episode wins."""

    async def scenario() -> None:
        first, second = LogEpisodeStore(tmp_path), LogEpisodeStore(tmp_path)
        assert first.folder != second.folder, "each process appends to its own log"
        record = _record("moved")
        for step in range(3):
            _grow(record, step)
            await _save(first, record)
        async with first.lease("moved"):
            with pytest.raises(Aborted):
                await second.acquire("moved")  # the lease reaches across logs
        async with second.lease("moved") as lease:
            taken = await second.load(lease)
            assert taken == record
            _grow(taken, 3)
            await second.save(lease, taken)
        assert await _load(first, "moved") == taken
        await first.close()
        await second.close()
        third = LogEpisodeStore(tmp_path)  # adopts a log whose owner is gone
        assert third.folder in (first.folder, second.folder)
        assert await _load(third, "moved") == taken
        await third.close()

    asyncio.run(scenario())


def test_records_of_the_file_store_are_read_and_continued(tmp_path: Path) -> None:
    async def scenario() -> None:
        old = FilesystemEpisodeStore(tmp_path)
        record = _record("legacy")
        await _save(old, record)  # type: ignore[arg-type]
        await old.close()
        store = LogEpisodeStore(tmp_path)
        assert await _load(store, "legacy") == record
        await _save(store, record)
        assert record.revision == 2
        assert await _load(store, "legacy") == record
        await store.close()

    asyncio.run(scenario())


# -- crash consistency at every byte ------------------------------------------------------------


def _recorded_run(root: Path) -> tuple[bytes, list[tuple[int, dict[str, int]]], dict[tuple[str, int], bytes]]:
    """A log, the (log length, acknowledged version per episode) after each ack, and every saved record."""
    acks: list[tuple[int, dict[str, int]]] = []
    saved: dict[tuple[str, int], bytes] = {}

    async def scenario() -> None:
        store = LogEpisodeStore(root, full_every=3)
        acked: dict[str, int] = {}
        records = {f"e{i}": _record(f"e{i}") for i in range(3)}

        async def step(rid: str, n: int) -> None:
            record = records[rid]
            async with store.lease(rid) as lease:
                _grow(record, n)
                await store.save(lease, record)
                saved[rid, lease.source.version] = record.SerializeToString(deterministic=True)
                acked[rid] = lease.source.version
                acks.append((store.log_size, dict(acked)))

        for n in range(5):
            await asyncio.gather(*(step(rid, n) for rid in records))  # a batch holds several episodes
        done = _record("gone", phase=agent_pb.EPISODE_PHASE_COMPLETED)
        done.expires_at.FromSeconds(1)
        await _save(store, done)
        assert await store.delete_expired() == 1
        async with store.lease("gone") as lease:
            acked["gone"] = lease.source.version
        acks.append((store.log_size, dict(acked)))
        await store.close()

    asyncio.run(scenario())
    data = _segment(root).read_bytes()
    end = acks[-1][0]
    assert data.count(0, end) == len(data) - end, "past the log's end, only the zeros written ahead"
    return data[:end], acks, saved


def _recover(data: bytes) -> dict[str, tuple[int, bytes | None] | DataLoss]:
    """What the store serves after a restart on these segment bytes (its own scan and reconstruction)."""
    index = frames.LogIndex()
    index.feed(0, data)
    chains, damaged = index.settled()
    out: dict[str, tuple[int, bytes | None] | DataLoss] = {}
    for rid in chains.keys() | damaged.keys():
        chain = chains.get(rid)
        if damaged.get(rid, 0) > (chain.version if chain else 0):
            out[rid] = DataLoss("damaged")
            continue
        assert chain is not None
        if chain.deleted:
            out[rid] = (chain.version, None)
            continue
        try:
            record, _ = _record_from(chain, lambda _s, off, n: data[off : off + n], "log", rid)
        except DataLoss as exc:
            out[rid] = exc
            continue
        out[rid] = (chain.version, record.SerializeToString(deterministic=True))
    return out


def _check_served(
    got: tuple[int, bytes | None] | DataLoss | None, rid: str, saved: dict[tuple[str, int], bytes]
) -> tuple[int, bytes | None]:
    assert got is not None, rid
    assert not isinstance(got, DataLoss), (rid, got)
    version, data = got
    if data is not None:
        assert saved[rid, version] == data, f"{rid} v{version} differs from what was saved"
    return version, data


def test_cut_or_damaged_at_every_byte_loses_nothing_acknowledged(tmp_path: Path) -> None:
    data, acks, saved = _recorded_run(tmp_path / "store")
    assert len(acks) == 16
    final = acks[-1][1]
    for cut in range(len(data) + 1):
        acked = next((a for length, a in reversed(acks) if length <= cut), {})
        recovered = _recover(data[:cut])
        for rid, version in acked.items():
            got, _ = _check_served(recovered.get(rid), rid, saved)
            assert got >= version, f"cut at {cut}: {rid} lost acknowledged write {version} (has {got})"
    whole = _recover(data)
    losses = 0
    for offset in range(len(data)):
        damaged = bytearray(data)
        damaged[offset] ^= 0x5A
        recovered = _recover(bytes(damaged))
        lost = [rid for rid in final if isinstance(recovered.get(rid), DataLoss)]
        assert len(lost) <= 1, f"one damaged byte at {offset} cost {lost}"
        losses += len(lost)
        for rid, version in final.items():
            if rid in lost:
                continue
            got = _check_served(recovered.get(rid), rid, saved)
            assert got == whole[rid], f"damage at {offset}: {rid} silently served v{got[0]}, not v{version}"
    assert losses > 0, "no damage was ever detected"


def test_recovery_on_real_files_at_sampled_cuts_and_damage(tmp_path: Path) -> None:
    data, acks, saved = _recorded_run(tmp_path / "recorded")
    cuts = sorted({length for length, _ in acks} | set(range(0, len(data), 211)) | {len(data) - 1})
    for cut in cuts:
        root = tmp_path / f"cut-{cut}"
        shutil.copytree(tmp_path / "recorded", root)
        segment = _segment(root)
        segment.write_bytes(data[:cut] + bytes(7))  # the crash left the prefix and a few zeroed bytes
        acked = next((a for length, a in reversed(acks) if length <= cut), {})

        async def reopen(root: Path = root, acked: dict[str, int] = acked) -> None:
            store = LogEpisodeStore(root)
            written = {}
            for rid, version in acked.items():
                async with store.lease(rid) as lease:
                    record = await store.load(lease)
                    assert lease.source.version >= version
                    if record is not None:
                        assert saved[rid, lease.source.version] == record.SerializeToString(deterministic=True)
                        record.step += 1
                        await store.save(lease, record)  # the log takes new writes after its cut tail
                    written[rid] = record
            await store.close()
            again = LogEpisodeStore(root)
            assert {rid: await _load(again, rid) for rid in written} == written
            await again.close()

        asyncio.run(reopen())


KILLED_WRITER = textwrap.dedent(
    """
    import asyncio, sys
    from gymrpc.store import LogEpisodeStore
    from tests.resume.test_log_store import _grow
    from tests.resume.test_store import _record

    async def main():
        store = LogEpisodeStore(sys.argv[1])

        async def episode(i):
            record = _record(f"k{i}")
            async with store.lease(f"k{i}") as lease:
                for step in range(100000):
                    if step % 50 == 0:
                        del record.messages[:]  # a field that shrinks: its delta replaces it
                    _grow(record, step % 50)
                    await store.save(lease, record)
                    print(f"k{i} {record.revision} {record.step} {len(record.messages)}", flush=True)

        await asyncio.gather(*(episode(i) for i in range(16)))

    asyncio.run(main())
    """
)


def test_sigkill_mid_run_loses_no_acknowledged_save(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    acked: dict[str, tuple[int, int, int]] = {}
    for line in proc.stdout:
        rid, revision, step, messages = line.split()
        acked[rid] = (int(revision), int(step), int(messages))
        if sum(r for r, _, _ in acked.values()) >= 3000:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()

    async def recovered() -> dict[str, EpisodeCheckpoint | None]:
        store = LogEpisodeStore(tmp_path)
        loaded = {rid: await _load(store, rid) for rid in acked}
        await store.close()
        return loaded

    for rid, record in asyncio.run(recovered()).items():
        revision, step, messages = acked[rid]
        assert record is not None, rid
        assert record.revision >= revision, f"{rid}: acknowledged revision {revision}, recovered {record.revision}"
        if record.revision == revision:
            assert (record.step, len(record.messages)) == (step, messages)
        assert [m.content for m in record.messages] == [f"turn {s} " * 8 for s in range(len(record.messages))]


COMPACTION_KILLED = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from gymrpc.store import LogEpisodeStore
    from tests.resume.test_log_store import _grow
    from tests.resume.test_store import _record

    async def main():
        store = LogEpisodeStore(sys.argv[1], compact_min_bytes=1 << 40)
        for i in range(8):
            record = _record(f"c{i}")
            async with store.lease(f"c{i}") as lease:
                for step in range(12):
                    _grow(record, step)
                    await store.save(lease, record)
        async with store.lease("c0") as lease:
            record = await store.load(lease)
            await store.save(lease, record)  # revision 13, durable before compaction is allowed
        real_unlink = os.unlink
        def die(path, *a, **k):
            if str(path).endswith(".seg"):
                os.kill(os.getpid(), signal.SIGKILL)  # the new segment is durable, the old ones not yet deleted
            return real_unlink(path, *a, **k)
        os.unlink = die
        # The commit thread checks for compaction after each batch: the next batch sets it off.
        store.compact_min_bytes, store.compact_ratio = 1, 1.0
        async with store.lease("trigger") as lease:
            await store.save(lease, _record("trigger"))
        await asyncio.sleep(60)

    asyncio.run(main())
    """
)


def test_a_crash_at_any_byte_of_a_compaction_keeps_every_record(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", COMPACTION_KILLED, str(tmp_path / "store")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    (folder,) = (p for p in (tmp_path / "store" / "logs").iterdir() if not p.name.startswith("!"))
    old, new = sorted(folder.glob("*.seg"))
    compacted = new.read_bytes()
    assert frames.frame_at(compacted, 0).kind == frames.COMPACT_BEGIN  # type: ignore[union-attr]
    expected = {f"c{i}": read_record(tmp_path / "store", f"c{i}") for i in range(8)}
    assert expected["c0"] is not None
    assert expected["c0"].revision == 13
    ends = [f.offset + f.length for f in frames.scan(compacted) if isinstance(f, frames.Frame)]
    cuts = sorted(set(range(0, len(compacted), 331)) | set(ends) | {e - 1 for e in ends} | {1, 40})
    for cut in cuts:
        root = tmp_path / f"cut-{cut}"
        shutil.copytree(tmp_path / "store", root)
        (root / "logs" / folder.name / new.name).write_bytes(compacted[:cut])

        async def reopen(root: Path = root) -> dict[str, EpisodeCheckpoint | None]:
            store = LogEpisodeStore(root)
            loaded = {rid: await _load(store, rid) for rid in expected}
            await store.close()
            return loaded

        assert asyncio.run(reopen()) == expected, f"compaction cut at {cut}"
        left = sorted(p.name for p in (root / "logs" / folder.name).glob("*.seg"))
        assert left == ([new.name] if cut == len(compacted) else [old.name]), (cut, left)


def test_a_lease_taken_before_a_compaction_still_loads_its_record(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = LogEpisodeStore(tmp_path, zero_ahead=0)  # the commit thread does nothing after a batch's ack
        kept = _record("kept")
        for step in range(5):
            _grow(kept, step)
            await _save(store, kept)
        async with store.lease("kept") as lease:  # resolved to frames in segment 0
            await _save(store, _record("other"))
            await asyncio.to_thread(store._compact)  # what the commit thread does between batches (none pending)
            assert store.stats.compactions == 1
            assert not (store.folder / "000000000000.seg").exists()
            assert await store.load(lease) == kept
            _grow(kept, 5)
            await store.save(lease, kept)  # a delta on top of the compacted record
        await store.close()
        again = LogEpisodeStore(tmp_path)
        assert await _load(again, "kept") == kept
        await again.close()

    asyncio.run(scenario())


def test_a_split_reusing_an_older_revision_equals_a_plain_split() -> None:
    """Reusing entries of another revision (any: older, newer, unrelated) never changes the split."""
    from gymrpc.store import fields

    revisions = []
    record = _record("rid-split", step=1)
    for step in range(6):
        record.revision = step
        record.updated_at.FromNanoseconds(1_000 + step)
        record.messages.add(role=common_pb2.ROLE_USER, content=f"turn {step}")
        if step == 3:
            record.messages[0].content = "rewritten"
        revisions.append(record.SerializeToString(deterministic=True))
    splits = [fields.split(data) for data in revisions]
    for data, plain in zip(revisions, splits, strict=True):
        for like in [*splits, {}, {1: [b"\x0a\x00"]}]:
            assert fields.split(data, like) == plain
            assert fields.join(fields.split(data, like)) == data


def test_the_shallow_split_writes_the_deltas_the_python_split_writes() -> None:
    """`Shallow` (upb) and `split` + `diff` (Python) give byte-identical deltas, so either writer's log
    reads back the same: growth, rewrites, a replaced snapshot, a completion that drops fields."""
    from gymrpc.store import fields

    shallow = fields.Shallow(EpisodeCheckpoint.DESCRIPTOR)
    record = _record("rid-shallow", step=1)
    revisions = []
    for step in range(8):
        record.revision, record.step = step, step
        record.updated_at.FromNanoseconds(1_000 + step * 10**9)
        record.messages.add(role=common_pb2.ROLE_ASSISTANT, content=f"turn {step} " * (step * 40))
        record.resource_snapshot.payload = bytes([step]) * (200 * step)
        if step == 4:
            record.messages[0].content = "rewritten"
            record.usage.SetInParent()  # present but empty: an entry of 2 bytes
        if step == 6:
            record.ClearField("messages")
            record.phase = agent_pb.EPISODE_PHASE_COMPLETED
            record.expires_at.FromNanoseconds(2**62)
        revisions.append(record.SerializeToString(deterministic=True))
    revisions.append(EpisodeCheckpoint().SerializeToString())  # everything removed
    for before, after in itertools.pairwise(revisions):
        expected = fields.diff(fields.split(before), fields.split(after))
        old, new = shallow.values(before), shallow.values(after)
        assert old is not None
        assert new is not None
        assert shallow.values(after, serialized=True) == new
        assert shallow.diff(old, new) == (expected, None)
        assert fields.join(fields.apply(fields.split(before), expected)) == after


def test_a_record_with_fields_the_shallow_split_does_not_know_is_written_whole() -> None:
    from gymrpc.store import fields

    shallow = fields.Shallow(EpisodeCheckpoint.DESCRIPTOR)
    data = _record("rid-unknown", step=1).SerializeToString(deterministic=True)
    assert shallow.values(data) is not None
    assert shallow.values(data + b"\xf8\x07\x01") is None  # field 127: not in this schema
    assert shallow.values(b"\x0a\x05ab") is None  # truncated
    assert shallow.values(b"\x38\x81\x00") is None  # step = 1 as a two-byte varint: not canonical
    assert shallow.values(b"\x38\x01\x38\x02") is None  # a singular field twice (the last one wins)
    assert shallow.values(b"\x38\x01") == {7: 1}
    carrying = EpisodeCheckpoint.FromString(data + b"\xf8\x07\x01")  # kept as an unknown field, written back
    assert shallow.values(carrying.SerializeToString(deterministic=True), serialized=True) is None
