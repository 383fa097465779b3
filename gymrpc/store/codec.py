"""The record file format: a fixed binary header, then the deterministic `EpisodeCheckpoint` bytes.

A truncated protobuf often still parses (as a shorter, wrong message), so the
header carries the payload's length and sha256: a torn or bit-rotted file is
reported as DATA_LOSS, never half-read. The header also repeats the two fields the
store needs without parsing the payload (`revision` for the compare-and-swap,
`expires_at` for TTL scans), so those read 72 bytes instead of the whole record.

Layout (little-endian): magic `GYMRPCEC` | header version u16 | flags u16 |
reserved u32 | revision u64 | expires_at unix ns u64 (0: never) | payload length
u64 | payload sha256 (32 bytes) | payload.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

from google.protobuf.message import DecodeError

from gymrpc.errors import DataLoss
from gymrpc.v1 import episode_checkpoint_pb2 as ckpt_pb

MAGIC = b"GYMRPCEC"
HEADER_VERSION = 1
SCHEMA_VERSION = 1
"""`EpisodeCheckpoint.schema_version` this code writes and reads."""
_HEADER = struct.Struct("<8sHHIQQQ32s")
HEADER_SIZE = _HEADER.size
MAX_RECORD_BYTES = 1 << 30
"""A header claiming more than this is corrupt (a real episode record is kilobytes to megabytes)."""


@dataclass(frozen=True)
class Header:
    revision: int
    expires_at_ns: int
    payload_size: int
    sha256: bytes


def expires_at_ns(record: ckpt_pb.EpisodeCheckpoint) -> int:
    return record.expires_at.ToNanoseconds() if record.HasField("expires_at") else 0


def encode(record: ckpt_pb.EpisodeCheckpoint) -> bytes:
    """Header and payload of `record`, ready to be written as one file."""
    payload = record.SerializeToString(deterministic=True)
    header = _HEADER.pack(
        MAGIC,
        HEADER_VERSION,
        0,
        0,
        record.revision,
        expires_at_ns(record),
        len(payload),
        hashlib.sha256(payload).digest(),
    )
    return header + payload


def corrupt(path: Path | str, problem: str) -> DataLoss:
    return DataLoss(
        f"episode checkpoint {path} is corrupt ({problem}); nothing was changed. Move the file away to let the "
        "episode start over, or restore it from a backup",
        metadata={"path": str(path)},
    )


def decode_header(data: bytes, path: Path | str) -> Header:
    if len(data) < HEADER_SIZE:
        raise corrupt(path, f"{len(data)} bytes, shorter than the {HEADER_SIZE}-byte header")
    magic, version, _flags, _reserved, revision, expires, size, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise corrupt(path, "not a gymrpc episode checkpoint: bad magic")
    if version != HEADER_VERSION:
        raise corrupt(path, f"header version {version}, this reader knows {HEADER_VERSION}")
    if size > MAX_RECORD_BYTES:
        raise corrupt(path, f"header claims a {size}-byte payload")
    return Header(revision, expires, size, digest)


def decode(data: bytes, path: Path | str, rollout_id: str) -> ckpt_pb.EpisodeCheckpoint:
    """Parse and check a whole record file; any inconsistency is DATA_LOSS naming the file."""
    header = decode_header(data, path)
    payload = data[HEADER_SIZE:]
    if len(payload) != header.payload_size:
        raise corrupt(path, f"payload is {len(payload)} bytes, the header says {header.payload_size}")
    if hashlib.sha256(payload).digest() != header.sha256:
        raise corrupt(path, "payload fails its sha256")
    record = ckpt_pb.EpisodeCheckpoint()
    try:
        record.ParseFromString(payload)
    except DecodeError as exc:
        raise corrupt(path, f"payload does not parse: {exc}") from None
    if record.schema_version != SCHEMA_VERSION:
        raise corrupt(path, f"schema_version {record.schema_version}, this reader knows {SCHEMA_VERSION}")
    if record.episode_id.rollout_id != rollout_id:
        raise corrupt(path, f"it belongs to episode {record.episode_id.rollout_id!r}, not {rollout_id!r}")
    if record.revision != header.revision or expires_at_ns(record) != header.expires_at_ns:
        raise corrupt(path, "header and payload disagree on revision or expiry")
    return record
