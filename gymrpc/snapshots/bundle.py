"""A session's tables as a manifest plus content-addressed blocks, and as one self-contained payload.

`SessionManifest` names each table's block by digest and carries the environment's own
small JSON state (`meta`). The coordinated-checkpoint path stores manifests as records and
the blocks once in a `BlockStore` (see `checkpoint`); the per-session path (`Session.export`)
packs manifest and blocks into one payload:

    b"GRTB" + version byte (1) + u32 big-endian manifest length + sha256 of the manifest (32 bytes)
    + manifest JSON + for each distinct block, in the manifest's order: u64 big-endian length + bytes

`unpack` checks the manifest and every block against their hashes and that nothing is
missing, extra or trailing, so a corrupt or truncated payload is refused whole.

A table stored as a row delta (`rowdelta`) names its block and the base block it applies
to: such a manifest is version 2 (`"tables": {name: [delta digest, base digest]}` for those
tables), which a version-1 reader refuses by its version; a manifest without deltas stays
version 1. Base blocks come before the blocks that need them in `digests()`.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from gymrpc.snapshots._values import TableCorrupt
from gymrpc.snapshots.blocks import BlockError, GetBlock, check_digest, digest_of, verified
from gymrpc.snapshots.codec import TABLE_FORMAT, TABLE_FORMAT_VERSION, TableCodecError, decode_table, encode_table
from gymrpc.snapshots.rowdelta import decode_delta, delta_base

BUNDLE_FORMAT = "gymrpc.session-tables"
BUNDLE_FORMAT_VERSION = 2
"""The newest version written (2 only when a table is a row delta); versions 1 and 2 are read."""
PAYLOAD_CONTENT_TYPE = "application/vnd.gymrpc.session-tables"
_MAGIC = b"GRTB\x01"
_KEYS = frozenset({"format", "version", "table_format", "tables", "meta"})


class BundleCorrupt(ValueError):
    """A manifest or payload that this module did not write, or whose blocks are missing or damaged."""


@dataclass(frozen=True)
class SessionManifest:
    """Which block holds each table of one session, plus the environment's JSON state."""

    tables: Mapping[str, str]
    """Table name -> sha256 of its encoded block."""
    meta: Mapping[str, Any] = field(default_factory=dict)
    bases: Mapping[str, str] = field(default_factory=dict)
    """Digest of a row-delta block -> digest of the block it applies to."""

    def to_json(self) -> bytes:
        tables: dict[str, Any] = {
            name: [digest, self.bases[digest]] if digest in self.bases else digest
            for name, digest in self.tables.items()
        }
        doc = {
            "format": BUNDLE_FORMAT,
            "version": 2 if self.bases else 1,
            "table_format": [TABLE_FORMAT, TABLE_FORMAT_VERSION],
            "tables": tables,
            "meta": dict(self.meta),
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()

    @classmethod
    def from_json(cls, data: bytes) -> SessionManifest:
        try:
            doc = json.loads(data)
        except (ValueError, TypeError, RecursionError) as exc:
            raise BundleCorrupt(f"session manifest is not JSON: {exc}") from None
        if not isinstance(doc, dict) or set(doc) != _KEYS:
            raise BundleCorrupt(f"session manifest must have exactly the keys {sorted(_KEYS)}")
        if doc["format"] != BUNDLE_FORMAT or doc["version"] not in (1, 2):
            raise BundleCorrupt(
                f"manifest format {doc['format']!r} v{doc['version']!r} is not {BUNDLE_FORMAT} v1 or v2"
            )
        if doc["table_format"] != [TABLE_FORMAT, TABLE_FORMAT_VERSION]:
            raise BundleCorrupt(f"tables are in {doc['table_format']!r}, this reader has {TABLE_FORMAT} v1")
        entries, meta = doc["tables"], doc["meta"]
        if not isinstance(entries, dict) or not isinstance(meta, dict):
            raise BundleCorrupt("manifest 'tables' and 'meta' must be objects")
        tables: dict[str, str] = {}
        bases: dict[str, str] = {}
        try:
            for name, entry in entries.items():
                if isinstance(entry, list) and doc["version"] == 2:
                    if len(entry) != 2:
                        raise ValueError(f"table {name!r}: a delta entry is [delta digest, base digest]")
                    tables[name], bases[entry[0]] = check_digest(entry[0]), check_digest(entry[1])
                else:
                    tables[name] = check_digest(entry)
        except (ValueError, TypeError) as exc:
            raise BundleCorrupt(f"manifest: {exc}") from None
        return cls(tables, meta, bases)

    def digests(self) -> list[str]:
        """Distinct block digests in table-name order, each base right before the delta that needs it."""
        ordered: list[str] = []
        for name in sorted(self.tables):
            digest = self.tables[name]
            if digest in self.bases:
                ordered.append(self.bases[digest])
            ordered.append(digest)
        return list(dict.fromkeys(ordered))


@dataclass(frozen=True)
class SessionTables:
    """One exported session: its manifest and the bytes of every block the manifest names."""

    manifest: SessionManifest
    blocks: Mapping[str, bytes]


def encode_session(
    tables: Mapping[str, pd.DataFrame],
    meta: Mapping[str, Any] | None = None,
    *,
    known: Mapping[str, tuple[str, bytes]] | None = None,
    base_blocks: Mapping[str, bytes] | None = None,
) -> SessionTables:
    """Encode every table; `known` gives (digest, block) for tables already encoded, which are reused as is.

    A known block may be a row delta; `base_blocks` (digest -> block) must then hold its base.
    """
    names: dict[str, str] = {}
    blocks: dict[str, bytes] = {}
    bases: dict[str, str] = {}
    for name, frame in tables.items():
        hit = (known or {}).get(name)
        if hit is None:
            data = encode_table(frame)
            hit = (digest_of(data), data)
        names[name] = hit[0]
        blocks[hit[0]] = hit[1]
        base = delta_base(hit[1])
        if base is not None:
            if base_blocks is None or base not in base_blocks:
                raise ValueError(f"table {name!r} is a row delta of block {base[:12]}, which was not given")
            bases[hit[0]] = base
            blocks[base] = base_blocks[base]
    return SessionTables(SessionManifest(names, dict(meta or {}), bases), blocks)


def decode_session(
    manifest: SessionManifest, get_block: GetBlock, known: Mapping[str, pd.DataFrame] | None = None
) -> dict[str, pd.DataFrame]:
    """Fetch (hash-checked), decode and return every table; `BundleCorrupt` if any block fails.

    `known` maps digests to frames the caller already has (for example its seed tables): such
    blocks are still fetched and checked, but copied from the frame instead of decoded.
    """
    get = verified(get_block)
    decoded: dict[str, pd.DataFrame] = {}
    for digest in manifest.digests():
        try:
            decoded[digest] = decode_block(digest, get(digest), manifest.bases, decoded, known)
        except (BlockError, TableCodecError) as exc:
            raise BundleCorrupt(f"block {digest[:12]}: {exc}") from None
    return {name: decoded[digest].copy() for name, digest in manifest.tables.items()}


def decode_block(
    digest: str,
    data: bytes,
    bases: Mapping[str, str],
    decoded: Mapping[str, pd.DataFrame],
    known: Mapping[str, pd.DataFrame] | None = None,
) -> pd.DataFrame:
    """One block's table: a known frame, a row delta applied to its (already decoded) base, or decoded."""
    if known and digest in known:
        return known[digest]
    base = delta_base(data)
    if base is None:
        return decode_table(data)
    if bases.get(digest) != base or base not in decoded:
        raise TableCorrupt(f"row delta of block {base[:12]}, which the manifest does not give first")
    return decode_delta(data, decoded[base])


def pack(session: SessionTables) -> bytes:
    """One self-contained payload (the per-session snapshot)."""
    manifest = session.manifest.to_json()
    parts = [_MAGIC, struct.pack(">I", len(manifest)), hashlib.sha256(manifest).digest(), manifest]
    for digest in session.manifest.digests():
        data = session.blocks[digest]
        parts += [struct.pack(">Q", len(data)), data]
    return b"".join(parts)


def unpack(payload: bytes) -> SessionTables:
    """Inverse of `pack`; every block is checked against its digest. `BundleCorrupt` otherwise."""
    view = memoryview(payload)
    if bytes(view[: len(_MAGIC)]) != _MAGIC:
        raise BundleCorrupt("not a gymrpc session-tables payload (bad magic or version)")
    at = len(_MAGIC)
    size, at = _read_length(view, at, ">I", extra=32)
    expected, text = bytes(view[at : at + 32]), bytes(view[at + 32 : at + 32 + size])
    if hashlib.sha256(text).digest() != expected:
        raise BundleCorrupt("the manifest does not match its sha256")
    manifest = SessionManifest.from_json(text)
    at += 32 + size
    blocks: dict[str, bytes] = {}
    for digest in manifest.digests():
        size, at = _read_length(view, at, ">Q")
        data = bytes(view[at : at + size])
        at += size
        if digest_of(data) != digest:
            raise BundleCorrupt(f"block {digest[:12]} does not match its sha256")
        blocks[digest] = data
    if at != len(view):
        raise BundleCorrupt(f"{len(view) - at} unexpected bytes after the last block")
    return SessionTables(manifest, blocks)


def _read_length(view: memoryview, at: int, fmt: str, extra: int = 0) -> tuple[int, int]:
    width = struct.calcsize(fmt)
    if at + width > len(view):
        raise BundleCorrupt("payload is truncated")
    (size,) = struct.unpack(fmt, view[at : at + width])
    if at + width + extra + size > len(view):
        raise BundleCorrupt("payload is truncated")
    return size, at + width
