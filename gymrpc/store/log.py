"""`LogEpisodeStore`: every episode's boundaries appended to one group-committed log per agent process.

Layout (`k` = sha256 of the rollout id; the archive and legacy records as in `files`):

    root/leases/<nn>.lock               the episodes' leases: an OFD lock on one byte of one file (`ranges.slot(k)`)
    root/logs/<log id>/owner.lock       held (flock, and an OFD lock on byte 0) by the process appending to the log
    root/logs/<SCHEME>/owner.lock/      a folder, not a file: the format marker (see below)
    root/logs/<log id>/<seq>.seg        the log's segments (`frames`), oldest first
    root/archive/<k>.<UTC time>.<reason>.ckpt   archived records (the `codec` file format)

A save is one frame (the whole record, or only its changed top-level fields against the
episode's previous frame: `fields`) handed to the commit thread, which writes every
pending frame plus a COMMIT frame with one `pwritev2(RWF_DSYNC)` (a write and its
`fdatasync` in one system call), then wakes every waiter: one sync per batch, not per
boundary. A batch first waits up to `commit_delay` (8 ms) for more saves to join, unless every
lease held already has a save waiting: the sync is most of a save's CPU. The segment is kept
zeroed past its end (`zero_ahead`), so that write overwrites zeros and its sync commits no new
file size to the filesystem's journal; a batch a power cut tore there (a later sector kept, an
earlier one lost) was never acknowledged, and recovery cuts it off whole (`frames.torn_batch`).
A process adopts a log whose owner died (its lock is free) or starts a new one; an adopted log
is scanned, its torn tail cut off. Several agent processes can share the folder (replicas):
an episode's lease is an OFD byte-range lock (`ranges`: no file per episode), and its record is its highest-version
write in any log of the folder, so a replica that takes an episode over reads it from the
other process's log (tailed incrementally) and writes it on in its own. When a log's bytes
outgrow its live records, the commit thread writes the live records into a new segment
(COMPACT_BEGIN ... COMPACT_END, then fsync) and only then deletes the old segments: a
crash at any byte leaves either the old segments or the complete new one.

Records written by `FilesystemEpisodeStore` (root/episodes/*/*.ckpt) are read too, so an
existing folder keeps its episodes when the store changes.

Format 2 (OFD leases; format 1 took a flock on a lock file per episode): agents of the two
formats would not exclude each other, so neither may run beside the other. A format-2 store
creates `logs/<SCHEME>/owner.lock` as a folder: a format-1 agent, which opens the first
`owner.lock` it lists (the name sorts first), fails at start on it with EISDIR and the
marker's name in the message. A format-2 store refuses to start while a format-1 agent is
alive on the folder: a log whose owner lock is held without the OFD lock on its byte 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import hashlib
import itertools
import logging
import mmap
import os
import queue
import secrets
import socket
import threading
import time
import zlib
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from google.protobuf.message import DecodeError

from gymrpc.durable import fsync_folder
from gymrpc.errors import Aborted, DataLoss, FailedPrecondition, InvalidArgument, Unavailable
from gymrpc.ids import check_id
from gymrpc.store import codec, fields, frames, ranges
from gymrpc.store.base import IO_THREADS, EpisodeCheckpoint, EpisodeLease, EpisodeStore, PendingSave
from gymrpc.store.commit import CommitStats
from gymrpc.store.files import REASON, _read, _read_header, _sweep, _unlink

log = logging.getLogger(__name__)
T = TypeVar("T")
DEFAULT_COMMIT_DELAY = 0.008
"""Seconds; measured on 2 vCPUs, 64 episodes in flight, against 2 ms in one stack: 2.2x the saves per sync,
29-50 % less of the agent CPU that resume adds, on / off 0.006-0.067 higher (bench/README.md, "A longer
commit delay"). An RL boundary waits far longer for its model call; 8 ms more is noise there."""
MAX_COMMIT_DELAY = 1.0
DEFAULT_ZERO_AHEAD = 4 << 20
"""Bytes; zeros written ahead of the log's end, so a batch's sync overwrites and changes no file size."""
MAX_ZERO_AHEAD = 1 << 30
_PAGE = mmap.PAGESIZE
_ZEROS = bytes(_PAGE)
"""Zeros are written a page per call: a larger write makes the page cache hold them in large folios
(Linux 6.x, ext4), and each later batch dirties, and is counted in /proc/PID/io as writing, its whole
folio (1 MiB for a 13 KB batch measured), though only the changed blocks reach the disk."""
_VIEW_READ = 64 << 10
"""Bytes a view reads at a time: past the owner's last batch lie only its zeros."""
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
OWNER = "owner.lock"
COMMIT_THREAD = "store-log"
"""The commit thread's name (a profiler or a bench finds it by its name)."""
SCHEME = ranges.MARKER
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def _segment_name(seq: int) -> str:
    return f"{seq:012d}.seg"


def _segments(folder: Path) -> list[int]:
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    return sorted(int(n[:-4]) for n in names if n.endswith(".seg") and n[:-4].isdigit())


def _corrupt(where: str, rollout_id: str, problem: str) -> DataLoss:
    """`where`: a log folder (root/logs/<log id>); the message names the command that lets the episode go."""
    root = Path(where).parent.parent
    return DataLoss(
        f"the checkpoint of episode {rollout_id!r} in {where} is corrupt ({problem}); nothing was changed. "
        f"`gymrpc episodes delete {root} {rollout_id}` lets the episode start over (or restore the folder from a "
        "backup)",
        metadata={"path": where, "rollout_id": rollout_id},
    )


_DIFFER = fields.differ(EpisodeCheckpoint.DESCRIPTOR)
"""A save's delta against the episode's previous record, at C speed."""


def _record_from(
    chain: frames.Chain, read: Callable[[int, int, int], bytes], where: str, rollout_id: str
) -> tuple[EpisodeCheckpoint, bytes]:
    """The record a chain ends at, and its bytes (as saved: what a delta written after it applies to)."""
    state: fields.Fields | None = None
    data = b""
    for segment, offset, length in chain.frames:
        frame = frames.frame_at(read(segment, offset, length), 0)
        if frame is None or frame.rollout_id != rollout_id:
            raise _corrupt(where, rollout_id, f"the frame at {segment}:{offset} no longer reads back")
        try:
            if frame.kind == frames.FULL:
                data, state = frame.payload, None
            else:
                crc, delta = frames.decode_delta_payload(frame.payload)
                state = fields.apply(state if state is not None else fields.split(data), delta)
                data = fields.join(state)
                if zlib.crc32(data) != crc:
                    raise _corrupt(where, rollout_id, f"a delta at {segment}:{offset} does not rebuild its record")
        except fields.WireError as exc:
            raise _corrupt(where, rollout_id, str(exc)) from None
    record = EpisodeCheckpoint()
    try:
        record.ParseFromString(data)
    except DecodeError as exc:
        raise _corrupt(where, rollout_id, f"the record does not parse: {exc}") from None
    if record.schema_version != codec.SCHEMA_VERSION:
        raise _corrupt(where, rollout_id, f"schema_version {record.schema_version}")
    if record.episode_id.rollout_id != rollout_id or record.revision != chain.revision:
        raise _corrupt(where, rollout_id, "the frame and the record disagree on episode or revision")
    return record, data


class LogView:
    """Another process's log, read-only, tailed incrementally (its owner may still be appending)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.index = frames.LogIndex()
        self._read_to: dict[int, int] = {}

    def refresh(self) -> None:
        present = _segments(self.folder)
        if any(seq not in present for seq in self._read_to):  # compacted meanwhile: read it again
            self.index, self._read_to = frames.LogIndex(), {}
        for seq in present:
            try:
                with open(self.folder / _segment_name(seq), "rb") as f:
                    self._read_to[seq] = self._tail(seq, f.fileno(), self._read_to.get(seq, 0))
            except FileNotFoundError:
                self.index, self._read_to = frames.LogIndex(), {}
                return self.refresh()

    def _tail(self, seq: int, fd: int, start: int) -> int:
        """Feed the segment's frames from `start` (a frame boundary reached before); where the next read starts.

        Reads a chunk at a time, not to the end of the file: the owner's zeros ahead of its end
        would be read again at every refresh. A chunk is fed up to its last whole batch, so a
        batch a power cut tore is seen whole (`frames.batches`) and never fed; the rest of the
        file, once reached, is fed entire (an incomplete tail frame is read again next time).
        """
        size = _VIEW_READ
        while True:
            data = os.pread(fd, size, start)
            whole = len(data) < size
            closed, torn = frames.batches(data, start)
            usable = len(data) if whole else closed - start
            if torn is not None:
                usable = min(usable, torn - start)
            elif not usable:
                if data.count(0) == len(data):
                    return start  # the owner's zeros: nothing written since
                size *= 2  # a batch larger than the chunk (or damage): read on
                continue
            end = self.index.feed(seq, data[:usable], start)
            if whole or torn is not None or end == start:
                return end
            start, size = end, _VIEW_READ

    def ends(self) -> dict[int, int]:
        """Each segment read, and the offset its next read starts at (just past its last whole batch)."""
        return dict(self._read_to)

    def read(self, segment: int, offset: int, length: int) -> bytes:
        with open(self.folder / _segment_name(segment), "rb") as f:
            return os.pread(f.fileno(), length, offset)


@dataclass(slots=True)
class _Append:
    rollout_id: str
    kind: int
    frame: bytes
    version: int
    revision: int
    expires_ns: int
    size: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    error: BaseException | None = None
    settled: bool = False
    """Written (or failed) and known so on its event loop: set there, even if its caller gave up waiting."""
    then: Callable[[], None] | None = None
    """Run on its event loop once settled: a lease released meanwhile lets its episode go only then."""


@dataclass(slots=True)
class _Lookup:
    """A lease's question (where is this episode's record?) waiting for the I/O threads."""

    rollout_id: str
    legacy: str
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[_Source]
    source: _Source | None = None
    error: BaseException | None = None


@dataclass(slots=True)
class _Source:
    """Where an episode's current record is, as resolved when its lease was taken."""

    version: int = 0
    revision: int = 0
    chain: frames.Chain | None = None
    view: LogView | None = None
    """None: this process's own log."""
    legacy: str | None = None
    """A `FilesystemEpisodeStore` record file."""
    damaged: bool = False


