"""`ControlPlane`: one participant's coordinated-checkpoint state machine (docs/design.md §7).

Every server runs one, whatever its role; the role plugs in through `Participant`. The
plane adds what must be the same everywhere:
- phases and fencing (`fencing.Fence`), under one lock so control calls never interleave;
- replay: a completed prepare, commit, restore, retire or forget, retried with the same
  arguments, gets its first reply; the same id with other arguments is CHECKPOINT_CONFLICT;
- one capture and one write per checkpoint: the capture (`Participant.capture`) is all the
  commit does while the episodes are parked; the write builds the records from it
  (`Capture.records`, in a worker thread) and stores them. A commit retried after a failed
  store step stores the same capture again; a write that outlives its deadline keeps
  running (shielded), and a retry waits for it;
- a commit with `background` replies once the capture is taken, so the controller can
  resume the episodes at once; the write starts on the first `persist` (which the
  controller sends once everyone is resumed), or by itself `WRITE_AFTER_RESUME` seconds
  after the resume, and runs on its own, untouched by the resume; `persist` waits for its
  manifest. A
  process that restarted has no such write and says so (CHECKPOINT_INCOMPLETE): the
  controller then never publishes the checkpoint. At most `MAX_UNFINISHED_CAPTURES` such
  writes are unfinished at once; one more background commit is RESOURCE_EXHAUSTED;
- a lease, `max(lease, deadline + lease_grace)`, renewed by every control call; when it
  runs out in any phase but idle the plane aborts by itself (as a resume would), so a
  controller that vanished never leaves admission closed;
- deadlines on every step: waits end at the deadline, I/O past it fails the call;
- replicas: each replica of a name writes its own folder (`store.participant_dir`), and a
  restore may read every replica's records and install only those `gymrpc.balancing.place`
  puts on this replica (`Placement`), so a checkpoint restores onto any number of replicas
  and each restored session lands where clients will route its calls.
"""

from __future__ import annotations

import asyncio
import enum
import errno
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gymrpc.balancing import place
from gymrpc.control import collection, store
from gymrpc.control.faults import armed, crash_point
from gymrpc.control.fencing import Fence, Op, ResumeOutcome
from gymrpc.control.lease import Lease
from gymrpc.control.participant import Capture, Participant, Scope
from gymrpc.control.replay import Replies, conflict
from gymrpc.control.types import EpisodeKey, Kind, Phase, Report
from gymrpc.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from gymrpc.ids import check_endpoint_id, check_id, check_service_name
from gymrpc.v1 import checkpoint_records_pb2 as rec_pb
from gymrpc.v1 import participant_service_pb2 as pb

log = logging.getLogger(__name__)
DEFAULT_LEASE_GRACE = 120.0
REMEMBERED_PERSISTS = 16
"""Finished background writes kept for `persist` (their manifests, or their captures to write again)."""
WRITE_AFTER_RESUME = 1.0
"""Seconds after its resume a captured write starts if no `persist` started it first (a controller that
vanished): the controller persists once every participant is resumed, so writes never slow the resumes."""
MAX_UNFINISHED_CAPTURES = 8
"""Background writes not finished yet, each holding its capture in memory; a commit past it is refused."""
PERMANENT_ERRNOS = frozenset(
    {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENAMETOOLONG, errno.ELOOP}
)
"""Write failures a retried commit cannot fix (FAILED_PRECONDITION); others (ENOSPC, EIO) may pass (UNAVAILABLE)."""
NOTHING_WRITTEN_REASONS = frozenset({"CHECKPOINT_INCOMPLETE", "STALE_CHECKPOINT"})
"""FAILED_PRECONDITION reasons with which an abandon (`Persist` with `abandon`) says that nothing of the
checkpoint is, or will be, written here (never captured here, or already stopped): as good as a confirmation."""


def writes_nothing(error: BaseException) -> bool:
    """`error`, an abandon's reply, still confirms that the member writes nothing more into the checkpoint's
    folder, so the controller may remove it (`Controller.discard`)."""
    return isinstance(error, FailedPrecondition) and error.reason in NOTHING_WRITTEN_REASONS


@dataclass(frozen=True)
class Status:
    kind: Kind
    name: str
    phase: Phase
    checkpoint_id: str
    lease_expires_at: float | None
    report: Report
    retired: dict[str, int]
    pid: int
    started_at: float
    details: dict[str, str] = field(default_factory=dict)
    endpoint_id: str = "0"


@dataclass(frozen=True)
class Placement:
    """Which replicas' records a restore reads, and which of them it installs here (`RestoreRequest`)."""

    sources: tuple[str, ...] = ()
    """Endpoint ids of the replicas (of this name, when they committed) whose records to read;
    empty: this replica's own folder."""
    replicas: tuple[str, ...] = ()
    """Endpoint ids of every replica restored into; a record is installed on the one
    `place(participant.placement_key(record), replicas)` names. Empty: install every record read."""
    target: str = ""
    """The replica the request is meant for (a stale address reaches another); empty: not checked."""


