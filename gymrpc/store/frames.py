"""The episode log's frame format, and the index a scan of a log builds (which frames hold each episode).

A log is a sequence of segments; a segment a sequence of frames. Every frame is
length-prefixed and checksummed (crc32 over its header fields and body), so a torn tail
or a flipped byte is found, never half-read:

    magic "GRL1" | body length u32 | kind u8 | 0 u8 | id length u16 | version u64 |
    revision u64 | expires_at unix ns u64 | crc32 u32 | body = rollout id + payload

`version` orders every write of an episode across all logs of a store (the highest
wins; a tombstone is a write too), `revision` is the record's own revision (the guard).
Kinds: FULL (payload: the record's deterministic bytes), DELTA (payload: crc32 of the
resulting record bytes u32 + a `fields` delta against the episode's previous frame in
this log), TOMBSTONE (deleted), DAMAGED (a frame of this version was lost: loads are
DATA_LOSS until a newer write), COMMIT (closes a group commit; body: each data frame's
rollout id + version, so a frame lost to corruption is known by name), COMPACT_BEGIN /
COMPACT_END (a compacted segment replaces every earlier one only once its END is read).

A scan skips a damaged frame by searching for the next valid one; a frame named by a
COMMIT but never read marks its episode DAMAGED, and so does a delta without its base.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

MAGIC = b"GRL1"
HEADER = struct.Struct("<4sIBBHQQQI")
HEADER_SIZE = HEADER.size
_CRC_START, _CRC_END = 4, HEADER_SIZE - 4
MAX_BODY = 1 << 30
FULL, DELTA, TOMBSTONE, DAMAGED, COMMIT, COMPACT_BEGIN, COMPACT_END = 1, 2, 3, 4, 5, 6, 7
DATA_KINDS = (FULL, DELTA)
_COMMIT_ENTRY = struct.Struct("<HQ")
_DELTA_CRC = struct.Struct("<I")


class Frame(NamedTuple):
    kind: int
    rollout_id: str
    version: int
    revision: int
    expires_ns: int
    offset: int
    """Of the frame's first byte in its segment."""
    length: int
    payload: bytes


def encode(
    kind: int, rollout_id: str = "", payload: bytes = b"", *, version: int = 0, revision: int = 0, expires_ns: int = 0
) -> bytes:
    ident = rollout_id.encode()
    body = ident + payload
    header = HEADER.pack(MAGIC, len(body), kind, 0, len(ident), version, revision, expires_ns, 0)
    crc = zlib.crc32(body, zlib.crc32(header[_CRC_START:_CRC_END]))
    return header[:-4] + struct.pack("<I", crc) + body


def encode_delta_payload(record_crc: int, delta: bytes) -> bytes:
    return _DELTA_CRC.pack(record_crc) + delta


def decode_delta_payload(payload: bytes) -> tuple[int, bytes]:
    return _DELTA_CRC.unpack_from(payload)[0], payload[_DELTA_CRC.size :]


def encode_commit(entries: list[tuple[str, int]]) -> bytes:
    out = bytearray()
    for rollout_id, version in entries:
        ident = rollout_id.encode()
        out += _COMMIT_ENTRY.pack(len(ident), version) + ident
    return encode(COMMIT, payload=bytes(out))


def decode_commit(payload: bytes) -> list[tuple[str, int]]:
    entries, pos = [], 0
    while pos < len(payload):
        size, version = _COMMIT_ENTRY.unpack_from(payload, pos)
        pos += _COMMIT_ENTRY.size
        entries.append((payload[pos : pos + size].decode(), version))
        pos += size
    return entries


def frame_at(data: bytes, pos: int, base: int = 0) -> Frame | None:
    """The valid frame starting at `pos` (`base` + `pos` in its segment), or None."""
    if len(data) - pos < HEADER_SIZE:
        return None
    magic, size, kind, _zero, id_size, version, revision, expires, crc = HEADER.unpack_from(data, pos)
    if magic != MAGIC or size > MAX_BODY or id_size > size:
        return None
    end = pos + HEADER_SIZE + size
    if end > len(data):
        return None
    body = data[pos + HEADER_SIZE : end]
    if zlib.crc32(body, zlib.crc32(data[pos + _CRC_START : pos + _CRC_END])) != crc:
        return None
    try:
        rollout_id = body[:id_size].decode()
    except UnicodeDecodeError:
        return None
    return Frame(kind, rollout_id, version, revision, expires, base + pos, end - pos, body[id_size:])