class LogLease(EpisodeLease):
    def __init__(self, store: LogEpisodeStore, rollout_id: str, slot: int, source: _Source) -> None:
        self.store, self.rollout_id, self.slot, self.source = store, rollout_id, slot, source
        self._held = True
        self.base: fields.NativeState | fields.Values | None = None
        """The stored record (its bytes and per-field CRCs, or its fields where the C diff was not built) when
        it is the latest frame in this process's log: the next save's delta base."""
        self.deltas = 0
        self.last: _Append | None = None
        """This lease's latest frame handed to the commit thread (frames are written in order)."""
        self.pending: _PendingSave | None = None
        """A save begun and not yet awaited: the lease takes no other save or load until it is."""
        self.stamped: tuple[EpisodeCheckpoint, Any, tuple[int, int]] | None = None
        """The record last saved under the lease, its `updated_at` and the stamp written there: a save of the
        same record again reads neither its id nor its stamp (each upb field access is a name lookup)."""

    @property
    def held(self) -> bool:
        return self._held

    async def release(self) -> None:
        held, self._held = self._held, False
        self.base = None
        if not held:
            return
        last, self.last = self.last, None
        if last is not None and not last.settled:
            # Its caller was cancelled mid-save: the frame is still queued and will be written. Until it is,
            # another run must not read the episode without it and write the same version again.
            last.then = functools.partial(self.store.leases.release, self.slot)
        else:
            self.store.leases.release(self.slot)  # one non-blocking fcntl: no trip to the I/O threads


