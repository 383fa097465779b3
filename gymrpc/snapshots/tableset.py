"""A session's named tables with versions, so snapshots re-encode only the tables that changed.

Environments hold their DataFrames in a `TableSet` and replace a table (`set`) whenever
they change it; they never mutate a frame they got from `get` in place. Each `set` bumps
the table's version and drops its cached block. `export` then encodes only tables whose
version has no block yet: an untouched table reuses the block it was seeded or restored
with, which is what makes a thousand untouched sessions nearly free to checkpoint. A
changed table whose starting block is known is encoded as a row delta of it (`rowdelta`)
when that is exact and smaller, so a session's bytes follow what it changed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pandas as pd

from gymrpc.snapshots.blocks import digest_of
from gymrpc.snapshots.bundle import SessionTables, encode_session
from gymrpc.snapshots.codec import encode_table
from gymrpc.snapshots.rowdelta import delta_base, encode_delta

Block = tuple[str, bytes]
"""(sha256 hex digest, encoded table)."""
MIN_DELTA_BASE = 4096
"""A table whose base block is smaller is stored whole (a delta's own overhead is about 600 bytes)."""


class TableSet:
    """Named DataFrames plus, per table, a version counter and the block of the current version."""

    def __init__(
        self,
        frames: Mapping[str, pd.DataFrame],
        blocks: Mapping[str, Block] | None = None,
        bases: Mapping[str, tuple[Block, pd.DataFrame]] | None = None,
    ) -> None:
        """`blocks` are known encodings of the given frames (for example shared seed blocks).

        A table's changes are stored as row deltas of its starting block when that block is a
        whole table, or of `bases[name]` (a whole block and its frame) when its block is itself
        a delta (a restored session).
        """
        self._frames = dict(frames)
        self._versions = dict.fromkeys(self._frames, 0)
        self._blocks: dict[str, Block] = {n: b for n, b in (blocks or {}).items() if n in self._frames}
        self._bases: dict[str, tuple[Block, pd.DataFrame]] = {
            n: (b, self._frames[n]) for n, b in self._blocks.items() if delta_base(b[1]) is None
        }
        self._bases.update({n: base for n, base in (bases or {}).items() if n in self._frames})

    def __contains__(self, name: object) -> bool:
        return name in self._frames

    def __iter__(self) -> Iterator[str]:
        return iter(self._frames)

    def get(self, name: str) -> pd.DataFrame:
        return self._frames[name]

    def set(self, name: str, frame: pd.DataFrame) -> None:
        if name not in self._frames:
            raise KeyError(f"unknown table {name!r}")
        self._frames[name] = frame
        self._versions[name] += 1
        self._blocks.pop(name, None)

    def version(self, name: str) -> int:
        return self._versions[name]

    def frames(self) -> dict[str, pd.DataFrame]:
        """A new dict of the current frames (the frames themselves are shared, treat them as read-only)."""
        return dict(self._frames)

    def changed(self) -> list[str]:
        """Tables without a cached block: those a snapshot must encode."""
        return [name for name in self._frames if name not in self._blocks]

    def block(self, name: str) -> Block:
        """The current version's block, encoded now if needed and cached until the next `set`."""
        cached = self._blocks.get(name)
        if cached is None:
            frame, data = self._frames[name], None
            base = self._bases.get(name)
            if base is not None and len(base[0][1]) >= MIN_DELTA_BASE:
                (base_digest, _), base_frame = base
                data = encode_delta(base_frame, base_digest, frame)
            if data is None:
                data = encode_table(frame)
            cached = self._blocks[name] = (digest_of(data), data)
        return cached

    def export(self, meta: Mapping[str, Any] | None = None) -> SessionTables:
        known = {name: self.block(name) for name in self._frames}
        base_blocks = {digest: data for (digest, data), _ in self._bases.values()}
        return encode_session(self._frames, meta, known=known, base_blocks=base_blocks)

    def clear(self) -> None:
        """Drop every table and block (a closed session frees its memory)."""
        self._frames.clear()
        self._versions.clear()
        self._blocks.clear()
        self._bases.clear()
