"""Content-addressed blocks: bytes named by their sha256, stored once however many sessions use them.

A block is an encoded table. `BlockStore` keeps blocks as files in a folder
(`<root>/<first two hex digits>/<64 hex digits>`), writes each one atomically (temporary
file, fsync, link into place) and checks every block's hash when it reads it back, so a
missing or damaged block is reported as such (`BlockMissing`, `BlockCorrupt`), never
returned. Any other storage works too: readers of a checkpoint only need a
`get_block(digest) -> bytes` callable, and `verified` applies the hash check to it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from gymrpc.durable import fsync_folder

_DIGEST = re.compile(r"[0-9a-f]{64}")
GetBlock = Callable[[str], bytes]


class BlockError(Exception):
    """A block could not be provided intact."""

    def __init__(self, message: str, digest: str) -> None:
        super().__init__(message)
        self.digest = digest


class BlockMissing(BlockError):
    """No block with this digest exists."""


class BlockCorrupt(BlockError):
    """The bytes found under this digest do not hash to it."""


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_digest(digest: object) -> str:
    """A lowercase 64-hex sha256 digest, or ValueError (digests become file names)."""
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise ValueError(f"{digest!r} is not a sha256 hex digest")
    return digest


def verified(get_block: GetBlock) -> GetBlock:
    """Wrap any block source so that what it returns is checked against the digest asked for."""

    def get(digest: str) -> bytes:
        try:
            data = get_block(digest)
        except KeyError:
            raise BlockMissing(f"block {digest} is missing", digest) from None
        if digest_of(data) != digest:
            raise BlockCorrupt(f"block {digest} does not match its sha256", digest)
        return data

    return get


class BlockStore:
    """Blocks as files under one folder; safe for concurrent writers of the same block."""

    def __init__(self, root: str | os.PathLike[str], *, durable: bool = True) -> None:
        self.root = Path(root)
        self.durable = durable
        """fsync files and folders on write (a checkpoint must survive a power cut; tests may skip it)."""

    def path(self, digest: str) -> Path:
        check_digest(digest)
        return self.root / digest[:2] / digest

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def put(self, data: bytes) -> str:
        """Store a block (a no-op when it is already there) and return its digest."""
        digest = digest_of(data)
        target = self.path(digest)
        if target.is_file() and target.stat().st_size == len(data):
            return digest
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".block.", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                if self.durable:
                    out.flush()
                    os.fsync(out.fileno())
            os.replace(tmp, target)  # same bytes under the same name: replacing a racing writer is harmless
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        if self.durable:
            fsync_folder(target.parent)
        return digest

    def put_many(self, blocks: Iterable[bytes]) -> list[str]:
        return [self.put(data) for data in blocks]

    def get(self, digest: str) -> bytes:
        """The block's bytes, checked against its digest."""
        try:
            data = self.path(digest).read_bytes()
        except FileNotFoundError:
            raise BlockMissing(f"block {digest} is missing from {self.root}", digest) from None
        if digest_of(data) != digest:
            raise BlockCorrupt(f"block {digest} in {self.root} does not match its sha256", digest)
        return data
