"""Durable episode checkpoints for per-episode resume (docs/design.md §6).

`EpisodeStore` is the narrow interface the agent uses (lease, load, save with a revision
guard, archive, TTL expiry); `FilesystemEpisodeStore` implements it with one atomically
replaced file per episode, written through a `GroupCommitter` that batches fsyncs
across episodes without returning before a record is durable.
"""

from gymrpc.store.base import EpisodeCheckpoint, EpisodeLease, EpisodeStore
from gymrpc.store.codec import SCHEMA_VERSION
from gymrpc.store.commit import CommitStats, GroupCommitter
from gymrpc.store.files import FilesystemEpisodeStore

__all__ = [
    "SCHEMA_VERSION",
    "CommitStats",
    "EpisodeCheckpoint",
    "EpisodeLease",
    "EpisodeStore",
    "FilesystemEpisodeStore",
    "GroupCommitter",
]
