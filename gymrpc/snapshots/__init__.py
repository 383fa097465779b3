"""Session snapshots of pandas tables: an exact Arrow codec and content-addressed shared blocks.

- `encode_table` / `decode_table`: one DataFrame <-> one Arrow IPC stream, exactly (format
  `gymrpc.table.arrow` v1; see `codec`).
- `TableSet`: an environment's named tables with versions, so snapshots encode only what changed.
- `SessionManifest`, `encode_session`, `decode_session`, `pack`, `unpack`: one session as a
  manifest plus blocks, or as one self-contained payload (`Session.export`).
- `BlockStore`, `collect`, `write_checkpoint`, `restore_sessions`: many sessions in one
  checkpoint, each distinct block stored once, restored all or nothing.
- `encode_delta` / `decode_delta`: a changed table as its base block plus its changed, added and
  removed rows (`TableSet` writes them when exact and smaller; manifest v2 names the base).
- `frame_differences`, `frame_fingerprint`: strict equality that does not trust the codec.

Everything here is synchronous and CPU-bound; servers call it from worker threads.
"""

from gymrpc.snapshots.blocks import (
    BlockCorrupt,
    BlockError,
    BlockMissing,
    BlockStore,
    GetBlock,
    check_digest,
    digest_of,
    verified,
)
from gymrpc.snapshots.bundle import (
    BUNDLE_FORMAT,
    BUNDLE_FORMAT_VERSION,
    PAYLOAD_CONTENT_TYPE,
    BundleCorrupt,
    SessionManifest,
    SessionTables,
    decode_session,
    encode_session,
    pack,
    unpack,
)
from gymrpc.snapshots.checkpoint import (
    CheckpointBundle,
    CheckpointInvalid,
    collect,
    parse_records,
    restore_sessions,
    write_checkpoint,
)
from gymrpc.snapshots.codec import (
    TABLE_FORMAT,
    TABLE_FORMAT_VERSION,
    TableCodecError,
    TableCorrupt,
    TableUnsupported,
    decode_table,
    encode_table,
)
from gymrpc.snapshots.compare import frame_differences, frame_fingerprint
from gymrpc.snapshots.rowdelta import decode_delta, delta_base, encode_delta
from gymrpc.snapshots.tableset import Block, TableSet

__all__ = [
    "BUNDLE_FORMAT",
    "BUNDLE_FORMAT_VERSION",
    "PAYLOAD_CONTENT_TYPE",
    "TABLE_FORMAT",
    "TABLE_FORMAT_VERSION",
    "Block",
    "BlockCorrupt",
    "BlockError",
    "BlockMissing",
    "BlockStore",
    "BundleCorrupt",
    "CheckpointBundle",
    "CheckpointInvalid",
    "GetBlock",
    "SessionManifest",
    "SessionTables",
    "TableCodecError",
    "TableCorrupt",
    "TableSet",
    "TableUnsupported",
    "check_digest",
    "collect",
    "decode_delta",
    "decode_session",
    "decode_table",
    "delta_base",
    "digest_of",
    "encode_delta",
    "encode_session",
    "encode_table",
    "frame_differences",
    "frame_fingerprint",
    "pack",
    "parse_records",
    "restore_sessions",
    "unpack",
    "verified",
    "write_checkpoint",
]