def scan(data: bytes, base: int = 0) -> Iterator[Frame | tuple[int, int]]:
    """Valid frames of `data` (which starts at `base` in its segment); a skipped damaged region as
    `(start, end)`; stops before an invalid tail."""
    pos = 0
    while pos < len(data):
        frame = frame_at(data, pos, base)
        if frame is not None:
            yield frame
            pos += frame.length
            continue
        search = pos + 1
        while (found := data.find(MAGIC, search)) != -1:
            if frame_at(data, found) is not None:
                break
            search = found + 1
        if found == -1:
            return  # a torn tail (or damage at the very end): nothing valid follows
        yield (base + pos, base + found)
        pos = found


SECTOR = 512
"""The smallest unit a disk writes whole: what a power cut can leave unwritten while a later one is written."""
_ZERO_SECTOR = bytes(SECTOR)
_BOUNDARIES = (COMMIT, COMPACT_BEGIN, COMPACT_END)
"""Frames that close a batch: everything before them was written by an earlier, finished write."""


def unwritten(data: bytes, start: int, end: int, base: int = 0) -> bool:
    """Whether the damaged region [start, end) (offsets in the segment; `data` starts at `base`) reads as a
    write that never reached the disk in a file zeroed ahead of its writer: zeros from its first byte to the end
    of that sector, or a whole zero sector. A flipped byte leaves neither (a frame starts with four non-zero
    magic bytes), so damage stays damage."""
    boundary = (start // SECTOR + 1) * SECTOR
    if boundary <= end and data[start - base : boundary - base].count(0) == boundary - start:
        return True
    while boundary + SECTOR <= end:
        if data[boundary - base : boundary - base + SECTOR] == _ZERO_SECTOR:
            return True
        boundary += SECTOR
    return False


def batches(data: bytes, base: int = 0) -> tuple[int, int | None]:
    """The offset just past the last frame of `data` that closes a batch (`base` if none), and where the
    last batch starts if a power cut tore it (None if not).

    A batch is one `pwritev2(RWF_DSYNC)`; in a segment zeroed ahead of the writer, a power cut
    during it can keep a later sector and lose an earlier one, leaving a gap of zeros inside the
    batch. Such a batch was never acknowledged (its sync did not return), so it is cut off whole
    rather than read as damage: its COMMIT would name the lost frames and make their episodes
    DATA_LOSS although their previous records are intact. A gap before a later frame is damage:
    that frame was only written once the batch was durable.
    """
    closed = base
    torn: int | None = None
    for item in scan(data, base):
        if isinstance(item, Frame):
            if torn is not None and torn != closed:
                torn = None  # written after the torn batch: that one was durable, the gap is damage
            if item.kind in _BOUNDARIES:
                closed = item.offset + item.length
        elif unwritten(data, *item, base):
            torn = closed
    return closed, torn


def torn_batch(data: bytes, base: int = 0) -> int | None:
    """Where the last batch of `data` starts if a power cut tore it (`batches`), else None."""
    return batches(data, base)[1]


@dataclass(slots=True)
class Chain:
    """Where an episode's latest write is in one log: the frames since its last FULL (none: tombstone)."""

    version: int
    revision: int
    expires_ns: int
    frames: list[tuple[int, int, int]]
    """(segment, offset, length) of each frame, the FULL first."""
    size: int = 0
    """Bytes of the record (for compaction's estimate of live bytes)."""

    @property
    def deleted(self) -> bool:
        return not self.frames


@dataclass
class LogIndex:
    """The state of one log, fed frame by frame in log order."""

    chains: dict[str, Chain] = field(default_factory=dict)
    damaged: dict[str, int] = field(default_factory=dict)
    """Episodes whose write of this version was lost (a newer write clears it)."""
    damage: list[tuple[int, int, int]] = field(default_factory=list)
    """(segment, start, end) of regions skipped by scans."""
    _batch: set[tuple[str, int]] = field(default_factory=set)
    _before_compaction: tuple[dict[str, Chain], dict[str, int]] | None = None
    compaction_segment: int | None = None
    """A segment whose compaction has begun and not ended (its END not read yet)."""

    def feed(self, segment: int, data: bytes, base: int = 0) -> int:
        """Apply every valid frame of `data` (at `base` in the segment); the offset just past the last valid one."""
        end = base
        for item in scan(data, base):
            if not isinstance(item, Frame):
                self.damage.append((segment, *item))
                continue
            self.apply(segment, item)
            end = item.offset + item.length
        return end

    def apply(self, segment: int, frame: Frame, size: int | None = None) -> None:
        """`size`: the record's bytes, for a frame built without its payload."""
        kind = frame.kind
        if kind == COMMIT:
            for rollout_id, version in decode_commit(frame.payload):
                if (rollout_id, version) not in self._batch:
                    self._mark_damaged(rollout_id, version)
            self._batch.clear()
            return
        if kind == COMPACT_BEGIN:
            self._before_compaction = (self.chains, self.damaged)
            self.chains, self.damaged, self.compaction_segment = {}, {}, segment
            self._batch.clear()
            return
        if kind == COMPACT_END:
            self._before_compaction, self.compaction_segment = None, None
            return
        if size is None and kind == FULL:
            size = len(frame.payload)
        self.place(
            segment,
            kind,
            frame.rollout_id,
            frame.version,
            frame.revision,
            frame.expires_ns,
            frame.offset,
            frame.length,
            size,
        )

    def place(
        self,
        segment: int,
        kind: int,
        rid: str,
        version: int,
        revision: int,
        expires_ns: int,
        offset: int,
        length: int,
        size: int | None,
    ) -> None:
        """A frame of one episode at (segment, offset, length), as `apply` takes it but without a `Frame`: the
        commit thread places each frame it wrote (`size`: the record's bytes; None leaves a delta's as it was)."""
        if kind in DATA_KINDS or kind == TOMBSTONE:
            self._batch.add((rid, version))
        chain = self.chains.get(rid)
        if chain is not None and version <= chain.version and kind != DAMAGED:
            return  # an older write (cannot happen in one log; harmless)
        if kind == FULL:
            self.chains[rid] = Chain(version, revision, expires_ns, [(segment, offset, length)], size or 0)
        elif kind == DELTA:
            if chain is None or chain.deleted or chain.version != version - 1:
                self._mark_damaged(rid, version)
                return
            chain.version, chain.revision, chain.expires_ns = version, revision, expires_ns
            chain.frames.append((segment, offset, length))
            if size is not None:
                chain.size = size
        elif kind == TOMBSTONE:
            self.chains[rid] = Chain(version, 0, 0, [])
        elif kind == DAMAGED:
            self._mark_damaged(rid, version)
            return
        else:
            return  # a kind from a newer writer: skipped (it carries no episode state this reader knows)
        if self.damaged.get(rid, 0) <= version:
            self.damaged.pop(rid, None)

    def _mark_damaged(self, rollout_id: str, version: int) -> None:
        chain = self.chains.get(rollout_id)
        if chain is not None and chain.version >= version:
            return
        self.damaged[rollout_id] = max(version, self.damaged.get(rollout_id, 0))

    def settled(self) -> tuple[dict[str, Chain], dict[str, int]]:
        """The chains and damage to serve: those before an unfinished compaction, if one is under way."""
        if self._before_compaction is not None:
            return self._before_compaction
        return self.chains, self.damaged

    def abandon_compaction(self) -> None:
        """Forget an unfinished compaction (its segment is being deleted)."""
        if self._before_compaction is not None:
            self.chains, self.damaged = self._before_compaction
            self._before_compaction, self.compaction_segment = None, None
