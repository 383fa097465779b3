"""The episode checkpoint store interface: what per-episode resume needs from durable storage, no more.

Every read and write of an episode goes through an `EpisodeLease`, so the one rule
that keeps records consistent (a single writer per episode at a time, across
processes) is enforced by the type, not by convention. The revision guard is a
second, independent line of defence: a save names the revision it replaces.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import AsyncIterator, Generator
from typing import Any

from gymrpc.v1 import episode_checkpoint_pb2 as ckpt_pb

EpisodeCheckpoint = ckpt_pb.EpisodeCheckpoint
IO_THREADS = "store-io"
"""The name prefix of a store's I/O threads (a profiler or a bench finds them by it)."""


class EpisodeLease(abc.ABC):
    """Exclusive right to read and write one episode's record until `release`."""

    rollout_id: str

    @property
    @abc.abstractmethod
    def held(self) -> bool:
        """False once released."""

    @abc.abstractmethod
    async def release(self) -> None:
        """Give the episode up; idempotent."""


class PendingSave(abc.ABC):
    """A save begun by `EpisodeStore.begin_save`: awaiting it returns once the record is durable, or raises."""

    __slots__ = ()

    @abc.abstractmethod
    def __await__(self) -> Generator[Any, None, None]: ...

    def abandon(self) -> None:  # noqa: B027 (a save already settled has nothing to drop)
        """The caller may never await it (its run failed): the store writes it all the same, and a failure is
        not reported as unretrieved. The lease takes no other save until it is awaited or released."""


class _Saved(PendingSave):
    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        return iter(())


SAVED = _Saved()
"""A save that is durable already."""


class EpisodeStore(abc.ABC):
    """Durable records of episodes, one per `rollout_id`.

    Errors are `gymrpc.errors` classes, ready for the wire: ABORTED `LEASE_HELD` with a
    retry delay from `acquire`, ABORTED `CHECKPOINT_CONFLICT` from a save whose revision
    guard fails, DATA_LOSS from a corrupt record, INVALID_ARGUMENT for an invalid id.
    """

    @abc.abstractmethod
    async def acquire(self, rollout_id: str) -> EpisodeLease:
        """Take the episode's lease without waiting; ABORTED `LEASE_HELD` when another holder has it."""

    @abc.abstractmethod
    async def load(self, lease: EpisodeLease) -> EpisodeCheckpoint | None:
        """The stored record, or None when there is none or it was completed and has expired (then deleted)."""

    @abc.abstractmethod
    async def save(self, lease: EpisodeLease, record: EpisodeCheckpoint) -> None:
        """Replace the record; returns once it is durable.

        `record` may be an `EncodedCheckpoint` (gymrpc/store/encoded.py): its bytes are the same.
        `record.revision` must equal the stored revision (0 when there is none); the store
        writes `revision + 1` and `updated_at`, and sets both on `record`. On any failure
        `record` is left as it was and the stored record is unchanged or fully replaced.
        """

    async def begin_save(self, lease: EpisodeLease, record: EpisodeCheckpoint) -> PendingSave:
        """`save`, with the wait for the disk left to the caller: await the result to know it is durable.

        Once this returns, `record` is encoded and may change (its `revision` and `updated_at` are
        set). The lease's next save or load must wait until this one was awaited. A failure of the
        write raises where it is awaited, and restores `revision` and `updated_at` only. A store
        that cannot part the two (the default) saves before it returns.
        """
        await self.save(lease, record)
        return SAVED

    @abc.abstractmethod
    async def archive(self, lease: EpisodeLease, reason: str) -> str | None:
        """Keep a durable copy of the stored record for inspection; its location, or None if there is none.

        The record itself stays until the caller saves its replacement (with the stored
        revision, as always), so a crash in between leaves the old record, never none.
        """

    @abc.abstractmethod
    async def delete(self, lease: EpisodeLease) -> bool:
        """Delete the stored record, durably, so the episode's next run starts over; False if there was none.

        A damaged record is deleted too: this is how one episode that answers DATA_LOSS is let go
        without touching the others (`gymrpc episodes delete`).
        """

    @abc.abstractmethod
    async def delete_expired(self, now: float | None = None) -> int:
        """Delete completed records whose TTL has passed (skipping leased ones); how many were deleted."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Finish pending writes and free threads and files."""

    @contextlib.asynccontextmanager
    async def lease(self, rollout_id: str) -> AsyncIterator[EpisodeLease]:
        """`async with store.lease(id) as lease:` acquire, then release whatever happens."""
        held = await self.acquire(rollout_id)
        try:
            yield held
        finally:
            await held.release()