class _PendingSave(PendingSave):
    """A frame handed to the commit thread; awaited, the lease moves on to it (the next save's delta base)."""

    __slots__ = ("held", "item", "record", "state", "updated")

    def __init__(
        self,
        held: LogLease,
        record: EpisodeCheckpoint,
        item: _Append,
        state: fields.NativeState | fields.Values | None,
        updated: tuple[int, int],
    ) -> None:
        self.held, self.record, self.item, self.state, self.updated = held, record, item, state, updated

    def __await__(self) -> Generator[Any, None, None]:
        return self._wait().__await__()

    def abandon(self) -> None:
        if not self.item.future.done():
            self.item.future.add_done_callback(_drop_outcome)

    async def _wait(self) -> None:
        held, item = self.held, self.item
        if held.pending is not self:
            return await item.future  # awaited before: the same outcome again
        try:
            await item.future
        except BaseException:
            held.pending = held.stamped = None
            self.record.revision = item.revision - 1
            self.record.updated_at.seconds, self.record.updated_at.nanos = self.updated
            raise
        held.pending = None
        held.deltas = held.deltas + 1 if item.kind == frames.DELTA else 0
        held.base = self.state
        held.source = _Source(item.version, item.revision, held.store.index.chains.get(held.rollout_id))


def _check_idle(held: LogLease) -> None:
    if held.pending is not None:
        raise RuntimeError(f"the save begun for {held.rollout_id!r} was not awaited: await it first")


