"""Atomic, durable file replacement with group commit: concurrent writes share their fsyncs' wait.

Each write is the classic sequence: write a temp file, make its bytes durable, rename
it over the target, make the rename durable with an fsync of the folder. The first half
runs in a thread pool as soon as a write is submitted, so many temp files are synced at
once and the filesystem merges their journal commits and cache flushes. The second half
is batched: one thread takes every staged write, renames them in order (running each
write's guard right before its rename), syncs each touched folder once (in parallel),
and wakes every waiter of the batch with one call into its event loop. While it does,
the next writes are already being staged. `await write(...)` returning means the new
bytes survive a power cut; a failure at any step fails the write, and until the rename
the previous file is untouched. Writes of one path never overlap: a second one waits for
the first to finish, so one temp name per target suffices.

`sync="filesystem"` replaces the per-file and per-folder syncs by two `syncfs(2)` calls
per batch (before and after the renames) on a descriptor held open since start-up, so
a writeback error anywhere on the filesystem since the last batch fails the batch. It
flushes less often but also flushes other processes' dirty data on the same filesystem
(slower than `file` on a busy disk), and network or FUSE filesystems may not implement
it fully, so it is opt-in.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)
SyncMode = Literal["file", "filesystem"]
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


@dataclass
class CommitStats:
    """Counters of what the committer did, for benchmarks and logs (written by the commit thread only)."""

    writes: int = 0
    bytes: int = 0
    batches: int = 0
    fsyncs: int = 0
    """fdatasync/fsync/syncfs calls, folders included."""
    failures: int = 0


@dataclass(slots=True)
class _Write:
    path: str
    folder: str
    data: bytes
    check: Callable[[], None] | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    error: BaseException | None = None

    @property
    def temp(self) -> str:
        # One temp name per target: a store only writes a target under its lease, so two live
        # writers of one name never exist, and a leftover from a crash is simply overwritten.
        return f"{self.folder}/.{self.path.rpartition('/')[2]}.tmp"


class GroupCommitter:
    """Runs atomic durable file replacements in a background thread, batched.

    Args:
        max_batch: most writes committed together.
        sync_threads: threads writing and syncing temp files, and syncing the folders of a batch,
            in parallel (the filesystem merges their journal commits and cache flushes).
        sync: `file` (fdatasync each temp file, fsync each folder) or `filesystem` (syncfs).
        root: any folder on the filesystem written to (needed for `filesystem`).
    """

    def __init__(
        self, *, max_batch: int = 256, sync_threads: int = 16, sync: SyncMode = "file", root: Path | None = None
    ) -> None:
        if sync not in ("file", "filesystem"):
            raise ValueError(f"sync must be 'file' or 'filesystem', not {sync!r}")
        if sync == "filesystem" and root is None:
            raise ValueError("sync='filesystem' needs the root folder of the files it writes")
        self.max_batch, self.sync = max_batch, sync
        self.stats = CommitStats()
        self._fs_fd = os.open(root, _FOLDER_FLAGS) if sync == "filesystem" and root is not None else None
        self._queue: queue.SimpleQueue[_Write | None] = queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(max(sync_threads, 1), thread_name_prefix="store-sync")
        self._busy: dict[str, list[_Write]] = {}
        """Paths with a write in flight, each with the writes waiting behind it."""
        self._busy_lock = threading.Lock()
        self._folder_pool = ThreadPoolExecutor(8, thread_name_prefix="store-folder")
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="store-commit", daemon=True)
        self._thread.start()

    async def write(self, path: Path | str, data: bytes, check: Callable[[], None] | None = None) -> None:
        """Replace `path` by `data` atomically; returns once the new file is durable.

        `check` runs in the commit thread right before the rename and may refuse the write by
        raising. A cancelled waiter does not cancel the write: it may still land.
        """
        if self._closed:
            raise RuntimeError("the committer is closed")
        loop = asyncio.get_running_loop()
        path = os.fspath(path)
        write = _Write(path, os.path.dirname(path), data, check, loop, loop.create_future())
        with self._busy_lock:
            waiting = self._busy.get(path)
            if waiting is None:
                self._busy[path] = []
            else:
                waiting.append(write)
        if waiting is None:
            self._pool.submit(self._stage, write)
        await write.future

    def close(self) -> None:
        """Let every submitted write finish, then stop the threads."""
        if self._closed:
            return
        self._closed = True
        while True:
            with self._busy_lock:
                if not self._busy:
                    break
            time.sleep(0.005)
        self._queue.put(None)
        self._thread.join()
        self._pool.shutdown()
        self._folder_pool.shutdown()
        if self._fs_fd is not None:
            os.close(self._fs_fd)

    # -- the commit thread -----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < self.max_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)  # stop after this batch
                    break
                batch.append(item)
            try:
                self._commit(batch)
            except BaseException as exc:  # a bug here must fail the batch, never strand its waiters
                log.exception("group commit failed")
                for write in batch:
                    write.error = write.error or exc
            self._finish(batch)

    def _commit(self, batch: list[_Write]) -> None:
        self.stats.batches += 1
        staged = [w for w in batch if w.error is None]
        if self.sync == "file":
            self.stats.fsyncs += len(staged)
        else:
            self._fail_all(staged, self._syncfs())
        renamed: dict[str, list[_Write]] = {}
        for write in staged:
            if write.error is not None:
                continue
            try:
                if write.check is not None:
                    write.check()
                os.replace(write.temp, write.path)
            except BaseException as exc:
                write.error = exc
                with contextlib.suppress(OSError):
                    os.unlink(write.temp)
            else:
                renamed.setdefault(write.folder, []).append(write)
        if self.sync == "filesystem":
            self._fail_all([w for ws in renamed.values() for w in ws], self._syncfs() if renamed else None)
        else:
            folders = list(renamed)
            if len(folders) > 1:
                errors = list(self._folder_pool.map(self._sync_folder, folders))
            else:
                errors = [self._sync_folder(folder) for folder in folders]
            for folder, error in zip(folders, errors, strict=True):
                self._fail_all(renamed[folder], error)
            self.stats.fsyncs += errors.count(None)
        for write in batch:
            if write.error is None:
                self.stats.writes += 1
                self.stats.bytes += len(write.data)
            else:
                self.stats.failures += 1

    def _finish(self, batch: list[_Write]) -> None:
        """Wake the batch's waiters, then start the next write of each path, if one is waiting."""
        self._wake(batch)
        with self._busy_lock:
            nexts = []
            for write in batch:
                waiting = self._busy[write.path]
                if waiting:
                    nexts.append(waiting.pop(0))
                else:
                    del self._busy[write.path]
        for write in nexts:
            self._pool.submit(self._stage, write)

    def _stage(self, write: _Write) -> None:
        """Write and (in `file` mode) sync the temp file, then hand it to the commit thread."""
        try:
            fd = os.open(write.temp, _TEMP_FLAGS, 0o600)
            try:
                view = memoryview(write.data)
                while view:
                    view = view[os.write(fd, view) :]
                if self.sync == "file":
                    os.fdatasync(fd)
            finally:
                os.close(fd)
        except BaseException as exc:
            write.error = exc
            with contextlib.suppress(OSError):
                os.unlink(write.temp)
        self._queue.put(write)

    def _sync_folder(self, folder: str) -> BaseException | None:
        try:
            fd = os.open(folder, _FOLDER_FLAGS)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            return exc
        return None

    def _syncfs(self) -> BaseException | None:
        if _libc.syncfs(self._fs_fd) != 0:
            errno = ctypes.get_errno()
            return OSError(errno, f"syncfs: {os.strerror(errno)}")
        self.stats.fsyncs += 1
        return None

    @staticmethod
    def _fail_all(writes: list[_Write], error: BaseException | None) -> None:
        if error is not None:
            for write in writes:
                if write.error is None:
                    write.error = error
                    with contextlib.suppress(OSError):
                        os.unlink(write.temp)  # a renamed write has no temp left; harmless

    @staticmethod
    def _wake(batch: list[_Write]) -> None:
        """Resolve every future of the batch with one call per event loop (one wake-up, not one per write)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[_Write]] = {}
        for write in batch:
            by_loop.setdefault(write.loop, []).append(write)
        for loop, writes in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
                loop.call_soon_threadsafe(_settle, writes)


def _settle(writes: list[_Write]) -> None:
    for write in writes:
        if write.future.done():  # the waiter was cancelled
            continue
        if write.error is None:
            write.future.set_result(None)
        else:
            write.future.set_exception(write.error)
