"""`LogEpisodeStore` zeroes its log ahead of the end: what that keeps, and the power cut it must read right.

A batch's `pwritev2(RWF_DSYNC)` into zeros written beforehand changes no file size, so its
sync commits nothing to the filesystem's journal. The price is the tail a power cut leaves:
appending, the journal orders the new size after the data; overwriting zeros, a later
sector of an unfinished batch can reach the disk while an earlier one stays zero. Such a
batch was never acknowledged, so recovery (and another process's view of the log) cuts it
off whole, while damage anywhere else stays DATA_LOSS.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import mmap
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from gymrpc.errors import DataLoss
from gymrpc.store import EpisodeLease, LogEpisodeStore, frames
from gymrpc.store.log import LogView
from gymrpc.v1 import common_pb2
from tests.resume.test_log_store import ROOT, _load, _save
from tests.resume.test_store import _record

EPISODES = 6


def _text(seed: str, size: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghij klmnop") for _ in range(size))


def _two_batches(root: Path, again: int = EPISODES) -> tuple[bytes, dict[str, bytes], dict[str, bytes]]:
    """A log of two batches: a whole record of every episode (several sectors), then of the first `again`
    episodes; each round's records."""
    rounds: list[dict[str, bytes]] = [{}, {}]

    async def scenario() -> int:
        store = LogEpisodeStore(root, full_every=0, commit_delay=1.0)
        records = {f"e{i}": _record(f"e{i}") for i in range(EPISODES)}
        for n, saved in enumerate(rounds):
            # Every lease is held before the saves: the batch waits for all of them.
            leases = {rid: await store.acquire(rid) for rid in list(records)[: again if n else EPISODES]}

            async def one(rid: str, lease: EpisodeLease, saved: dict[str, bytes] = saved, n: int = n) -> None:
                record = records[rid]
                record.messages.append(common_pb2.Message(content=_text(f"{rid}-{n}", 700)))
                await store.save(lease, record)
                saved[rid] = record.SerializeToString(deterministic=True)

            await asyncio.gather(*(one(rid, lease) for rid, lease in leases.items()))
            for lease in leases.values():
                await lease.release()
        assert store.stats.batches == 2
        end = store.log_size
        await store.close()
        return end

    end = asyncio.run(scenario())
    return _segment(root).read_bytes()[:end], rounds[0], rounds[1]


def _segment(root: Path) -> Path:
    (segment,) = (root / "logs").glob("*/*.seg")
    return segment


