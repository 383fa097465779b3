"""Environments whose session state is a set of tables, snapshotted as `gymrpc.snapshots` blocks.

An environment opts in by subclassing `TableEnvironment` with `TableSession` sessions. A
coordinated checkpoint then stores one small manifest per session and each distinct table
block once (untouched seed tables are shared by every session), instead of one
self-contained `Session.export` payload per session that repeats every table. The
per-session path (`export` / `restore`) still works as for any environment.

Only type hints refer to pandas and `gymrpc.snapshots`, so importing envkit stays light.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import TYPE_CHECKING

from gymrpc.envkit._types import Environment, Session

if TYPE_CHECKING:
    import pandas as pd

    from gymrpc.snapshots import SessionTables


class TableSession(Session):
    """A session whose whole state is named tables plus small JSON metadata."""

    @abc.abstractmethod
    def export_tables(self) -> SessionTables:
        """Manifest plus the block of every table (cached blocks reused); `SnapshotUnsupported` if it cannot."""


class TableEnvironment(Environment):
    """An environment of `TableSession`s that can rebuild a session from its decoded tables."""

    @abc.abstractmethod
    def build_session(self, exported: SessionTables, tables: dict[str, pd.DataFrame]) -> TableSession:
        """A session from a manifest (with its hash-checked blocks) and its decoded frames.

        Raise `SnapshotCorrupt` unless they are this environment's session. The frames are the
        session's own copies; keep `exported.blocks` as the tables' cached blocks, so the next
        export re-encodes nothing that did not change.
        """

    def known_frames(self) -> Mapping[str, pd.DataFrame]:
        """Frames by block digest that a restore may copy instead of decoding (for example the seed tables)."""
        return {}