def _drop_outcome(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: no "never retrieved" warning for a save no one awaits


@dataclass
class LogStats(CommitStats):
    """CommitStats plus what the log adds."""

    full_frames: int = 0
    delta_frames: int = 0
    full_delays: int = 0
    """Batches that waited the whole commit delay (the others ended it early: no other save could come)."""
    compactions: int = 0
    zero_syncs: int = 0
    """Syncs of zeros written ahead of the log's end (counted in `fsyncs` too)."""


class LogEpisodeStore(EpisodeStore):
    """Episode records in an append-only, group-committed log per process, on a local (POSIX) filesystem.

    Args:
        root: folder of the store; created if missing.
        io_threads: threads for lease files, reads and archives.
        lease_retry_delay: seconds a refused caller is told to wait (`RetryInfo`).
        max_batch: most frames committed together.
        commit_delay: seconds a batch waits, after its first save, for more saves to join before it is
            written and synced (0: at once). It ends early once every lease held has a save waiting (no
            other save can come), so one episode alone never waits. A batch's sync, its wake-ups and the
            device's interrupts are most of a save's CPU, the servers' included: on a busy agent, 8 ms makes
            2.2x the saves per sync of 2 ms (`bench/README.md`, "A commit delay", "A longer commit delay").
        full_every: a FULL frame at least every this many deltas of an episode (bounds a load's reads);
            0 writes every boundary whole (no field split and diff: less CPU, more bytes).
        compact_min_bytes: the log is never compacted below this size ...
        compact_ratio: ... nor while it is below this many times its live records' bytes.
        zero_ahead: most bytes of zeros kept written and synced past the log's end (0: none), so a
            batch's sync overwrites them: it commits no new file size or block allocation to the
            filesystem's journal, which halves its latency and kernel CPU (`bench/README.md`, "A log
            zeroed ahead"). A young log zeros as much as it holds, so a small one stays small.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        io_threads: int = 8,
        lease_retry_delay: float = 1.0,
        max_batch: int = 4096,
        commit_delay: float = DEFAULT_COMMIT_DELAY,
        full_every: int = 32,
        compact_min_bytes: int = 64 << 20,
        compact_ratio: float = 3.0,
        zero_ahead: int = DEFAULT_ZERO_AHEAD,
    ) -> None:
        self.root = Path(root).absolute()
        self.episodes, self.archive_dir, self.logs = self.root / "episodes", self.root / "archive", self.root / "logs"
        self._episodes_prefix = f"{self.episodes}{os.sep}"
        self.lease_retry_delay, self.max_batch, self.full_every = lease_retry_delay, max_batch, full_every
        self.compact_min_bytes, self.compact_ratio = compact_min_bytes, compact_ratio
        if not 0 <= zero_ahead <= MAX_ZERO_AHEAD:
            raise ValueError(f"zero_ahead must be 0-{MAX_ZERO_AHEAD} bytes, got {zero_ahead}")
        self.zero_ahead = zero_ahead
        if not 0 <= commit_delay <= MAX_COMMIT_DELAY:
            raise ValueError(f"commit_delay must be 0-{MAX_COMMIT_DELAY} s, got {commit_delay}")
        self.commit_delay = commit_delay
        self.stats = LogStats()
        _create_folders(self.root, self.episodes, self.archive_dir, self.logs)
        self._claim_format()
        self.leases = ranges.RangeLocks(self.root / ranges.FOLDER)
        try:
            self.folder, self._owner_fd = self._adopt_or_create()
        except BaseException:
            self.leases.close()
            raise
        self.index = frames.LogIndex()
        self._fds: dict[int, int] = {}
        self._bytes = self._next_check = self._end = self._zeroed_to = 0
        self._zeroing_failed = False
        self._dsync = hasattr(os, "RWF_DSYNC")
        self._recover()
        self._views: dict[str, LogView] = {}
        self._views_lock = threading.Lock()
        self._lookups: list[_Lookup] = []
        self._lookups_lock = threading.Lock()
        self._looking = False
        self._segments_lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Append | None] = queue.SimpleQueue()
        self._handed = itertools.count(1)
        """Saves handed to the commit thread so far (`next` is atomic: any event loop's thread may hand over)."""
        self._written = 0
        """Saves the commit thread has written (or failed) so far; only that thread changes it."""
        self._gate = threading.Lock()
        """Locked while a batch may still grow; released when every lease held has a save waiting."""
        self._gate.acquire()
        self._broken: BaseException | None = None
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix=IO_THREADS)
        self._thread = threading.Thread(target=self._run, name=COMMIT_THREAD, daemon=True)
        self._thread.start()

    # -- opening -----------------------------------------------------------------------------

    def _claim_format(self) -> None:
        """Mark the folder format 2, then refuse it if a format-1 agent is alive on it (see the module doc)."""
        marker = self.logs / SCHEME / OWNER
        if not marker.is_dir():
            marker.mkdir(parents=True, exist_ok=True)
            fsync_folder(marker.parent)
            fsync_folder(self.logs)
        for name in _log_names(self.logs):
            try:
                fd = os.open(self.logs / name / OWNER, os.O_RDWR | os.O_CLOEXEC)
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    continue  # its owner is gone
                except BlockingIOError:
                    pass
                if not ranges.held_elsewhere(fd, 0):
                    raise FailedPrecondition(
                        f"an agent of an older version (format 1: a lock file per episode) is appending to the log "
                        f"{self.logs / name} in {self.root}; agents of the two formats would not keep each other off "
                        "an episode: stop it (or upgrade it) before starting this one",
                        metadata={"path": str(self.logs / name)},
                    )
            finally:
                os.close(fd)

    def _adopt_or_create(self) -> tuple[Path, int]:
        """A log whose owner is gone (its locks are free), else a new one; its owner locks, held.

        The OFD lock on byte 0 is taken before the flock and released after it, so whoever
        sees the flock of a format-2 owner held also sees its OFD lock (`_claim_format`).
        """
        for name in _log_names(self.logs):
            folder = self.logs / name
            try:
                fd = os.open(folder / OWNER, os.O_RDWR | os.O_CLOEXEC)
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                continue
            if not ranges.try_lock(fd, 0):
                os.close(fd)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            log.info("episode log adopted", extra={"log": str(folder)})
            return folder, fd
        folder = self.logs / f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        temp = self.logs / f".{folder.name}.new"
        temp.mkdir()
        fd = os.open(temp / OWNER, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if not ranges.try_lock(fd, 0):
            raise RuntimeError(f"a new log's owner lock {temp / OWNER} is locked by someone else")
        fcntl.flock(fd, fcntl.LOCK_EX)
        fsync_folder(temp)
        os.rename(temp, folder)  # a log folder appears whole, owner lock included
        fsync_folder(self.logs)
        return folder, fd

    def _recover(self) -> None:
        """Scan this log; cut a torn tail off, drop an unfinished compaction, delete segments it replaced."""
        seqs = _segments(self.folder)
        ends: dict[int, int] = {}
        for seq in seqs:
            data = (self.folder / _segment_name(seq)).read_bytes()
            torn = frames.torn_batch(data) if seq == seqs[-1] else None
            end = ends[seq] = self.index.feed(seq, data if torn is None else data[:torn])
            if seq == seqs[-1] and end < len(data):
                if torn is not None or data.count(0, end) < len(data) - end:  # more than the zeros written ahead
                    log.warning(
                        "episode log: torn tail cut off",
                        extra={"log": str(self.folder), "segment": seq, "bytes": len(data) - end},
                    )
                with open(self.folder / _segment_name(seq), "r+b") as f:
                    f.truncate(end)
                    os.fsync(f.fileno())
        if self.index.compaction_segment is not None:
            unfinished = self.index.compaction_segment
            self.index.abandon_compaction()
            _unlink(self.folder / _segment_name(unfinished))
            fsync_folder(self.folder)
            seqs = [s for s in seqs if s != unfinished]
        live_from = self._compacted_from(seqs)
        for seq in [s for s in seqs if s < live_from]:
            _unlink(self.folder / _segment_name(seq))
        seqs = [s for s in seqs if s >= live_from]
        if self.index.damage or self.index.damaged:
            log.error(
                "episode log: damaged frames found; the episodes they held answer DATA_LOSS",
                extra={
                    "log": str(self.folder),
                    "regions": self.index.damage[:10],
                    "episodes": list(self.index.damaged)[:10],
                },
            )
        while len(seqs) > 1 and os.path.getsize(self.folder / _segment_name(seqs[-1])) == 0:
            _unlink(self.folder / _segment_name(seqs.pop()))  # a compaction that died before its first byte
        if not seqs:
            seqs = [0]
        for seq in seqs:
            self._fds[seq] = os.open(self.folder / _segment_name(seq), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._end = ends.get(seq, 0)
            self._bytes += self._end
        self._seq = seqs[-1]
        self._zeroed_to = self._end
        fsync_folder(self.folder)

    def _compacted_from(self, seqs: list[int]) -> int:
        """The newest segment that begins a finished compaction (everything before it is garbage)."""
        for seq in reversed(seqs):
            with open(self.folder / _segment_name(seq), "rb") as f:
                head = f.read(frames.HEADER_SIZE)
            frame = frames.frame_at(head, 0)
            if frame is not None and frame.kind == frames.COMPACT_BEGIN:
                return seq
        return seqs[0] if seqs else 0

    # -- helpers -----------------------------------------------------------------------------

    def _paths(self, rollout_id: str) -> tuple[str, str]:
        """The episode's key and where `FilesystemEpisodeStore` keeps (kept) its record."""
        key = hashlib.sha256(check_id(rollout_id, "episode_id.rollout_id").encode()).hexdigest()
        return key, f"{self._episodes_prefix}{key[:2]}{os.sep}{key}.ckpt"  # a str: a Path per lease costs more

    async def _io(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _read_own(self, segment: int, offset: int, length: int) -> bytes:
        with self._segments_lock:
            return os.pread(self._fds[segment], length, offset)  # KeyError: the segment was compacted away

    def _refresh_views(self) -> list[LogView]:
        with self._views_lock:
            for name in os.listdir(self.logs):
                folder = self.logs / name
                if name.startswith((".", "!")) or folder == self.folder or name in self._views:
                    continue
                self._views[name] = LogView(folder)
            for view in self._views.values():
                view.refresh()
            return list(self._views.values())

    def _resolve(self, rollout_id: str, legacy: str, views: list[LogView] | None = None) -> _Source:
        """The newest write of the episode across this log, every other log of the folder and a legacy file.

        `views`: the other logs, refreshed after the episode's lease was taken (default: refreshed here).
        """
        best = _Source()
        candidates: list[tuple[frames.LogIndex, LogView | None]] = [(self.index, None)]
        candidates += [(view.index, view) for view in (self._refresh_views() if views is None else views)]
        for index, view in candidates:
            chains, damaged = index.settled()
            chain = chains.get(rollout_id)
            if chain is not None and chain.version > best.version:
                best = _Source(chain.version, chain.revision, chain, view)
            lost = damaged.get(rollout_id, 0)
            if lost > best.version:
                best = _Source(lost, 0, None, view, damaged=True)
        try:
            header = _read_header(legacy)
        except DataLoss:
            return best if best.version else _Source(damaged=True, legacy=legacy)
        if header is not None and header.revision > best.version:
            best = _Source(header.revision, header.revision, None, None, legacy=legacy)
        return best

    # -- leases ------------------------------------------------------------------------------

    async def acquire(self, rollout_id: str) -> LogLease:
        key, legacy = self._paths(rollout_id)
        if self._closed:
            raise RuntimeError("the store is closed")
        at = ranges.slot(key)
        if not self.leases.take(at):  # one non-blocking fcntl, here on the caller's thread
            raise Aborted(
                f"episode {rollout_id!r} is being run by another call (its lease is held); retry after it finishes",
                reason="LEASE_HELD",
                metadata={"rollout_id": rollout_id},
                retry_delay=self.lease_retry_delay,
            )
        try:
            source = self._look_up_alone(rollout_id, legacy) or await self._look_up(rollout_id, legacy)
        except BaseException:
            self.leases.release(at)
            raise
        return LogLease(self, rollout_id, at, source)

    def _look_up_alone(self, rollout_id: str, legacy: str) -> _Source | None:
        """`_resolve` right here while this log is the folder's only one (a folder listing and a legacy
        file probe, a few microseconds of system calls), else None: a trip to the I/O threads costs the
        event loop more than that (a wake-up, the GIL handed over and back). Other logs' tails can be
        megabytes to read, so with any, the lookup goes to the threads."""
        if self._views or any(n != self.folder.name for n in _log_names(self.logs)):
            return None
        return self._resolve(rollout_id, legacy, [])

    async def _look_up(self, rollout_id: str, legacy: str) -> _Source:
        """`_resolve` in the I/O threads; the leases taken meanwhile share one trip and one refresh of the other logs.

        A trip to the threads costs more CPU than the lookup (about 80 us against 15-30 us measured on
        tmpfs), and 512 episodes in flight start their leases in bursts: so, as saves share an fsync,
        lookups share a trip. Every lookup of a trip was queued before its refresh, so after its lease.
        """
        loop = asyncio.get_running_loop()
        item = _Lookup(rollout_id, legacy, loop, loop.create_future())
        with self._lookups_lock:
            self._lookups.append(item)
            start, self._looking = not self._looking, True
        if start:
            try:
                self._pool.submit(self._run_lookups)
            except BaseException:
                with self._lookups_lock:
                    self._lookups.remove(item)
                    self._looking = False
                raise
        return await item.future

    def _run_lookups(self) -> None:
        while True:
            with self._lookups_lock:
                batch, self._lookups = self._lookups, []
                if not batch:
                    self._looking = False
                    return
            try:
                views: list[LogView] | None = self._refresh_views()
                failed: BaseException | None = None
            except Exception as exc:
                views, failed = None, exc
            for item in batch:
                if failed is not None or views is None:
                    item.error = failed
                    continue
                try:
                    item.source = self._resolve(item.rollout_id, item.legacy, views)
                except Exception as exc:
                    item.error = exc
            by_loop: dict[asyncio.AbstractEventLoop, list[_Lookup]] = {}
            for item in batch:
                by_loop.setdefault(item.loop, []).append(item)
            for loop, items in by_loop.items():
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_answer, items)

    def _check(self, lease: EpisodeLease) -> LogLease:
        if not isinstance(lease, LogLease) or lease.store is not self or not lease.held:
            raise FailedPrecondition("the episode lease is not held on this store")
        return lease

    def _damaged(self, held: LogLease) -> DataLoss:
        where = str(held.source.view.folder if held.source.view else self.folder)
        return _corrupt(where, held.rollout_id, f"write {held.source.version} was lost to a damaged log region")

    # -- records -----------------------------------------------------------------------------

    async def load(self, lease: EpisodeLease) -> EpisodeCheckpoint | None:
        held = self._check(lease)
        _check_idle(held)
        source = held.source
        if not source.damaged and source.legacy is None and (source.chain is None or source.chain.deleted):
            return None  # nothing stored (a new episode): no trip to the I/O threads
        record = await self._io(self._load, held)
        if record is None:
            return None
        expires = codec.expires_at_ns(record)
        if expires and expires <= time.time_ns():
            await self._delete(held)
            log.info("expired episode record deleted", extra={"rollout_id": held.rollout_id})
            return None
        return record

    def _load(self, held: LogLease) -> EpisodeCheckpoint | None:
        source = held.source
        if source.damaged:
            raise self._damaged(held)
        if source.legacy is not None:
            data = _read(source.legacy)
            return None if data is None else codec.decode(data, source.legacy, held.rollout_id)
        if source.chain is None or source.chain.deleted:
            return None
        if source.view is None:
            try:
                record, data = _record_from(source.chain, self._read_own, str(self.folder), held.rollout_id)
            except (KeyError, DataLoss):  # compacted since the lease resolved it: its frames moved
                fresh = self.index.chains.get(held.rollout_id)
                if fresh is None or fresh.version != source.version:
                    raise
                held.source = _Source(source.version, source.revision, fresh)
                record, data = _record_from(fresh, self._read_own, str(self.folder), held.rollout_id)
            held.base, held.deltas = (_DIFFER.values(data) if self.full_every else None), len(source.chain.frames) - 1
            return record
        view = source.view
        try:
            return _record_from(source.chain, view.read, str(view.folder), held.rollout_id)[0]
        except (FileNotFoundError, DataLoss):
            held.source = self._resolve(held.rollout_id, source.legacy or self._paths(held.rollout_id)[1])
            if held.source.view is not view or held.source.chain is None:
                return self._load(held)
            return _record_from(held.source.chain, view.read, str(view.folder), held.rollout_id)[0]

    async def save(self, lease: EpisodeLease, record: EpisodeCheckpoint) -> None:
        await self._begin_save(lease, record)

    async def begin_save(self, lease: EpisodeLease, record: EpisodeCheckpoint) -> PendingSave:
        return self._begin_save(lease, record)

    def _begin_save(self, lease: EpisodeLease, record: EpisodeCheckpoint) -> _PendingSave:
        """The frame built and handed to the commit thread, at once (the event loop's thread encodes it)."""
        held = self._check(lease)
        stamped = held.stamped
        if stamped is not None and stamped[0] is record:
            stamp, updated = stamped[1], stamped[2]
        else:
            if record.episode_id.rollout_id != held.rollout_id:
                raise InvalidArgument(
                    f"a record of {record.episode_id.rollout_id!r} cannot be saved under the lease of "
                    f"{held.rollout_id!r}"
                )
            stamp = record.updated_at
            updated = stamp.seconds, stamp.nanos  # plain ints: a Timestamp copy costs more than the frame
        if held.source.damaged:
            raise self._damaged(held)
        _check_idle(held)
        expected, stored = record.revision, held.source.revision
        if held.source.chain is not None and held.source.chain.deleted:
            stored = 0
        if stored != expected:
            raise Aborted(
                f"episode {held.rollout_id!r} was saved by someone else: stored revision {stored}, this save "
                f"replaces revision {expected}; nothing was written",
                reason="CHECKPOINT_CONFLICT",
                metadata={
                    "rollout_id": held.rollout_id,
                    "stored_revision": str(stored),
                    "expected_revision": str(expected),
                },
            )
        revision, now = expected + 1, divmod(time.time_ns(), 1_000_000_000)
        record.revision = revision
        stamp.seconds, stamp.nanos = now
        try:
            data = record.SerializeToString(deterministic=True)
            state = _DIFFER.values(data, serialized=True) if self.full_every else None
            version, expires = held.source.version + 1, codec.expires_at_ns(record)
            kind, payload = frames.FULL, data
            if state is not None and held.base is not None and held.deltas < self.full_every:
                delta, crc = _DIFFER.diff(held.base, state)  # type: ignore[arg-type]
                # else a FULL frame: fewer reads at load, little more written
                if delta is not None and len(delta) + 4 < len(data) * 3 // 4:
                    crc = zlib.crc32(data) if crc is None else crc
                    kind, payload = frames.DELTA, frames.encode_delta_payload(crc, delta)
            frame = frames.encode(
                kind, held.rollout_id, payload, version=version, revision=revision, expires_ns=expires
            )
            item = self._append_nowait(held, kind, frame, version, revision, expires, len(data))
        except BaseException:
            held.stamped = None
            record.revision = expected
            stamp.seconds, stamp.nanos = updated
            raise
        held.stamped = (record, stamp, now)
        held.pending = _PendingSave(held, record, item, state, updated)
        return held.pending

    async def _delete(self, held: LogLease) -> None:
        """A tombstone newer than every write of the episode (a legacy file is unlinked as well)."""
        version = held.source.version + 1
        frame = frames.encode(frames.TOMBSTONE, held.rollout_id, version=version)
        await self._append(held, frames.TOMBSTONE, frame, version, 0, 0, 0)
        if held.source.legacy is not None:
            await self._io(_unlink, held.source.legacy)
        held.source, held.base = _Source(version, 0, self.index.chains.get(held.rollout_id)), None

    async def delete(self, lease: EpisodeLease) -> bool:
        held = self._check(lease)
        _check_idle(held)
        source = held.source
        if not source.damaged and source.legacy is None and (source.chain is None or source.chain.deleted):
            return False
        await self._delete(held)  # newer than the lost write too: a damaged episode's next run starts over
        log.info("episode record deleted", extra={"rollout_id": held.rollout_id})
        return True

    async def archive(self, lease: EpisodeLease, reason: str) -> str | None:
        held = self._check(lease)
        _check_idle(held)
        if not REASON.fullmatch(reason):
            raise InvalidArgument(f"archive reason {reason!r} must match {REASON.pattern}")
        record = await self._io(self._load, held)
        if record is None:
            return None
        key = self._paths(held.rollout_id)[0]
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
        target = self.archive_dir / f"{key}.{stamp}.{reason}.ckpt"
        await self._io(_write_new_file, target, codec.encode(record))
        log.info("episode record archived", extra={"rollout_id": held.rollout_id, "reason": reason})
        return str(target)

    async def delete_expired(self, now: float | None = None) -> int:
        cutoff = time.time_ns() if now is None else int(now * 1e9)
        expired = [
            rid
            for rid, c in list(self.index.chains.items())
            if not c.deleted and c.expires_ns and c.expires_ns <= cutoff
        ]
        deleted = 0
        for rollout_id in expired:
            try:
                lease = await self.acquire(rollout_id)
            except Aborted:
                continue  # in use: its holder decides
            try:
                source = lease.source
                if source.view is not None or source.chain is None or source.chain.deleted or source.damaged:
                    continue  # written elsewhere since (or damaged): not this log's to expire
                if source.chain.expires_ns and source.chain.expires_ns <= cutoff:
                    await self._delete(lease)
                    deleted += 1
            finally:
                await lease.release()
        legacy = await asyncio.gather(*(self._io(_sweep, self.episodes / f"{i:02x}", cutoff) for i in range(256)))
        return deleted + sum(legacy)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self._pool.shutdown(wait=False)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        os.close(self._owner_fd)
        self.leases.close()

    # -- the commit thread -------------------------------------------------------------------

    async def _append(
        self, held: LogLease, kind: int, frame: bytes, version: int, revision: int, expires: int, size: int
    ) -> None:
        await self._append_nowait(held, kind, frame, version, revision, expires, size).future

    def _append_nowait(
        self, held: LogLease, kind: int, frame: bytes, version: int, revision: int, expires: int, size: int
    ) -> _Append:
        if self._closed:
            raise RuntimeError("the store is closed")
        if self._broken is not None:
            raise self._unavailable()
        loop = asyncio.get_running_loop()
        item = _Append(held.rollout_id, kind, frame, version, revision, expires, size, loop, loop.create_future())
        held.last = item
        self._queue.put(item)
        if self.commit_delay and next(self._handed) - self._written >= self.leases.count() and self._gate.locked():
            with contextlib.suppress(RuntimeError):  # released meanwhile from another event loop's thread
                self._gate.release()  # no other save can come: the batch waits no longer
        return item

    def _unavailable(self) -> Unavailable:
        return Unavailable(
            f"the episode log {self.folder} failed a write ({self._broken}); its durability is unknown, so this "
            "agent saves nothing more: restart it (the log is recovered on start)",
            metadata={"path": str(self.folder)},
        )

    def _run(self) -> None:
        stop = False
        while not stop:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            if self.commit_delay and not self._gate.acquire(timeout=self.commit_delay):  # locked again either way
                self.stats.full_delays += 1
            while len(batch) < self.max_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
            self._commit(batch)
            if not stop and self._broken is None and self._should_compact():
                try:
                    self._compact()
                except Exception as exc:
                    log.exception("episode log compaction failed; the old segments are kept")
                    self.stats.failures += 1
                    del exc
            if not stop and self._broken is None and self.zero_ahead:
                self._zero_ahead()

    def _commit(self, batch: list[_Append]) -> None:
        error: BaseException | None = self._unavailable() if self._broken is not None else None
        if error is None:
            seq, fd, start = self._seq, self._fds[self._seq], self._end
            commit = frames.encode_commit([(a.rollout_id, a.version) for a in batch])
            try:
                size = self._write_durably(fd, [*(a.frame for a in batch), commit], start)
            except OSError as exc:
                self._broken = exc
                error = self._unavailable()  # this batch's saves too: clear words, not a bare OSError
                error.__cause__ = exc
                log.error("episode log write failed; no more saves", extra={"log": str(self.folder), "error": str(exc)})
            else:
                self.stats.batches += 1
                self.stats.fsyncs += 1
                self.stats.writes += len(batch)
                self.stats.bytes += size
                self._bytes += size
                self._end = start + size
                offset, place = start, self.index.place  # no Frame per save: the fields are at hand
                for a in batch:
                    length = len(a.frame)
                    place(seq, a.kind, a.rollout_id, a.version, a.revision, a.expires_ns, offset, length, a.size)
                    offset += length
                self.stats.full_frames += sum(a.kind == frames.FULL for a in batch)
                self.stats.delta_frames += sum(a.kind == frames.DELTA for a in batch)
                self.index.apply(seq, frames.Frame(frames.COMMIT, "", 0, 0, 0, offset, len(commit), b""))
        if error is not None:
            self.stats.failures += len(batch)
            for a in batch:
                a.error = error
        self._written += len(batch)  # before they are settled: a save after that is a new one
        by_loop: dict[asyncio.AbstractEventLoop, list[_Append]] = {}
        for a in batch:
            by_loop.setdefault(a.loop, []).append(a)
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, items)

    def _write_durably(self, fd: int, chunks: list[bytes], offset: int) -> int:
        """`chunks` at `offset`, on the disk when this returns; their size. One `pwritev2(RWF_DSYNC)` (the
        write and its `fdatasync` in one system call, so the commit thread takes the GIL back once, not three
        times: every hand-over costs the event loop's thread futex calls), else `pwritev` + `fdatasync`."""
        if len(chunks) > _IOV_MAX:
            chunks = [b"".join(chunks)]
        size = total = sum(map(len, chunks))
        while total:
            if self._dsync:
                try:
                    written = os.pwritev(fd, chunks, offset, os.RWF_DSYNC)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    self._dsync = False  # a filesystem without per-write flags
                    continue
            else:
                written = os.pwritev(fd, chunks, offset)
                os.fdatasync(fd)
            if written <= 0:
                raise OSError(errno.EIO, "the write made no progress")
            total -= written
            offset += written
            if total:  # a short write (rare: a signal, a full disk): the rest, as its own durable write
                chunks = [b"".join(chunks)[written:]]
        return size

    def _zero_ahead(self) -> None:
        """Keep zeros written and synced past the end, as many as the segment holds (at most `zero_ahead`),
        topped up once half are used. Runs between batches: no batch waits for it, and none writes meanwhile."""
        want = min(self.zero_ahead, max(self._end, frames.SECTOR * 128))
        if self._zeroed_to - self._end >= want // 2:
            return
        fd, start, stop = self._fds[self._seq], max(self._zeroed_to, self._end), self._end + want
        try:
            while start < stop:
                start += os.pwrite(fd, _ZEROS[: min(_PAGE - start % _PAGE, stop - start)], start)
            os.fdatasync(fd)
        except OSError as exc:  # a full disk: batches still append (their syncs are slower), and say so once
            if not self._zeroing_failed:
                log.warning("episode log: zeroing ahead failed", extra={"log": str(self.folder), "error": str(exc)})
            self._zeroing_failed = True
            return
        self._zeroing_failed = False
        self._zeroed_to = stop
        self.stats.fsyncs += 1
        self.stats.zero_syncs += 1

    @property
    def log_size(self) -> int:
        """Bytes of the log's current segment written so far (its file also holds the zeros written ahead)."""
        return self._end

    def _live_bytes(self) -> int:
        return sum(c.size + frames.HEADER_SIZE for c in self.index.chains.values() if not c.deleted)

    def _should_compact(self) -> bool:
        """Checked after every batch; the live bytes are summed only each time the log grew by a tenth."""
        if self._bytes < max(self.compact_min_bytes, self._next_check):
            return False
        if self._bytes >= self.compact_ratio * self._live_bytes():
            return True
        self._next_check = int(self._bytes * 1.1)
        return False

    def _compact(self) -> None:
        """Write the live records into a new segment; delete the old ones once it is durable."""
        seq = self._seq + 1
        path = self.folder / _segment_name(seq)
        others = self._refresh_views()
        newest_elsewhere: dict[str, int] = {}
        for view in others:
            for rid, chain in view.index.settled()[0].items():
                newest_elsewhere[rid] = max(chain.version, newest_elsewhere.get(rid, 0))
        chunks = [frames.encode(frames.COMPACT_BEGIN, version=seq)]
        index = frames.LogIndex()
        index.apply(seq, frames.Frame(frames.COMPACT_BEGIN, "", seq, 0, 0, 0, len(chunks[0]), b""))
        offset = len(chunks[0])
        chains, damaged = self.index.chains, self.index.damaged
        for rid, chain in list(chains.items()):
            elsewhere = newest_elsewhere.get(rid, 0)
            if elsewhere > chain.version:
                continue  # taken over by another process: its log has the record
            if chain.deleted:
                if not elsewhere and not os.path.exists(self._paths(rid)[1]):
                    continue  # nothing older anywhere for the tombstone to hide
                frame = frames.encode(frames.TOMBSTONE, rid, version=chain.version)
                kind, size = frames.TOMBSTONE, 0
            else:
                try:
                    _, data = _record_from(chain, self._read_own, str(self.folder), rid)  # the very bytes saved
                except DataLoss:
                    damaged[rid] = chain.version
                    continue
                frame = frames.encode(
                    frames.FULL, rid, data, version=chain.version, revision=chain.revision, expires_ns=chain.expires_ns
                )
                kind, size = frames.FULL, len(data)
            written = frames.Frame(kind, rid, chain.version, chain.revision, chain.expires_ns, offset, len(frame), b"")
            index.apply(seq, written, size)
            chunks.append(frame)
            offset += len(frame)
        for rid, version in damaged.items():
            frame = frames.encode(frames.DAMAGED, rid, version=version)
            index.apply(seq, frames.Frame(frames.DAMAGED, rid, version, 0, 0, offset, len(frame), b""))
            chunks.append(frame)
            offset += len(frame)
        end = frames.encode(frames.COMPACT_END, version=seq)
        chunks.append(end)
        index.apply(seq, frames.Frame(frames.COMPACT_END, "", seq, 0, 0, offset, len(end), b""))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            data = b"".join(chunks)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fdatasync(fd)
            fsync_folder(self.folder)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        with self._segments_lock:
            old = self._fds
            self._fds, self._seq, self.index = {seq: fd}, seq, index
            self._bytes = self._end = self._zeroed_to = len(data)
        for old_seq, old_fd in old.items():
            os.close(old_fd)
            _unlink(self.folder / _segment_name(old_seq))
        fsync_folder(self.folder)
        self.stats.compactions += 1
        self.stats.fsyncs += 3
        log.info("episode log compacted", extra={"log": str(self.folder), "bytes": len(data), "segment": seq})


def _answer(items: list[_Lookup]) -> None:
    for item in items:
        if item.future.done():
            continue  # the caller gave up (cancelled): its acquire releases the lease
        if item.error is not None:
            item.future.set_exception(item.error)
        else:
            item.future.set_result(item.source if item.source is not None else _Source())


def _settle(items: list[_Append]) -> None:
    for a in items:
        a.settled = True
        if a.then is not None:
            a.then()
        if a.future.done():
            continue
        if a.error is None:
            a.future.set_result(None)
        else:
            a.future.set_exception(a.error)


def _log_names(logs: Path) -> list[str]:
    """The log folders in root/logs (not the format marker, not a log still being created)."""
    return sorted(n for n in os.listdir(logs) if not n.startswith((".", "!")))


def _create_folders(root: Path, episodes: Path, *others: Path) -> None:
    created = False
    for folder in (root, episodes, *others):
        if not folder.is_dir():
            folder.mkdir(parents=True, exist_ok=True)
            created = True
    for i in range(256):
        shard = episodes / f"{i:02x}"
        if not shard.is_dir():
            shard.mkdir(exist_ok=True)
            created = True
    if created:
        for folder in (episodes, root, root.parent):
            fsync_folder(folder)


def _write_new_file(target: Path, data: bytes) -> None:
    """Durably create `target` (which must not exist) with `data`: temp, fsync, link, fsync the folder."""
    temp = target.with_name(f".{target.name}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fdatasync(fd)
    finally:
        os.close(fd)
    try:
        os.link(temp, target)  # refuses an existing name
    finally:
        _unlink(temp)
    fsync_folder(target.parent)
