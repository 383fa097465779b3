"""Reading files that a request points at: regular files only, never past a bound, stoppable.

A checkpoint folder is named by the caller and may hold anything: a records file that is a
symlink to `/dev/zero`, a FIFO, a file far longer than its manifest says. Every reader of such
files goes through `read_regular`, which opens without following a final symlink (`O_NOFOLLOW`,
and `O_NONBLOCK` so a FIFO cannot hang the open), refuses anything `fstat` does not call a
regular file, reads at most `limit` bytes, and gives up between chunks once `stop` is set (a
deadline passed). The caller maps `UnsafeFile` and `ReadStopped` to its own status.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

CHUNK = 1 << 20
"""Bytes read between two looks at the stop flag."""


class UnsafeFile(Exception):
    """The path is not a regular file of an acceptable size; nothing beyond the bound was read."""


class ReadStopped(Exception):
    """The read was stopped (its deadline passed) before it finished."""


def read_regular(
    path: Path | str,
    *,
    limit: int,
    size: int | None = None,
    sha256: str | None = None,
    stop: threading.Event | None = None,
) -> bytes:
    """The bytes of the regular file `path`: at most `limit`, exactly `size` and hashing to `sha256` if given.

    With `sha256`, the file is hashed in a first pass that holds one chunk in memory, and only a
    file that matches is read into memory (and hashed again, so a file changed in between fails):
    a forged file costs time, bounded by `stop`, never memory.
    FileNotFoundError passes through; a symlink, device, FIFO or directory is `UnsafeFile`.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise UnsafeFile(f"{path} cannot be opened as a regular file ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFile(f"{path} is not a regular file")
        if info.st_size > limit:
            raise UnsafeFile(f"{path} holds {info.st_size} bytes, more than the {limit} it may")
        if size is not None and info.st_size != size:
            raise UnsafeFile(f"{path} holds {info.st_size} bytes, not the {size} its manifest says")
        bound = limit if size is None else size
        if sha256 is not None and _hash(fd, bound, stop) != sha256:
            raise UnsafeFile(f"{path} fails its sha256 check")
        data = _read(fd, bound, stop)
        if size is not None and len(data) != size:
            raise UnsafeFile(f"{path} changed while it was read (size)")
        if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
            raise UnsafeFile(f"{path} changed while it was read (sha256)")
        return data
    finally:
        os.close(fd)


def _chunks(fd: int, bound: int, stop: threading.Event | None) -> Iterator[bytes]:
    """The file's chunks up to `bound` bytes; one byte past it (a file that grew) is `UnsafeFile`."""
    offset = 0
    while True:
        if stop is not None and stop.is_set():
            raise ReadStopped
        chunk = os.pread(fd, min(CHUNK, bound + 1 - offset), offset)
        if not chunk:
            return
        offset += len(chunk)
        if offset > bound:
            raise UnsafeFile("the file grew past its bound while it was read")
        yield chunk


def _read(fd: int, bound: int, stop: threading.Event | None) -> bytes:
    return b"".join(_chunks(fd, bound, stop))


def _hash(fd: int, bound: int, stop: threading.Event | None) -> str:
    digest = hashlib.sha256()
    for chunk in _chunks(fd, bound, stop):
        digest.update(chunk)
    return digest.hexdigest()
