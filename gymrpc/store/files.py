"""`FilesystemEpisodeStore`: one file per episode under a root folder, leases by `flock`.

Layout (`k` = sha256 of the validated rollout id, so no request text ever becomes a path):

    root/episodes/<k[:2]>/<k>.ckpt      the record (see `codec`)
    root/episodes/<k[:2]>/<k>.lock      the lease: flock(LOCK_EX) on this file
    root/archive/<k>.<UTC time>.<reason>.ckpt   a copy kept when a record is replaced (for example a policy change)

Leases are advisory locks the kernel drops when their holder dies, so a SIGKILLed
agent never leaves an episode locked. Every blocking call (open, flock, read, unlink)
runs in a thread pool; writes go through the group committer.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from google.protobuf import timestamp_pb2

from gymrpc.durable import fsync_folder
from gymrpc.errors import Aborted, FailedPrecondition, GymrpcError, InvalidArgument
from gymrpc.ids import check_id
from gymrpc.store import codec, ranges
from gymrpc.store.base import IO_THREADS, EpisodeCheckpoint, EpisodeLease, EpisodeStore
from gymrpc.store.commit import CommitStats, GroupCommitter, SyncMode

log = logging.getLogger(__name__)
T = TypeVar("T")
REASON = re.compile(r"[a-z][a-z0-9_]{0,31}")
LOCK_ATTEMPTS = 20


class LeaseHeld(Exception):
    """Raised inside the pool when the lock is taken; turned into ABORTED `LEASE_HELD`."""


@dataclass(frozen=True)
class _Paths:
    key: str
    record: Path
    lock: Path
    temp: Path


class FileLease(EpisodeLease):
    def __init__(self, store: FilesystemEpisodeStore, rollout_id: str, paths: _Paths, fd: int) -> None:
        self.store, self.rollout_id, self.paths = store, rollout_id, paths
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    async def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor drops the flock; never blocks


class FilesystemEpisodeStore(EpisodeStore):
    """Episode records on a local (POSIX) filesystem.

    Args:
        root: folder of the store; created if missing.
        committer: the group committer (default: a new one with `sync`).
        io_threads: threads for reads, locks and deletes.
        lease_retry_delay: seconds a refused caller is told to wait (`RetryInfo`).
    """

    def __init__(
        self,
        root: str | Path,
        *,
        committer: GroupCommitter | None = None,
        sync: SyncMode = "file",
        io_threads: int = 8,
        lease_retry_delay: float = 1.0,
    ) -> None:
        self.root = Path(root).absolute()
        self.episodes, self.archive_dir = self.root / "episodes", self.root / "archive"
        self.lease_retry_delay = lease_retry_delay
        if (self.root / "logs" / ranges.MARKER).exists():
            raise FailedPrecondition(
                f"{self.root} is the folder of a log store (--resume-store log) whose leases this store would not "
                "see, and whose records it would not read: run the log store on it, or give this store another folder",
                metadata={"path": str(self.root)},
            )
        self._create_folders()
        self.committer = committer or GroupCommitter(sync=sync, root=self.root)
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix=IO_THREADS)

    def _create_folders(self) -> None:
        """All 256 shards up front, made durable once, so saves never create folders."""
        created = False
        for folder in (self.root, self.episodes, self.archive_dir):
            if not folder.is_dir():
                folder.mkdir(parents=True, exist_ok=True)
                created = True
        for i in range(256):
            shard = self.episodes / f"{i:02x}"
            if not shard.is_dir():
                shard.mkdir(exist_ok=True)
                created = True
        if created:
            for folder in (self.episodes, self.root, self.root.parent):
                fsync_folder(folder)

    @property
    def stats(self) -> CommitStats:
        return self.committer.stats

    def paths(self, rollout_id: str) -> _Paths:
        key = hashlib.sha256(check_id(rollout_id, "episode_id.rollout_id").encode()).hexdigest()
        shard = self.episodes / key[:2]
        return _Paths(key, shard / f"{key}.ckpt", shard / f"{key}.lock", shard / f".{key}.ckpt.tmp")

    async def _io(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # -- leases ------------------------------------------------------------------------------

    async def acquire(self, rollout_id: str) -> FileLease:
        paths = self.paths(rollout_id)
        try:
            fd = await self._io(_lock, paths.lock, paths.temp)
        except LeaseHeld:
            raise Aborted(
                f"episode {rollout_id!r} is being run by another call (its lease is held); retry after it finishes",
                reason="LEASE_HELD",
                metadata={"rollout_id": rollout_id},
                retry_delay=self.lease_retry_delay,
            ) from None
        return FileLease(self, rollout_id, paths, fd)

    def _check(self, lease: EpisodeLease) -> FileLease:
        if not isinstance(lease, FileLease) or lease.store is not self or not lease.held:
            raise FailedPrecondition("the episode lease is not held on this store")
        return lease

    # -- records -----------------------------------------------------------------------------

    async def load(self, lease: EpisodeLease) -> EpisodeCheckpoint | None:
        held = self._check(lease)
        data = await self._io(_read, held.paths.record)
        if data is None:
            return None
        record = codec.decode(data, held.paths.record, held.rollout_id)
        expires = codec.expires_at_ns(record)
        if expires and expires <= time.time_ns():
            await self._io(_unlink, held.paths.record)
            log.info("expired episode record deleted", extra={"rollout_id": held.rollout_id})
            return None
        return record

    async def save(self, lease: EpisodeLease, record: EpisodeCheckpoint) -> None:
        held = self._check(lease)
        if record.episode_id.rollout_id != held.rollout_id:
            raise InvalidArgument(
                f"a record of {record.episode_id.rollout_id!r} cannot be saved under the lease of {held.rollout_id!r}"
            )
        expected = record.revision
        updated = timestamp_pb2.Timestamp()
        updated.CopyFrom(record.updated_at)
        record.revision = expected + 1
        record.updated_at.FromNanoseconds(time.time_ns())
        try:
            data = codec.encode(record)
            path = held.paths.record
            await self.committer.write(path, data, lambda: _check_revision(path, expected, held.rollout_id))
        except BaseException:
            record.revision = expected
            record.updated_at.CopyFrom(updated)
            raise

    async def archive(self, lease: EpisodeLease, reason: str) -> str | None:
        held = self._check(lease)
        if not REASON.fullmatch(reason):
            raise InvalidArgument(f"archive reason {reason!r} must match {REASON.pattern}")
        data = await self._io(_read, held.paths.record)
        if data is None:
            return None
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
        target = self.archive_dir / f"{held.paths.key}.{stamp}.{reason}.ckpt"
        await self.committer.write(target, data, lambda: _refuse_existing(target))
        log.info("episode record archived", extra={"rollout_id": held.rollout_id, "reason": reason})
        return str(target)

    async def delete(self, lease: EpisodeLease) -> bool:
        held = self._check(lease)
        if not await self._io(_remove_durably, held.paths.record):
            return False
        log.info("episode record deleted", extra={"rollout_id": held.rollout_id})
        return True

    async def delete_expired(self, now: float | None = None) -> int:
        cutoff = time.time_ns() if now is None else int(now * 1e9)
        counts = await asyncio.gather(*(self._io(_sweep, self.episodes / f"{i:02x}", cutoff) for i in range(256)))
        return sum(counts)

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.committer.close)
        self._pool.shutdown(wait=False)


# -- blocking helpers (run in the pool) -------------------------------------------------------


def _lock(path: Path, stale_temp: Path | None = None) -> int:
    """A descriptor of `path` holding flock(LOCK_EX); LeaseHeld if another descriptor holds it.

    The lock file can be unlinked by an expiry sweep between our open and our flock; then
    we hold a lock on a dead inode, so check the name still points at it and retry if not.
    Once locked, `stale_temp` is removed: a temp file under a free lease is the leftover of
    a writer that died before its rename.
    """
    for _ in range(LOCK_ATTEMPTS):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LeaseHeld from None
        except BaseException:
            os.close(fd)
            raise
        mine = os.fstat(fd)
        try:
            current = os.stat(path)
            if (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
                if stale_temp is not None:
                    _unlink(stale_temp)
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise OSError(errno.EAGAIN, f"lock file {path} keeps being replaced")


def _read(path: Path | str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _unlink(path: Path | str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _remove_durably(path: Path) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    fsync_folder(path.parent)
    return True


def _read_header(path: Path | str) -> codec.Header | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        return codec.decode_header(os.read(fd, codec.HEADER_SIZE), path)
    finally:
        os.close(fd)


def _check_revision(path: Path | str, expected: int, rollout_id: str) -> None:
    """The revision guard, run by the committer right before the rename."""
    header = _read_header(path)
    stored = 0 if header is None else header.revision
    if stored != expected:
        raise Aborted(
            f"episode {rollout_id!r} was saved by someone else: stored revision {stored}, this save replaces "
            f"revision {expected}; nothing was written",
            reason="CHECKPOINT_CONFLICT",
            metadata={"rollout_id": rollout_id, "stored_revision": str(stored), "expected_revision": str(expected)},
        )


def _refuse_existing(target: Path) -> None:
    if os.path.lexists(target):
        raise FileExistsError(errno.EEXIST, "an archive of this name exists already", str(target))


def _sweep(shard: Path, cutoff_ns: int) -> int:
    """Delete the shard's expired records and lock files of episodes with no record; skip leased ones."""
    deleted = 0
    try:
        names = os.listdir(shard)
    except FileNotFoundError:
        return 0
    present = set(names)
    for name in names:
        path = shard / name
        stem, _, suffix = name.rpartition(".")
        if suffix == "ckpt" and not name.startswith("."):
            try:
                header = _read_header(path)
            except GymrpcError as exc:
                log.warning("skipping a corrupt episode record in the expiry sweep: %s", exc.message)
                continue
            if header is None or not header.expires_at_ns or header.expires_at_ns > cutoff_ns:
                continue
        elif suffix != "lock" or f"{stem}.ckpt" in present:
            continue
        lock = shard / f"{stem}.lock"
        try:
            fd = _lock(lock)
        except LeaseHeld:
            continue  # in use: its holder decides
        try:
            if suffix == "ckpt":
                header = _read_header(path)  # again, under the lease: it may have been rewritten
                if header is None or not header.expires_at_ns or header.expires_at_ns > cutoff_ns:
                    continue
                _unlink(path)
                deleted += 1
            if not os.path.exists(shard / f"{stem}.ckpt"):
                _unlink(lock)  # unlinked while locked: late openers see a new inode and retry
        except GymrpcError:
            continue
        finally:
            os.close(fd)
    return deleted