class _Stage(enum.Enum):
    """Where a checkpoint's write stands."""

    CAPTURED = "captured"
    """A background commit took its capture; the write starts on the first `persist` (or a moment after
    the resume), so building and hashing the records never competes with the captures and the resumes."""
    WRITING = "writing"
    """`task` builds and writes the records (or ended, and no `persist` reported it yet)."""
    WRITTEN = "written"
    """The manifest is durable; the capture was let go."""
    FAILED = "failed"
    """A `persist` reported the write's failure: the next one writes the same capture again."""
    ABANDONED = "abandoned"
    """The controller gave up on the checkpoint (`abandon`): the write was stopped and is never started again."""


@dataclass
class _Write:
    """The one capture and write of a checkpoint; a retried commit reuses it."""

    checkpoint_id: str
    args: tuple[Any, ...]
    capture: Capture | None
    """What the records are built from; let go once they are durable (a failed write keeps it, to retry)."""
    background: bool = False
    """Taken by a `background` commit: the write outlives the resume, `persist` reports it."""
    stage: _Stage = _Stage.CAPTURED
    stop: store.WriteStop = field(default_factory=store.WriteStop)
    task: asyncio.Task[pb.CheckpointManifest] | None = None
    capture_s: float = 0.0
    """Time the capture took (the episodes stay parked for it; a background commit resumes here)."""
    build_s: float = 0.0
    """Time building the records from the capture took, in the write."""
    write_s: float = 0.0
    """Time the records file and manifest took (write, fsync), after the records were built."""

    @property
    def root(self) -> Path:
        return Path(self.args[0])

    @property
    def base_dir(self) -> str:
        return str(self.args[4])

    @property
    def unfinished(self) -> bool:
        return self.stage is not _Stage.ABANDONED and (self.task is None or not self.task.done())


