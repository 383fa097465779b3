"""Many sessions in one checkpoint: each distinct table block stored once, restored all or nothing.

Export side: `collect` merges the `SessionTables` of many sessions into one
`CheckpointBundle`, so a block shared by a thousand untouched sessions is kept once; each
session then costs only its manifest (well under a kilobyte) plus the blocks of tables it
changed. `write_checkpoint` puts the distinct blocks into a `BlockStore` and returns the
per-session manifest records for the caller to store as it likes (a records file, say).

Restore side: `restore_sessions` fetches every distinct block (hash-checked), decodes
each once, and builds every session with the caller's `build` function before returning
any of them. If one block is missing or corrupt, or one session fails to build, it raises
`CheckpointInvalid` naming every problem, and the caller installs nothing.

All of this is blocking CPU and file work: call it from a worker thread, never on an event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import pandas as pd

from gymrpc.snapshots.blocks import BlockError, BlockStore, GetBlock, verified
from gymrpc.snapshots.bundle import BundleCorrupt, SessionManifest, SessionTables, decode_block
from gymrpc.snapshots.codec import TableCodecError

T = TypeVar("T")
Build = Callable[[str, SessionTables, dict[str, pd.DataFrame]], T]
"""`build(session_id, exported, tables)` -> the caller's session object; raise to reject it.

`exported` is the session's manifest with its (hash-checked) blocks, `tables` its decoded frames."""


class CheckpointInvalid(Exception):
    """Some sessions of a checkpoint cannot be restored; `problems` maps session id -> reason."""

    def __init__(self, problems: Mapping[str, str]) -> None:
        self.problems = dict(problems)
        listed = "; ".join(f"{sid}: {why}" for sid, why in sorted(self.problems.items())[:5])
        more = f" (and {len(self.problems) - 5} more)" if len(self.problems) > 5 else ""
        super().__init__(f"{len(self.problems)} session(s) cannot be restored, nothing was: {listed}{more}")


@dataclass(frozen=True)
class CheckpointBundle:
    """The manifests of many sessions and the distinct blocks they name."""

    manifests: Mapping[str, SessionManifest]
    blocks: Mapping[str, bytes]

    def records(self) -> dict[str, bytes]:
        """Each session's manifest as canonical JSON bytes (what a records file stores per session)."""
        return {sid: manifest.to_json() for sid, manifest in self.manifests.items()}

    def size(self) -> tuple[int, int]:
        """(bytes of all manifests, bytes of all distinct blocks)."""
        return sum(len(r) for r in self.records().values()), sum(len(b) for b in self.blocks.values())


def collect(exports: Mapping[str, SessionTables]) -> CheckpointBundle:
    """Merge per-session exports; identical blocks (same digest) are kept once."""
    blocks: dict[str, bytes] = {}
    for export in exports.values():
        for digest in export.manifest.digests():
            blocks.setdefault(digest, export.blocks[digest])
    return CheckpointBundle({sid: e.manifest for sid, e in exports.items()}, blocks)


def write_checkpoint(store: BlockStore, exports: Mapping[str, SessionTables]) -> dict[str, bytes]:
    """Store every distinct block once and return the manifest record of every session."""
    bundle = collect(exports)
    for data in bundle.blocks.values():
        store.put(data)
    return bundle.records()


def parse_records(records: Mapping[str, bytes]) -> dict[str, SessionManifest]:
    """Manifest records back to manifests; `CheckpointInvalid` lists every record that is not one."""
    manifests: dict[str, SessionManifest] = {}
    problems: dict[str, str] = {}
    for sid, record in records.items():
        try:
            manifests[sid] = SessionManifest.from_json(record)
        except BundleCorrupt as exc:
            problems[sid] = str(exc)
    if problems:
        raise CheckpointInvalid(problems)
    return manifests


def restore_sessions(
    manifests: Mapping[str, SessionManifest],
    get_block: GetBlock,
    build: Build[T],
    known: Mapping[str, pd.DataFrame] | None = None,
) -> dict[str, T]:
    """Build every session from its blocks, or raise `CheckpointInvalid` having built none for the caller.

    Each distinct block is fetched, hash-checked and decoded once (blocks whose digest is in
    `known` are checked but copied from the known frame); every session gets its own deep
    copy of its tables, so sessions that shared a block stay independent.
    """
    get = verified(get_block)
    frames: dict[str, pd.DataFrame] = {}
    blocks: dict[str, bytes] = {}
    failed: dict[str, str] = {}
    bases = {delta: base for m in manifests.values() for delta, base in m.bases.items()}
    digests = sorted({d for m in manifests.values() for d in m.digests()})
    for digest in [d for d in digests if d not in bases] + [d for d in digests if d in bases]:  # bases first
        try:
            if bases.get(digest) in failed:
                raise BlockError(f"its base block {bases[digest][:12]} failed")
            blocks[digest] = get(digest)
            frames[digest] = decode_block(digest, blocks[digest], bases, frames, known)
        except (BlockError, TableCodecError) as exc:
            failed[digest] = f"block {digest[:12]}: {exc}"
    problems: dict[str, str] = {}
    built: dict[str, T] = {}
    for sid, manifest in manifests.items():
        bad = [failed[d] for d in manifest.digests() if d in failed]
        if bad:
            problems[sid] = bad[0]
            continue
        tables = {name: frames[digest].copy() for name, digest in manifest.tables.items()}
        exported = SessionTables(manifest, {d: blocks[d] for d in manifest.digests()})
        try:
            built[sid] = build(sid, exported, tables)
        except Exception as exc:  # the builder's own validation: report it with the others
            problems[sid] = f"{type(exc).__name__}: {exc}"
    if problems:
        raise CheckpointInvalid(problems)
    return built