def _batches(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of each batch of a segment: up to and including each COMMIT."""
    out, start = [], 0
    for item in frames.scan(data):
        assert isinstance(item, frames.Frame)
        if item.kind == frames.COMMIT:
            out.append((start, item.offset + item.length))
            start = item.offset + item.length
    return out


def _reopen(root: Path, data: bytes) -> dict[str, bytes | DataLoss]:
    """What a store serves after a power cut left `data` (and the zeros ahead of it) in the segment."""
    _segment(root).write_bytes(data + bytes(1 << 16))

    async def scenario() -> dict[str, bytes | DataLoss]:
        store = LogEpisodeStore(root)
        out: dict[str, bytes | DataLoss] = {}
        for i in range(EPISODES):
            try:
                record = await _load(store, f"e{i}")
            except DataLoss as exc:
                out[f"e{i}"] = exc
            else:
                assert record is not None
                out[f"e{i}"] = record.SerializeToString(deterministic=True)
        await store.close()
        return out

    return asyncio.run(scenario())


def _unwritten(data: bytes, start: int, end: int) -> bytes:
    return data[:start] + bytes(end - start) + data[end:]


def test_a_log_keeps_zeros_ahead_of_its_end_and_reopens_without_a_torn_tail(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        store = LogEpisodeStore(tmp_path)
        records = [_record(f"z{i}") for i in range(20)]
        for record in records:
            await _save(store, record)
        (segment,) = (tmp_path / "logs").glob("*/*.seg")
        data = segment.read_bytes()
        end = store.log_size
        assert store.stats.zero_syncs >= 1
        assert len(data) - end >= (64 << 10) // 2, "zeros are kept ahead of the end"
        assert data.count(0, end) == len(data) - end
        await store.close()
        with caplog.at_level(logging.WARNING, logger="gymrpc.store.log"):
            again = LogEpisodeStore(tmp_path)
        assert not [r for r in caplog.records if "torn" in r.getMessage()], "the zeros are no torn tail"
        assert again.log_size == end
        for record in records:
            assert await _load(again, record.episode_id.rollout_id) == record
        await _save(again, records[0])
        assert await _load(again, "z0") == records[0]
        await again.close()

        plain = LogEpisodeStore(tmp_path / "plain", zero_ahead=0)
        await _save(plain, _record("p"))
        (segment,) = (tmp_path / "plain" / "logs").glob("*/*.seg")
        assert segment.stat().st_size == plain.log_size
        assert plain.stats.zero_syncs == 0
        await plain.close()

    asyncio.run(scenario())
    with pytest.raises(ValueError, match="zero_ahead"):
        LogEpisodeStore(tmp_path / "bad", zero_ahead=-1)
    with pytest.raises(ValueError, match="zero_ahead"):
        LogEpisodeStore(tmp_path / "bad", zero_ahead=(1 << 30) + 1)


def _written_bytes() -> int:
    """What the kernel counts this process as writing to storage (/proc/self/io `write_bytes`)."""
    lines = Path("/proc/self/io").read_text().splitlines()
    return int(dict(line.split(": ") for line in lines)["write_bytes"])


def count_writes(root: str) -> None:
    """Save 40 records and print what the process was counted as writing, and what it wrote (JSON).

    Run alone in a fresh process: /proc/PID/io counts the whole process, pytest's capture files and other
    tests' threads too. From the start (the commit thread is idle until the first save) to the close: the
    thread zeroes ahead after it acknowledges a batch, so a count taken meanwhile has pages `_zeroed_to`
    does not."""

    async def scenario() -> dict[str, int]:
        store = LogEpisodeStore(Path(root), full_every=0)
        records = [_record(f"w{i}") for i in range(40)]
        counted = _written_bytes()
        for record in records:
            record.messages.append(common_pb2.Message(content=_text(record.episode_id.rollout_id, 9000)))
            await _save(store, record)
        await store.close()
        return {
            "counted": _written_bytes() - counted,
            "written": store.stats.bytes + store._zeroed_to,
            "batches": store.stats.batches,
        }

    print(json.dumps(asyncio.run(scenario())))


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="Linux per-process I/O accounting")
def test_a_batch_into_zeros_is_counted_as_what_it_writes(tmp_path: Path) -> None:
    """The zeros are written a page at a time: written in large pieces, the page cache holds them in
    large folios, and each batch after is counted as writing its whole folio (a 1 MiB folio for a 13 KB
    batch on Linux 6.18, ext4), so /proc/PID/io, iotop and node exporters report the agent writing
    tens of times what reaches the disk."""
    child = "import sys; from tests.resume.test_log_zero_ahead import count_writes; count_writes(sys.argv[1])"
    proc = subprocess.run(
        [sys.executable, "-c", child, str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    slack = seen["batches"] * 2 * mmap.PAGESIZE  # a batch's first and last pages are partial
    assert seen["counted"] <= seen["written"] + slack, seen


@pytest.mark.parametrize("lost", ["a middle sector", "the first sector's part", "everything but the commit"])
def test_a_batch_torn_by_a_power_cut_is_cut_off_whole_not_read_as_damage(tmp_path: Path, lost: str) -> None:
    data, first, _second = _two_batches(tmp_path / "recorded")
    _, (start, end) = _batches(data)
    commit = frames.frame_at(data, end - len(frames.encode_commit([(f"e{i}", 2) for i in range(EPISODES)])))
    assert commit is not None
    assert commit.kind == frames.COMMIT
    assert commit.offset - start > 4 * frames.SECTOR, "the last batch spans several sectors"
    sector = (start // frames.SECTOR + 2) * frames.SECTOR
    gap = {
        "a middle sector": (sector, sector + frames.SECTOR),
        "the first sector's part": (start, (start // frames.SECTOR + 1) * frames.SECTOR),
        "everything but the commit": (start, commit.offset),
    }[lost]
    torn = _unwritten(data, *gap)
    assert frames.torn_batch(torn) == start
    _segment(tmp_path / "recorded").write_bytes(torn + bytes(1 << 16))
    view = LogView(_segment(tmp_path / "recorded").parent)
    view.refresh()
    assert not view.index.damaged
    assert {rid: c.version for rid, c in view.index.chains.items()} == dict.fromkeys(first, 1), "a view cuts it off"
    assert _reopen(tmp_path / "recorded", torn) == first, "the episodes are back at their last acknowledged records"


def test_a_gap_before_a_later_batch_is_damage(tmp_path: Path) -> None:
    data, first, second = _two_batches(tmp_path / "recorded", again=1)
    (start, _), _ = _batches(data)
    sector = (start // frames.SECTOR + 2) * frames.SECTOR
    damaged = _unwritten(data, sector, sector + frames.SECTOR)  # the first batch: the second was written after it
    assert frames.torn_batch(damaged) is None
    served = _reopen(tmp_path / "recorded", damaged)
    lost = [rid for rid, got in served.items() if isinstance(got, DataLoss)]
    assert lost, "the frames the first batch's COMMIT names are missing"
    assert "e0" not in lost, "e0's was superseded by the second batch"
    assert all(served[rid] == {**first, **second}[rid] for rid in served if rid not in lost), "and nothing else is"


def test_a_flipped_byte_of_the_last_batch_is_no_torn_batch(tmp_path: Path) -> None:
    data, _first, _second = _two_batches(tmp_path / "recorded")
    _, (start, end) = _batches(data)
    for offset in range(start, end):
        damaged = bytearray(data)
        damaged[offset] ^= 0x5A
        assert frames.torn_batch(bytes(damaged)) is None, offset


def test_a_view_reads_a_zeroed_log_a_chunk_at_a_time_as_its_owner_wrote_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = LogEpisodeStore(tmp_path, commit_delay=0)
        big = _record("big")
        big.messages.append(common_pb2.Message(content=_text("big", 200_000)))  # one frame larger than a read
        await _save(store, big)
        for i in range(400):
            await _save(store, _record(f"v{i}", step=i))
        view = LogView(store.folder)
        view.refresh()
        assert view.index.chains == store.index.chains
        for i in range(5):
            await _save(store, _record(f"late{i}"))
        view.refresh()
        assert view.index.chains == store.index.chains
        assert not view.index.damage
        await store.close()

    asyncio.run(scenario())


def test_zeroing_that_fails_is_said_once_and_saves_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def full_disk(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full_disk)  # only the zeros are written with pwrite; batches use pwritev

    async def scenario() -> None:
        store = LogEpisodeStore(tmp_path, commit_delay=0)
        records = [_record(f"f{i}") for i in range(5)]
        with caplog.at_level(logging.WARNING, logger="gymrpc.store.log"):
            for record in records:
                await _save(store, record)
        assert store.stats.zero_syncs == 0
        assert len([r for r in caplog.records if "zeroing ahead failed" in r.getMessage()]) == 1
        assert _segment(tmp_path).stat().st_size == store.log_size
        for record in records:
            assert await _load(store, record.episode_id.rollout_id) == record
        await store.close()

    asyncio.run(scenario())