class ControlPlane:
    def __init__(
        self,
        participant: Participant,
        *,
        name: str,
        endpoint_id: str = "0",
        lease_grace: float = DEFAULT_LEASE_GRACE,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.participant = participant
        self.name = check_service_name(name)
        self.endpoint_id = check_endpoint_id(endpoint_id)
        """Replica id behind `name`: names this replica's checkpoint folder."""
        self.clock = clock
        self.fence = Fence()
        self.lease = Lease(lease_grace, clock, self._lease_expired)
        self.replies = Replies()
        self.last_abort = ""
        self.started_at = clock()
        self._lock = asyncio.Lock()
        self._write: _Write | None = None
        self._persisting: OrderedDict[str, _Write] = OrderedDict()
        self._stopped: OrderedDict[str, _Write] = OrderedDict()
        """Writes a resume stopped before they ended (a slow or hung disk): `abandon` waits for them."""
        self._retiring = 0
        self._written: store.Written | None = None
        """Where the records of the last finished write lie: the base of an incremental commit."""
        self.awaiting_restore = False
        """Started closed for a restore (`await_restore`): a restore or any resume opens admission."""

    @property
    def kind(self) -> Kind:
        return self.participant.kind

    def await_restore(self) -> None:
        """Keep admission closed until a restore (then its resume) or an explicit resume opens it.

        For a process restarted to be restored into: a client retrying into it first would
        make it "not fresh" and the restore would be refused.
        """
        self.awaiting_restore = True
        self.participant.admission.close()

    def start(self) -> None:
        """Start the lease watcher (needs the running loop)."""
        self.lease.start()

    async def close(self) -> None:
        collection.release(self)
        await self.lease.close()

    # -- queries -----------------------------------------------------------------------------

    def readiness(self) -> Report:
        report = self.participant.readiness()
        return replace(report, busy=report.busy + self._retiring) if self._retiring else report

    def status(self) -> Status:
        details = {**self.participant.details()}
        if self.last_abort:
            details["last_abort"] = self.last_abort
        if self.awaiting_restore:
            details["awaiting_restore"] = "true"
        if writing := sum(1 for w in self._persisting.values() if w.unfinished):
            details["persisting"] = str(writing)
        report = self.readiness()
        if extra := self.participant.status_counts():
            report = replace(report, counts={**report.counts, **extra})
        return Status(
            kind=self.kind,
            name=self.name,
            phase=self.fence.phase,
            checkpoint_id=self.fence.active or "",
            lease_expires_at=self.lease.expires_at,
            report=report,
            retired=dict(self.participant.marks.snapshot()),
            pid=os.getpid(),
            started_at=self.started_at,
            details=details,
            endpoint_id=self.endpoint_id,
        )

    # -- prepare / renew ---------------------------------------------------------------------

    async def prepare(self, checkpoint_id: str, deadline: float) -> tuple[Phase, Report]:
        """Close admission and wait (until `deadline`) for in-flight work to park."""
        check_id(checkpoint_id, "checkpoint_id")
        self._check_deadline(deadline)
        async with self._lock:
            if (cached := self.replies.get(Op.PREPARE, checkpoint_id, ())) is not None:
                return cached
            self.fence.check(Op.PREPARE, checkpoint_id)
            self.lease.renew(deadline)
            if self.fence.phase is Phase.IDLE:
                self.fence.open(checkpoint_id, Phase.PREPARING)
                try:
                    await self.participant.close_admission()
                except BaseException:
                    await self._abandon(checkpoint_id)
                    raise
            if (report := self.readiness()).ready:  # nothing in flight: prepared without waiting
                return self._prepared(checkpoint_id, report)
        try:
            report = await self._wait_ready(checkpoint_id, deadline)
        except Exception:
            async with self._lock:
                if self.fence.active == checkpoint_id:
                    await self._abandon(checkpoint_id)
            raise
        async with self._lock:
            if (cached := self.replies.get(Op.PREPARE, checkpoint_id, ())) is not None:
                return cached  # a concurrent retry got there first
            self.fence.check(Op.PREPARE, checkpoint_id)  # resumed while we waited: STALE_CHECKPOINT
            if not report.ready:
                log.info("prepare missed its deadline", extra={"checkpoint_id": checkpoint_id})
                return Phase.PREPARING, report
            return self._prepared(checkpoint_id, report)

    def _prepared(self, checkpoint_id: str, report: Report) -> tuple[Phase, Report]:
        """Ready: move to PREPARED and remember the reply (under the lock)."""
        self.fence.advance(checkpoint_id, Phase.PREPARED)
        reply = (Phase.PREPARED, report)
        self.replies.put(Op.PREPARE, checkpoint_id, (), reply)
        return reply

    async def _wait_ready(self, checkpoint_id: str, deadline: float) -> Report:
        while True:
            report = self.readiness()
            left = deadline - self.clock()
            if report.ready or left <= 0 or self.fence.active != checkpoint_id:
                return report
            await self.participant.changed.wait(min(left, 1.0))

    async def renew(self, checkpoint_id: str, deadline: float) -> float:
        check_id(checkpoint_id, "checkpoint_id")
        self._check_deadline(deadline)
        async with self._lock:
            self.fence.check(Op.RENEW, checkpoint_id)
            return self.lease.renew(deadline)

    # -- commit ------------------------------------------------------------------------------

    async def commit(
        self,
        checkpoint_id: str,
        deadline: float,
        checkpoint_dir: str,
        scope: Scope,
        stop: bool = False,
        background: bool = False,
        base_dir: str = "",
    ) -> pb.CheckpointManifest | None:
        """Capture once, build and write the records file, then the manifest; all before `deadline`.

        `background`: reply (None) right after the capture, so the episodes parked for it can
        resume; the write goes on and `persist` returns its manifest. `base_dir`: the previous
        published checkpoint of the same root; records already there are referred to, not written.
        """
        check_id(checkpoint_id, "checkpoint_id")
        root = store.check_checkpoint_dir(checkpoint_dir)
        if base_dir and (store.check_checkpoint_dir(base_dir).parent != root.parent or base_dir == str(root)):
            raise InvalidArgument(
                f"base_checkpoint_dir {base_dir[:200]!r} must be another checkpoint of the root of {str(root)[:200]}",
                metadata={"field": "base_checkpoint_dir"},
            )
        self._check_deadline(deadline)
        args = (str(root), scope, stop, background, base_dir)
        async with self._lock:
            if (cached := self.replies.get(Op.COMMIT, checkpoint_id, args)) is not None:
                return cached if cached.checkpoint_id else None  # an empty manifest: captured, persisting
            self.fence.check(Op.COMMIT, checkpoint_id)
            self.lease.renew(deadline)
            write = self._write
            if write is None or write.checkpoint_id != checkpoint_id:
                if background:
                    self._check_room(checkpoint_id)
                started = time.perf_counter()
                capture = await self._capture(scope)
                write = _Write(checkpoint_id, args, capture, background=background)
                write.capture_s = time.perf_counter() - started
                self._write = write
            elif write.args != args:
                raise conflict(checkpoint_id, "was already committed to another directory or scope")
            if background:
                return await self._captured(write, scope, stop)
            if write.task is None or _failed(write.task):
                self._start(write)
        try:
            async with asyncio.timeout(max(deadline - self.clock(), 0.0)):
                manifest = await asyncio.shield(write.task)
        except TimeoutError:
            raise DeadlineExceeded(
                f"the write of checkpoint {checkpoint_id!r} did not finish by the deadline; it continues, "
                "and a retried commit waits for it",
                metadata={"checkpoint_id": checkpoint_id},
            ) from None
        async with self._lock:
            if (cached := self.replies.get(Op.COMMIT, checkpoint_id, args)) is not None:
                return cached
            self.fence.check(Op.COMMIT, checkpoint_id)  # resumed while it wrote: STALE_CHECKPOINT
            await self.participant.delete_restored(scope)
            if stop:
                await self.participant.park_exported(scope)
            self.fence.advance(checkpoint_id, Phase.COMMITTED)
            self.replies.put(Op.COMMIT, checkpoint_id, args, manifest)
            log.info(
                "committed",
                extra={
                    "checkpoint_id": checkpoint_id,
                    "records": manifest.record_count,
                    "bytes": manifest.size_bytes,
                    "capture_ms": round(write.capture_s * 1e3, 1),
                    "build_ms": round(write.build_s * 1e3, 1),
                    "write_ms": round(write.write_s * 1e3, 1),
                },
            )
            return manifest

    def _check_room(self, checkpoint_id: str) -> None:
        """RESOURCE_EXHAUSTED when `MAX_UNFINISHED_CAPTURES` background writes are unfinished (under the lock)."""
        unfinished = [k for k, w in self._persisting.items() if w.unfinished]
        if len(unfinished) >= MAX_UNFINISHED_CAPTURES:
            raise ResourceExhausted(
                f"{self.name} holds the captures of {len(unfinished)} checkpoints whose writes have not finished "
                f"({', '.join(unfinished[:4])}{' ...' if len(unfinished) > 4 else ''}), its limit; checkpoint "
                f"{checkpoint_id!r} was not captured: wait for those writes (persist them), then commit again",
                metadata={"checkpoint_id": checkpoint_id, "unfinished": str(len(unfinished))},
            )

    def _start(self, write: _Write) -> None:
        """Start (or start again) the write of `write`'s capture (under the lock)."""
        write.stage = _Stage.WRITING
        write.task = asyncio.get_running_loop().create_task(self._store(write))
        write.task.add_done_callback(_retrieved)  # a write nobody awaits any more may still fail

    def _start_captured(self, write: _Write) -> None:
        """Start a captured write no `persist` started yet (no await: atomic with the lock's holders)."""
        if write.stage is _Stage.CAPTURED and self._persisting.get(write.checkpoint_id) is write:
            self._start(write)

    async def _captured(self, write: _Write, scope: Scope, stop: bool) -> None:
        """A background commit's capture is taken (under the lock): remember it and commit.

        The write leaves `_write`, so a resume no longer stops it: once captured, the records
        are this checkpoint's whatever the episodes do next. It starts on `persist`.
        """
        checkpoint_id = write.checkpoint_id
        self._write = None
        self._persisting[checkpoint_id] = write
        self._persisting.move_to_end(checkpoint_id)
        done = [k for k, w in self._persisting.items() if not w.unfinished]
        for old in done[: max(len(self._persisting) - REMEMBERED_PERSISTS, 0)]:
            del self._persisting[old]
        await self.participant.delete_restored(scope)
        if stop:
            await self.participant.park_exported(scope)
        self.fence.advance(checkpoint_id, Phase.COMMITTED)
        self.replies.put(Op.COMMIT, checkpoint_id, write.args, pb.CheckpointManifest())
        log.info(
            "captured",
            extra={
                "checkpoint_id": checkpoint_id,
                "episodes": write.capture.episodes if write.capture is not None else 0,
                "capture_ms": round(write.capture_s * 1e3, 1),
            },
        )

    def capture_seconds(self, checkpoint_id: str) -> float | None:
        """How long the capture of a background commit still remembered here took (for benchmarks)."""
        write = self._persisting.get(checkpoint_id)
        return None if write is None else write.capture_s

    async def persist(self, checkpoint_id: str, deadline: float) -> pb.CheckpointManifest:
        """The manifest of a background commit's write, once durable (waits until `deadline`).

        Any phase: the checkpoint is usually resumed by now. A write whose failure a persist
        already reported is started again from the same capture. No such commit here
        (this process restarted after the capture, or never committed it): CHECKPOINT_INCOMPLETE,
        the checkpoint cannot be published.
        """
        check_id(checkpoint_id, "checkpoint_id")
        self._check_deadline(deadline)
        async with self._lock:
            write = self._persisting.get(checkpoint_id)
            if write is None:
                raise FailedPrecondition(
                    f"{self.name} holds no captured commit of checkpoint {checkpoint_id!r} (this process "
                    f"restarted after the capture, or it was never committed here); it cannot be published",
                    reason="CHECKPOINT_INCOMPLETE",
                    metadata={"checkpoint_id": checkpoint_id, "name": self.name},
                )
            if write.stage is _Stage.ABANDONED:
                raise FailedPrecondition(
                    f"checkpoint {checkpoint_id!r} was abandoned by its controller; it is never published",
                    reason="STALE_CHECKPOINT",
                    metadata={"checkpoint_id": checkpoint_id, "name": self.name},
                )
            if write.stage in (_Stage.CAPTURED, _Stage.FAILED):  # its first persist, or a failure reported
                self._start(write)
            task = write.task
            assert task is not None
        try:
            async with asyncio.timeout(max(deadline - self.clock(), 0.0)):
                manifest = await asyncio.shield(task)
        except TimeoutError:
            raise DeadlineExceeded(
                f"the write of checkpoint {checkpoint_id!r} did not finish by the deadline; it continues, "
                "and a retried persist waits for it",
                metadata={"checkpoint_id": checkpoint_id},
            ) from None
        except Exception:
            if write.task is task and write.stage is _Stage.WRITING:
                write.stage = _Stage.FAILED  # reported: the next persist writes again
            raise
        return manifest

    async def abandon(self, checkpoint_id: str, deadline: float) -> None:
        """Stop a commit's write for good and return once it has ended (until `deadline`).

        The controller will not publish the checkpoint and deletes its folder once every member
        answered: after this returns, this process writes nothing more into it. No such commit
        here: CHECKPOINT_INCOMPLETE, as for `persist` (nothing of it is being written here).
        """
        check_id(checkpoint_id, "checkpoint_id")
        self._check_deadline(deadline)
        async with self._lock:
            write = self._persisting.get(checkpoint_id) or self._stopped.get(checkpoint_id)
            if write is None and self._write is not None and self._write.checkpoint_id == checkpoint_id:
                write = self._write  # a stop-the-world commit still open
            if write is None:
                raise FailedPrecondition(
                    f"{self.name} holds no commit of checkpoint {checkpoint_id!r}; nothing of it is written here",
                    reason="CHECKPOINT_INCOMPLETE",
                    metadata={"checkpoint_id": checkpoint_id, "name": self.name},
                )
            write.stage = _Stage.ABANDONED  # never started (again) from here on
            if write is not self._write:
                write.capture = None  # an open commit's retry still finds it (and is stopped at once)
            task = write.task
            await asyncio.to_thread(write.stop.stop)  # from here on, no manifest appears for it
        if task is not None and not task.done():
            try:
                async with asyncio.timeout(max(deadline - self.clock(), 0.0)):
                    await asyncio.wait([task])  # the write stops at its next record
            except TimeoutError:
                raise DeadlineExceeded(
                    f"the stopped write of checkpoint {checkpoint_id!r} had not ended by the deadline; "
                    "retry the abandon",
                    metadata={"checkpoint_id": checkpoint_id},
                ) from None
        log.info("abandoned", extra={"checkpoint_id": checkpoint_id})

    async def _capture(self, scope: Scope) -> Capture:
        report = self.readiness()
        if not report.ready:
            raise FailedPrecondition(
                f"readiness regressed before the commit ({len(report.blockers) + report.busy} blockers); "
                "resume and prepare again",
                reason="INVALID_PHASE",
            )
        if scope is not None and report.restarts and (named := sorted(e for e in report.restarts if e in scope)):
            raise FailedPrecondition(
                f"the commit scope names episodes that can only restart: {', '.join(map(str, named[:10]))}",
                reason="RESTART_IN_SCOPE",
                metadata={"episodes": ",".join(map(str, named[:10]))},
            )
        return await self.participant.capture(scope)

    async def _store(self, write: _Write) -> pb.CheckpointManifest:
        """Build the records from the capture and write them, in a worker thread."""
        root = write.root
        if write.background and armed("persist_before_write"):  # the controller resumed on the capture alone
            crash_point("persist_before_write")
        started = time.perf_counter()
        try:
            if write.capture is not None and write.capture.settle is not None:
                await write.capture.settle()  # copy-on-write: what the episodes did not change yet
            manifest = await asyncio.to_thread(self._build_and_write, write)
            write.capture, write.stage = None, _Stage.WRITTEN
            if write.background:
                log.info(
                    "persisted",
                    extra={
                        "checkpoint_id": write.checkpoint_id,
                        "records": manifest.record_count,
                        "bytes": manifest.size_bytes,
                        "build_ms": round(write.build_s * 1e3, 1),
                        "write_ms": round((time.perf_counter() - started) * 1e3, 1),
                    },
                )
            return manifest
        except store.WriteStopped:
            raise FailedPrecondition(
                f"checkpoint {write.checkpoint_id!r} was resumed while it was written; no manifest was published",
                reason="STALE_CHECKPOINT",
            ) from None
        except OSError as exc:
            if exc.errno in PERMANENT_ERRNOS:
                path = exc.filename or root
                raise FailedPrecondition(
                    f"writing checkpoint {write.checkpoint_id!r} failed: {exc.strerror} ({path}); a retry will not "
                    "help: fix the checkpoint folder or commit to another one",
                    reason="STORAGE_FAILURE",
                    metadata={"path": str(path), "errno": errno.errorcode.get(exc.errno or 0, str(exc.errno))},
                ) from None
            raise Unavailable(
                f"writing checkpoint {write.checkpoint_id!r} failed: {exc}; retry the commit",
                reason="BACKEND_FAILURE",
            ) from None
        finally:
            write.write_s = time.perf_counter() - started - write.build_s

    def _build_and_write(self, write: _Write) -> pb.CheckpointManifest:
        """Worker thread: the capture's records, then the records file and the manifest."""
        capture = write.capture
        assert capture is not None, "a written capture is not written again"
        started = time.perf_counter()
        records = []
        for record in store.yielding(capture.build()):
            write.stop.check()  # resumed or abandoned: stop building, nothing is written
            records.append(record)
        write.build_s = time.perf_counter() - started
        base = self._written
        if not write.base_dir or base is None or str(base.checkpoint_dir) != write.base_dir or not base.usable():
            base = None  # not incremental, or this process did not write that base (restarted): write everything
        track = store.Written(write.root)
        manifest = store.write_checkpoint(
            write.root, self.kind, self.name, write.checkpoint_id, records, write.stop, self.endpoint_id, base, track
        )
        self._written = track
        return manifest

    # -- resume ------------------------------------------------------------------------------

    async def resume(self, checkpoint_id: str, reply_sent: collection.ReplySent | None = None) -> bool:
        """Reopen admission, aborting the checkpoint if it was not committed; True if already resumed.

        `reply_sent`: how to learn that the Resume reply went out (the servicer's RPC context); the
        cyclic collector, held since a background commit, comes back then (at once without it)."""
        check_id(checkpoint_id, "checkpoint_id")
        async with self._lock:
            outcome = self.fence.resume_outcome(checkpoint_id)
            if outcome is ResumeOutcome.ALREADY:
                return True
            if outcome is ResumeOutcome.RECORD_ONLY:
                self.fence.close(checkpoint_id)  # a late prepare of this id must not close admission
                if self.awaiting_restore:  # the explicit open of a process that awaited a restore
                    self.awaiting_restore = False
                    await self.participant.open_admission()
                return False
            await self._reopen(checkpoint_id, reply_sent)
            return False

    async def _reopen(self, checkpoint_id: str, reply_sent: collection.ReplySent | None = None) -> None:
        collection.release_after_reply(self, reply_sent)  # held since a background commit (`collection`)
        if (captured := self._persisting.get(checkpoint_id)) is not None and captured.stage is _Stage.CAPTURED:
            # Its write goes on (the capture is the commit): on persist, or soon without one.
            asyncio.get_running_loop().call_later(WRITE_AFTER_RESUME, self._start_captured, captured)
        write, self._write = self._write, None
        if write is not None:
            await asyncio.to_thread(write.stop.stop)  # from here on, no manifest appears for it
            if write.task is not None and not write.task.done():  # it ends at its next record: `abandon` waits
                self._stopped[write.checkpoint_id] = write
                while len(self._stopped) > REMEMBERED_PERSISTS:
                    self._stopped.popitem(last=False)
        await self.participant.open_admission()
        self.fence.close(checkpoint_id)
        self.replies.drop(checkpoint_id)
        self.lease.clear()
        self.participant.changed.notify()

    async def _abandon(self, checkpoint_id: str) -> None:
        """Undo a prepare or restore that failed before taking effect (the id stays usable)."""
        await self.participant.open_admission()
        self.fence.abandon(checkpoint_id)
        self.lease.clear()

    # -- restore -----------------------------------------------------------------------------

    async def restore(
        self,
        checkpoint_id: str,
        deadline: float,
        checkpoint_dir: str,
        episodes: Sequence[EpisodeKey],
        placement: Placement | None = None,
        *,
        allow_weight_version_mismatch: bool = False,
    ) -> tuple[str, list[EpisodeKey]]:
        """Install a committed checkpoint into this fresh process, all or nothing.

        `placement`: read the records of several replicas and install the ones placed here.
        `allow_weight_version_mismatch`: a model server installs records committed under other
        weights than it has loaded (else WEIGHT_VERSION_MISMATCH).
        """
        check_id(checkpoint_id, "checkpoint_id")
        root = store.check_checkpoint_dir(checkpoint_dir)
        self._check_deadline(deadline)
        sources, replicas = self._check_placement(placement or Placement())
        scope = frozenset(episodes)
        args = (str(root), scope, sources, replicas, allow_weight_version_mismatch)
        async with self._lock:
            if (cached := self.replies.get(Op.RESTORE, checkpoint_id, args)) is not None:
                return cached
            self.fence.check(Op.RESTORE, checkpoint_id)
            why = self.participant.not_fresh()
            reason = "NOT_FRESH" if why is not None else None
            if why is None and (
                fenced := sorted(e.next() for e in scope if self.participant.marks.is_retired(e.next()))
            ):
                # An earlier restore failed and its cleanup retired these attempts here: installing them
                # again would succeed, and then every call of theirs would get STALE_ATTEMPT.
                why = f"attempts {', '.join(map(str, fenced[:10]))} were fenced by an earlier failed restore"
            if why is not None:
                raise FailedPrecondition(
                    f"{self.name} cannot restore: {why}; restore only into freshly started processes",
                    reason=reason,
                    metadata={"name": self.name},
                )
            stop = threading.Event()
            reading = asyncio.ensure_future(asyncio.to_thread(self._read, root, sources, stop))
            reading.add_done_callback(_retrieved)
            try:
                async with asyncio.timeout(max(deadline - self.clock(), 0.0)):
                    manifest, records, held = await asyncio.shield(reading)
                    if missing := sorted(e for e in scope if e not in held):
                        shown = ", ".join(map(str, missing[:10]))
                        raise NotFound(
                            f"checkpoint {manifest.checkpoint_id!r} in {str(root)[:200]} holds no episode "
                            f"{shown}{' ...' if len(missing) > 10 else ''}; nothing was restored",
                            metadata={"episodes": shown, "missing": str(len(missing))},
                        )
                    self.participant.check_records(records, allow_weight_version_mismatch=allow_weight_version_mismatch)
                    selected = self.participant.select(records, scope)
                    if replicas:  # only the records placed on this replica
                        selected, placed = self._placed_here(selected, scope, replicas)
                    else:
                        placed = scope
                    staged = await self.participant.stage(selected, placed)
            except TimeoutError:
                stop.set()
                await asyncio.wait([reading])  # the read ends within a chunk; answer once it has
                raise DeadlineExceeded(
                    f"restore of {root} did not finish by the deadline; nothing was installed"
                ) from None
            finally:
                stop.set()  # cancelled, or failed elsewhere: the read must not go on without us
            crash_point("restore_before_install")
            await self.participant.close_admission()
            try:
                restored = await asyncio.shield(asyncio.ensure_future(self.participant.install(staged)))
            except BaseException:
                await self.participant.open_admission()
                raise
            self.participant.marks.mark(scope)  # attempt N is superseded by N+1 on this server
            self.awaiting_restore = False  # this restore's resume opens admission
            self.fence.open(checkpoint_id, Phase.RESTORED)
            self.lease.renew(deadline)
            reply = (manifest.checkpoint_id, restored)
            self.replies.put(Op.RESTORE, checkpoint_id, args, reply)
            log.info(
                "restored",
                extra={
                    "checkpoint_id": checkpoint_id,
                    "episodes": len(restored),
                    "records": len(selected),
                    "records_read": len(records),
                    "sources": ",".join(sources),
                },
            )
            return reply

    def _check_placement(self, placement: Placement) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Validated (sources, replicas); a request for another replica is UNAVAILABLE: resolve again."""
        if placement.target and placement.target != self.endpoint_id:
            raise Unavailable(
                f"this is replica {self.endpoint_id} of {self.name}, not replica {placement.target[:64]!r}: "
                "the caller's address is stale; resolve the name again",
                metadata={"name": self.name, "endpoint_id": self.endpoint_id},
            )
        ids = {}
        for field_name, values in (("source_endpoint_ids", placement.sources), ("endpoint_ids", placement.replicas)):
            for value in values:
                try:
                    check_endpoint_id(value)
                except InvalidArgument:
                    raise InvalidArgument(
                        f"{field_name} holds an invalid endpoint id {value[:64]!r}", metadata={"field": field_name}
                    ) from None
            ids[field_name] = tuple(dict.fromkeys(values))  # duplicates collapse, order is kept
        replicas = tuple(sorted(ids["endpoint_ids"]))
        if replicas and self.endpoint_id not in replicas:
            raise InvalidArgument(
                f"endpoint_ids {', '.join(replicas[:10])} leave out this replica ({self.endpoint_id}); "
                "name every replica restored into",
                metadata={"field": "endpoint_ids"},
            )
        return ids["source_endpoint_ids"] or (self.endpoint_id,), replicas

    def _read(
        self, root: Path, sources: Sequence[str], stop: threading.Event
    ) -> tuple[pb.CheckpointManifest, list[rec_pb.CheckpointRecord], set[tuple[str, int]]]:
        """Every source replica's verified records, in source order, all of one checkpoint (until `stop`),
        and the episodes the checkpoint holds (`store.checkpoint_episodes`)."""
        manifest, records = store.read_checkpoint(root, self.kind, self.name, sources[0], stop)
        for source in sources[1:]:
            other, more = store.read_checkpoint(root, self.kind, self.name, source, stop)
            if other.checkpoint_id != manifest.checkpoint_id:
                raise DataLoss(
                    f"{root}: replica {source} of {self.name} holds checkpoint {other.checkpoint_id!r}, replica "
                    f"{sources[0]} holds {manifest.checkpoint_id!r}; nothing was restored"
                )
            records.extend(more)
        return manifest, records, store.checkpoint_episodes(root)

    def _placed_here(
        self, records: Sequence[rec_pb.CheckpointRecord], scope: frozenset[EpisodeKey], replicas: Sequence[str]
    ) -> tuple[list[rec_pb.CheckpointRecord], frozenset[EpisodeKey]]:
        """The records whose calls clients route to this replica, and the episodes to stage here.

        Those episodes are the ones of the records kept, and those whose rollout id is placed
        here (a role that installs something for every episode, such as the model's empty
        ledger, does it where the episode's `Generate` calls go).
        """
        kept, placed = [], {e for e in scope if place(e.rollout_id, replicas) == self.endpoint_id}
        for record in records:
            key = self.participant.placement_key(record)
            if key is None:
                kept.append(record)  # shared by episodes (table blocks): every replica needs it
            elif place(key, replicas) == self.endpoint_id:
                kept.append(record)
                if (episode := EpisodeKey.of(record.episode_id)) in scope:
                    placed.add(episode)
        return kept, frozenset(placed)

    # -- retire / forget ---------------------------------------------------------------------

    async def retire(self, operation_id: str, deadline: float, episodes: Sequence[EpisodeKey]) -> list[EpisodeKey]:
        """Mark the attempts (the mark outlives a failure), stop their work, free their state."""
        check_id(operation_id, "checkpoint_id")
        self._check_deadline(deadline)
        if not episodes:
            raise InvalidArgument(
                "episode_ids is empty; name the attempts to retire", metadata={"field": "episode_ids"}
            )
        args = (frozenset(episodes),)
        async with self._lock:
            if (cached := self.replies.get(Op.RETIRE, operation_id, args)) is not None:
                return cached
            self.fence.check(Op.RETIRE, operation_id)
            self.participant.marks.mark(episodes)
            self._retiring += 1
        try:
            async with asyncio.timeout(max(deadline - self.clock(), 0.0)):
                await self.participant.retire(list(episodes))
        except TimeoutError:
            raise DeadlineExceeded("retire did not finish by the deadline; the attempts stay marked") from None
        finally:
            self._retiring -= 1
            self.participant.changed.notify()
        reply = list(episodes)
        async with self._lock:
            self.replies.put(Op.RETIRE, operation_id, args, reply)
        return reply

    async def forget(self, operation_id: str, rollout_ids: Sequence[str]) -> list[str]:
        check_id(operation_id, "checkpoint_id")
        ids = sorted({check_id(r, "rollout_ids") for r in rollout_ids})
        if not ids:
            raise InvalidArgument("rollout_ids is empty", metadata={"field": "rollout_ids"})
        args = (tuple(ids),)
        async with self._lock:
            if (cached := self.replies.get(Op.FORGET, operation_id, args)) is not None:
                return cached
            self.fence.check(Op.FORGET, operation_id)
            self.participant.marks.forget(ids)
            await self.participant.forget(ids)
            self.replies.put(Op.FORGET, operation_id, args, ids)
            return ids

    # -- lease -----------------------------------------------------------------------------

    async def _lease_expired(self) -> None:
        """The controller went silent: abort (or end) the open checkpoint, as its resume would."""
        async with self._lock:
            active = self.fence.active
            if active is None or not self.lease.expired:
                return
            phase = self.fence.phase.name.lower()
            self.last_abort = f"lease of {active!r} expired in phase {phase}"
            log.warning("lease_expired: aborting", extra={"checkpoint_id": active, "phase": phase})
            try:
                await self._reopen(active)
            except Exception:
                log.exception("auto-abort failed", extra={"checkpoint_id": active})

    # -- helpers -----------------------------------------------------------------------------

    def _check_deadline(self, deadline: float) -> None:
        if not math.isfinite(deadline):
            raise InvalidArgument("deadline must be set to a finite time", metadata={"field": "deadline"})
        if deadline <= self.clock():
            raise DeadlineExceeded("the deadline has already passed; nothing was done")


def _retrieved(task: asyncio.Task[Any]) -> None:
    """Mark a write's failure as seen: the commit that started it may have given up at its deadline."""
    if not task.cancelled():
        task.exception()


def _failed(task: asyncio.Task[Any]) -> bool:
    return task.done() and (task.cancelled() or task.exception() is not None)
