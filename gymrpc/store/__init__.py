"""Durable episode checkpoints for per-episode resume (docs/design.md §6).

`EpisodeStore` is the narrow interface the agent uses (lease, load, save with a revision
guard, archive, delete, TTL expiry). `LogEpisodeStore` (the agent's default) appends every save to
one group-committed log per process, one fsync per batch, and a boundary's frame holds only
the fields that changed; `FilesystemEpisodeStore` keeps one atomically replaced file per
episode, written through a `GroupCommitter` that batches fsyncs across episodes. Both
return from a save only once it is durable; the log's `begin_save` leaves that wait to the
caller, so an episode's next call can run while its boundary goes to the disk.
"""

from gymrpc.store.base import SAVED, EpisodeCheckpoint, EpisodeLease, EpisodeStore, PendingSave
from gymrpc.store.codec import SCHEMA_VERSION
from gymrpc.store.commit import CommitStats, GroupCommitter
from gymrpc.store.files import FilesystemEpisodeStore
from gymrpc.store.log import LogEpisodeStore
from gymrpc.store.reader import read_record

__all__ = [
    "SAVED",
    "SCHEMA_VERSION",
    "CommitStats",
    "EpisodeCheckpoint",
    "EpisodeLease",
    "EpisodeStore",
    "FilesystemEpisodeStore",
    "GroupCommitter",
    "LogEpisodeStore",
    "PendingSave",
    "read_record",
]
