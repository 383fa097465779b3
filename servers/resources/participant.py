"""The resources participant: many sessions exported, restored and retired at once (docs/design.md §7).

Modes, declared by the environment (`Environment.checkpoint_mode`):
- `exported`: sessions are snapshotted with `Session.export` and restored with
  `Environment.restore`; a `TableEnvironment` (workplace) instead stores one manifest per
  session and each distinct table block once, as `table_block` records of the same records
  file (so the manifest's sha256 covers them): untouched sessions share their seed blocks
  and cost a few hundred bytes each. Its restore checks every block's hash, decodes each
  once and builds every session before installing any;
- `stateless`: a record keeps the session id and its seed task; restore seeds it again;
- `restart_only`: nothing is checkpointed; live sessions are reported as restarts (and a
  commit naming one fails with RESTART_IN_SCOPE), calls never block a prepare, and only
  seeds wait while a checkpoint is open.

`checkpoint_verify` says what `Verify` does while a checkpoint is open: `wait` (it waits
for resume and a running one blocks prepare; for verifies that change state) or `replay`
(it runs on and never blocks: the episode counts as parked before verify, and after a
crash the restored agent verifies again).

The data plane is gated by wrapping the servicer's methods (`gate_servicer`), so the
servicer itself stays free of checkpoint logic. A server is ready when no blocking call
is in flight. A session whose last verify raised is left out of captures (its episode
failed; as the reference, where such a verify drops the session). Session exports and
restores run in worker threads (inline only for `runs_inline` environments).

A commit's capture takes, per session, its cached replies (immutable results) and its state:
`Session.capture`, which an environment overrides when its state is cheaper to take than
to encode (the counter copies two integers), else the session's `export` at once; a table
session's `export_tables` (only changed tables are encoded again). The records, hashes and
shared blocks are made by the write, after the resume.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from gymrpc.control import Capture, EpisodeKey, Kind, Participant, Report, Scope
from gymrpc.control.admission import WhenClosed
from gymrpc.envkit import (
    CheckpointMode,
    Session,
    SnapshotCorrupt,
    SnapshotFormat,
    SnapshotUnsupported,
    StepResult,
    TableEnvironment,
    TableSession,
    ToolResult,
)
from gymrpc.errors import DataLoss, FailedPrecondition, GymrpcError
from gymrpc.ids import check_id
from gymrpc.messages import task_spec, tool_definition
from gymrpc.servers.resources.frozen import Frozen
from gymrpc.servers.resources.service import SNAPSHOT_PROTOCOL_VERSION, ResourcesServicer, session_snapshot
from gymrpc.servers.resources.sessions import EpisodeKey as HostKey
from gymrpc.servers.resources.sessions import Reply, Slot
from gymrpc.v1 import checkpoint_records_pb2 as rec_pb
from gymrpc.v1 import common_pb2
from gymrpc.v1 import resources_service_pb2 as pb

VERIFY_MODES = {"wait": pb.CHECKPOINT_VERIFY_WAIT, "replay": pb.CHECKPOINT_VERIFY_REPLAY}
Handler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


@dataclass
class _Staged:
    """Decoded sessions (under their next attempt), not yet live."""

    slots: dict[str, Slot] = field(default_factory=dict)
    tasks: dict[str, common_pb2.Task] = field(default_factory=dict)


def _key(episode: HostKey) -> EpisodeKey:
    return EpisodeKey(episode.rollout_id, episode.attempt)


class ResourcesParticipant(Participant):
    kind = Kind.RESOURCES

    def __init__(self, servicer: ResourcesServicer, *, verify: str = "wait") -> None:
        super().__init__()
        if verify not in VERIFY_MODES:
            raise ValueError(f"checkpoint_verify must be one of {sorted(VERIFY_MODES)}, got {verify!r}")
        self.servicer = servicer
        self.host = servicer.host
        self.environment = servicer.environment
        self.mode = self.environment.checkpoint_mode
        if self.mode is CheckpointMode.EXPORTED and self.environment.snapshot_format is None:
            raise ValueError(f"{self.environment.name}: mode exported needs a snapshot_format")
        self.verify = verify
        self.tables: TableEnvironment | None = None
        """Set when exported sessions are table sets: checkpoints then share their blocks."""
        if self.mode is CheckpointMode.EXPORTED and isinstance(self.environment, TableEnvironment):
            self.tables = self.environment
        self._tasks: dict[str, common_pb2.Task] = {}
        """Seed tasks by session id (stateless mode re-seeds them on restore)."""
        self._pending: dict[str, EpisodeKey] = {}
        """Restored sessions no call of the new attempt has touched yet."""
        self._verify_raised: dict[str, HostKey] = {}
        """Sessions whose last `Verify` call raised: what `readiness` checks for `verify_failed`, not every session."""
        servicer.checkpoint_verify = VERIFY_MODES[verify]

    # -- data plane --------------------------------------------------------------------------

    def policy(self, method: str) -> tuple[WhenClosed, bool]:
        """(what it does while admission is closed, whether it blocks prepare) per data-plane method."""
        if method == "CheckpointSession":
            return WhenClosed.PASS, False  # read-only, and the state is frozen while prepared
        if self.mode is CheckpointMode.RESTART_ONLY:
            return (WhenClosed.WAIT if method == "SeedSession" else WhenClosed.PASS), False
        if method == "Verify" and self.verify == "replay":
            return WhenClosed.PASS, False
        return WhenClosed.WAIT, True

    def gated(self, method: str, handler: Handler) -> Handler:
        closed, blocks = self.policy(method)
        admission = self.admission

        @functools.wraps(handler)
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            episode = EpisodeKey.of(request.episode_id)
            await admission.enter(episode, closed=closed, blocks=blocks)
            try:
                reply = await handler(request, context)
            except Exception:
                if method == "Verify":
                    self._note_verify_failure(request.session_id, episode)
                raise
            finally:
                if blocks:
                    admission.leave(episode)
            self._observe(method, request)
            return reply

        return call

    def _note_verify_failure(self, session_id: str, episode: EpisodeKey) -> None:
        try:
            slot = self.host.slot(session_id, HostKey(*episode))
        except GymrpcError:
            return  # refused before it ran: the session's own flag did not change
        if slot.verify_failed:
            self._verify_raised[session_id] = slot.episode

    def _observe(self, method: str, request: Any) -> None:
        session_id = request.session_id
        self._pending.pop(session_id, None)
        if method == "SeedSession" and self.mode is CheckpointMode.STATELESS:
            self._tasks[session_id] = request.task
        elif method in ("CloseSession", "DiscardSession"):
            self._tasks.pop(session_id, None)
        if method in ("Verify", "CloseSession", "DiscardSession", "RestoreSession"):
            self._verify_raised.pop(session_id, None)  # verified, gone, or a new session under the id

    # -- readiness ---------------------------------------------------------------------------

    def readiness(self) -> Report:
        """The calls in flight block; no scan of the sessions (except restart_only's restarts, which name them all)."""
        counts = {
            "sessions": len(self.host),
            "restored_pending": len(self._pending),
            "verify_failed": self._verify_failures(),
        }
        if self.mode is CheckpointMode.RESTART_ONLY:
            restarts = {_key(s.episode) for s in self.host.live().values()}
            return Report(restarts=tuple(sorted(restarts)), counts=counts)
        in_flight = self.admission.in_flight()
        counts["in_flight"] = len(in_flight)
        return Report(blockers=tuple(sorted(in_flight)), counts=counts)

    def _verify_failures(self) -> int:
        """Live sessions whose last verify raised; forgets the candidates that no longer are."""
        failed = 0
        for session_id, episode in list(self._verify_raised.items()):
            try:
                slot: Slot | None = self.host.slot(session_id, episode)
            except GymrpcError:  # closed, or the id now holds another attempt's session
                slot = None
            if slot is not None and slot.verify_failed:
                failed += 1
            else:
                del self._verify_raised[session_id]
        return failed

    # -- capture -----------------------------------------------------------------------------

    async def capture(self, scope: Scope) -> Capture:
        if self.mode is CheckpointMode.RESTART_ONLY:
            return Capture.of([])
        if self.mode is CheckpointMode.EXPORTED and self.tables is None:
            slots = self.host.live()
            if all(kind.capture is not Session.capture for kind in self.host.session_types):
                return self._capture_on_write(slots, scope)
        chosen = [
            (session_id, slot)
            for session_id, slot in self.host.live().items()
            if (scope is None or (slot.episode.rollout_id, slot.episode.attempt) in scope) and not slot.verify_failed
        ]
        if self.tables is not None:
            return await self._capture_tables(chosen)
        items = []
        exported = self.mode is CheckpointMode.EXPORTED
        cheap: dict[type, bool] = {}  # by session class: overrides `Session.capture`
        for session_id, slot in chosen:  # every session of the scope, while parked: keep this loop lean
            state: Callable[[], bytes] | common_pb2.Task | None = None
            session = slot.session
            if exported:
                kind = type(session)
                if (own := cheap.get(kind)) is None:
                    own = cheap[kind] = kind.capture is not Session.capture
                state = self._captured(session_id, session) if own else await self._exported(session_id, session)
            elif session_id in self._tasks:
                state = self._tasks[session_id]  # the seed request's task: never changed
            items.append((session_id, slot.episode, tuple(slot.results.items()), state))
        fmt = self.host.require_snapshots() if exported else None
        return Capture(functools.partial(_session_records, fmt, items), len(items))

    def _capture_on_write(self, slots: dict[str, Slot], scope: Scope) -> Capture:
        """Sessions with their own cheap `Session.capture`: the table of live sessions, copy-on-write.

        Each session's state is taken before its first change after this (`frozen.FrozenSessions`),
        or by `settle` after the resume; the scope and the sessions whose verify raised are left
        out when the records are built. Nothing per session happens while the episodes are parked.
        """
        fmt = self.host.require_snapshots()
        frozen = self.host.frozen.freeze(slots, self._take)
        build = functools.partial(_frozen_records, fmt, frozen, scope)
        return Capture(build, len(slots), settle=functools.partial(self.host.frozen.settle, frozen))

    def _take(self, session_id: str, slot: Slot) -> tuple[HostKey, Results, bool, Callable[[], bytes]]:
        """One session's state as it stands (at the capture: nothing changed it since)."""
        return slot.episode, tuple(slot.results.items()), slot.verify_failed, self._captured(session_id, slot.session)

    @staticmethod
    def _captured(session_id: str, session: Session) -> Callable[[], bytes]:
        try:
            return session.capture()
        except SnapshotUnsupported as exc:
            raise FailedPrecondition(f"session {session_id!r}: {exc}", reason="SNAPSHOT_UNSUPPORTED") from None

    async def _exported(self, session_id: str, session: Session) -> Callable[[], bytes]:
        """A session without its own `capture`: its `export` now, in the host's pool (unless `runs_inline`)."""
        try:
            payload = await self.host.run(session.export)
        except SnapshotUnsupported as exc:
            raise FailedPrecondition(f"session {session_id!r}: {exc}", reason="SNAPSHOT_UNSUPPORTED") from None
        return lambda: payload

    async def _capture_tables(self, chosen: Sequence[tuple[str, Slot]]) -> Capture:
        """Each session's tables (encoded in a thread, only the changed ones); the write keeps each block once."""
        fmt = self.host.require_snapshots()
        items = []
        for session_id, slot in chosen:
            if not isinstance(slot.session, TableSession):
                raise FailedPrecondition(
                    f"session {session_id!r} of table environment {self.environment.name!r} cannot export tables",
                    reason="SNAPSHOT_UNSUPPORTED",
                )
            items.append(_TableItem(session_id, _key(slot.episode), slot.session, tuple(slot.results.items())))
        exports = await asyncio.to_thread(_export_tables, items)
        return Capture(functools.partial(_table_records, fmt, items, exports), len(items))

    async def delete_restored(self, scope: Scope) -> None:
        if scope is None:
            return
        for session_id, episode in list(self._pending.items()):
            if episode not in scope:
                await self._free(session_id, episode)

    # -- restore -----------------------------------------------------------------------------

    def not_fresh(self) -> str | None:
        if self.host.served:
            return f"it has served sessions since it started ({len(self.host.live())} live now)"
        return super().not_fresh()

    def select(
        self, records: Sequence[rec_pb.CheckpointRecord], scope: frozenset[EpisodeKey]
    ) -> list[rec_pb.CheckpointRecord]:
        """Table blocks are shared by sessions of any episode: a restore of some episodes keeps them all."""
        return [r for r in records if r.HasField("table_block") or EpisodeKey.of(r.episode_id) in scope]

    def placement_key(self, record: rec_pb.CheckpointRecord) -> str | None:
        """Restore onto replicas: a session goes where its calls go (by session id); a record that is
        not a session (a shared table block) goes to every replica."""
        if record.WhichOneof("body") == "resources_session":
            return record.resources_session.session_id
        return None

    async def stage(self, records: Sequence[rec_pb.CheckpointRecord], scope: frozenset[EpisodeKey]) -> _Staged:
        staged = _Staged()
        if self.mode is CheckpointMode.RESTART_ONLY:
            if records:
                raise DataLoss(f"{len(records)} records for a restart_only environment; nothing was installed")
            return staged
        blocks: dict[str, bytes] = {}
        bodies: dict[str, tuple[rec_pb.CheckpointRecord, rec_pb.ResourcesSessionRecord]] = {}
        for record in records:
            if record.HasField("table_block") and self.tables is not None:
                blocks.setdefault(record.table_block.sha256, record.table_block.data)  # checked when fetched
                continue
            if record.WhichOneof("body") != "resources_session":
                raise DataLoss(f"a record of {record.episode_id.rollout_id!r} is not a resources session")
            body = record.resources_session
            try:
                session_id = check_id(body.session_id, "session_id")
            except GymrpcError:
                raise DataLoss(f"a record holds an invalid session id {body.session_id[:100]!r}") from None
            if session_id in bodies:
                raise DataLoss(f"session {session_id!r} appears twice in the checkpoint")
            bodies[session_id] = (record, body)
        if self.tables is not None:
            sessions = await self._decode_tables(self.tables, {sid: body for sid, (_, body) in bodies.items()}, blocks)
        else:
            sessions = {sid: await self._decode(sid, body) for sid, (_, body) in bodies.items()}
        reply = pb.SeedSessionResponse(tools=[tool_definition(t) for t in self.environment.tools()])
        for session_id, (record, body) in bodies.items():
            nxt = EpisodeKey.of(record.episode_id).next()
            slot = Slot(sessions[session_id], HostKey(*nxt), f"restored:{record.episode_id.rollout_id}", reply)
            for cached in body.replies:
                slot.results[cached.key] = _reply(cached)
            staged.slots[session_id] = slot
            if self.mode is CheckpointMode.STATELESS:
                staged.tasks[session_id] = body.task
        return staged

    async def _decode(self, session_id: str, body: rec_pb.ResourcesSessionRecord) -> Any:
        if self.mode is CheckpointMode.STATELESS:
            try:
                session, _ = await self.host.run(self.environment.seed, task_spec(body.task))
            except Exception as exc:
                raise DataLoss(f"session {session_id!r}: its seed task no longer seeds: {exc}") from None
            return session
        snap, fmt = body.snapshot, self.host.require_snapshots()
        _check_format(session_id, fmt, snap.format_name, snap.format_version, snap.protocol_version)
        if hashlib.sha256(snap.payload).hexdigest() != snap.sha256:
            raise DataLoss(f"session {session_id!r}: snapshot fails its sha256 check; nothing was installed")
        try:
            return await self.host.run(self.environment.restore, snap.payload)
        except SnapshotCorrupt as exc:
            raise DataLoss(f"session {session_id!r}: snapshot does not decode: {exc}; nothing was installed") from None

    async def _decode_tables(
        self,
        tables: TableEnvironment,
        bodies: Mapping[str, rec_pb.ResourcesSessionRecord],
        blocks: Mapping[str, bytes],
    ) -> dict[str, Any]:
        """Every session from its manifest and the shared blocks, in a thread; DATA_LOSS naming each problem.

        Records holding a self-contained `snapshot` instead (written before table blocks) still restore.
        """
        fmt = self.host.require_snapshots()
        manifests: dict[str, bytes] = {}
        sessions: dict[str, Any] = {}
        for session_id, body in bodies.items():
            if not body.HasField("tables"):
                sessions[session_id] = await self._decode(session_id, body)
                continue
            snap = body.tables
            _check_format(session_id, fmt, snap.format_name, snap.format_version)
            manifests[session_id] = snap.manifest
        if manifests:
            sessions.update(await asyncio.to_thread(_build_tables, tables, manifests, blocks))
        return sessions

    async def install(self, staged: _Staged) -> list[EpisodeKey]:
        self.host.install(staged.slots)
        self._tasks.update(staged.tasks)
        restored = {sid: _key(slot.episode) for sid, slot in staged.slots.items()}
        self._pending.update(restored)
        return sorted(set(restored.values()))

    # -- retire ------------------------------------------------------------------------------

    async def retire(self, episodes: Sequence[EpisodeKey]) -> None:
        marked = [e for e in self.admission.in_flight() if self.marks.is_retired(e)]
        await self.admission.drained(marked)
        for session_id, slot in self.host.live().items():
            episode = _key(slot.episode)
            if self.marks.is_retired(episode):
                await self._free(session_id, episode)

    async def _free(self, session_id: str, episode: EpisodeKey) -> None:
        self._pending.pop(session_id, None)
        self._tasks.pop(session_id, None)
        self._verify_raised.pop(session_id, None)
        await self.host.close(session_id, HostKey(*episode))

    def details(self) -> dict[str, str]:
        return {"mode": self.mode.value, "verify": self.verify, "environment": self.environment.name}


Results = tuple[tuple[str, Reply], ...]
"""A session's cached replies at a capture (`Slot.results`' items; the results are immutable)."""


def _session_records(
    fmt: SnapshotFormat | None,
    items: Sequence[tuple[str, HostKey, Results, Callable[[], bytes] | common_pb2.Task | None]],
) -> Iterator[rec_pb.CheckpointRecord]:
    """A capture's records (worker thread), by session id: replies, then the snapshot (or the seed task)."""
    for session_id, episode, results, state in sorted(items, key=lambda item: item[0]):
        body = rec_pb.ResourcesSessionRecord(session_id=session_id, replies=_replies(results))
        if isinstance(state, common_pb2.Task):
            body.task.CopyFrom(state)
        elif state is not None and fmt is not None:
            try:
                payload = state()
            except SnapshotUnsupported as exc:
                raise FailedPrecondition(f"session {session_id!r}: {exc}", reason="SNAPSHOT_UNSUPPORTED") from None
            body.snapshot.CopyFrom(session_snapshot(fmt, payload))
        yield rec_pb.CheckpointRecord(episode_id=_key(episode).to_pb(), resources_session=body)


def _frozen_records(fmt: SnapshotFormat, frozen: Frozen, scope: Scope) -> Iterator[rec_pb.CheckpointRecord]:
    """A copy-on-write capture's records (worker thread, once settled): the sessions of `scope`."""
    if not frozen.settled:
        raise RuntimeError("a copy-on-write capture was built before it settled")
    items = []
    for session_id, taken in frozen.taken.items():
        if isinstance(taken, Exception):
            raise taken
        episode, results, verify_failed, state = taken
        if not verify_failed and (scope is None or (episode.rollout_id, episode.attempt) in scope):
            items.append((session_id, episode, results, state))
    yield from _session_records(fmt, items)


@dataclass(frozen=True)
class _TableItem:
    """What a table capture keeps of one session, taken on the event loop."""

    session_id: str
    episode: EpisodeKey
    session: TableSession
    results: Results


def _export_tables(items: Sequence[_TableItem]) -> dict[str, Any]:
    """Worker thread, while parked: every session's tables (`SessionTables`, unchanged once returned)."""
    exports = {}
    for item in items:
        try:
            exports[item.session_id] = item.session.export_tables()
        except SnapshotUnsupported as exc:
            raise FailedPrecondition(f"session {item.session_id!r}: {exc}", reason="SNAPSHOT_UNSUPPORTED") from None
    return exports


def _table_records(
    fmt: SnapshotFormat, items: Sequence[_TableItem], exports: Mapping[str, Any]
) -> Iterator[rec_pb.CheckpointRecord]:
    """Worker thread, in the write: a manifest record per session, then each distinct block once (`collect`)."""
    from gymrpc.snapshots import collect

    items = sorted(items, key=lambda item: item.session_id)
    bundle = collect({item.session_id: exports[item.session_id] for item in items})
    first: dict[str, EpisodeKey] = {}
    for item in items:
        manifest = bundle.manifests[item.session_id]
        snapshot = rec_pb.TableSnapshot(format_name=fmt.name, format_version=fmt.version, manifest=manifest.to_json())
        replies = _replies(item.results)
        body = rec_pb.ResourcesSessionRecord(session_id=item.session_id, replies=replies, tables=snapshot)
        yield rec_pb.CheckpointRecord(episode_id=item.episode.to_pb(), resources_session=body)
        for digest in manifest.digests():
            first.setdefault(digest, item.episode)
    for digest, data in bundle.blocks.items():  # filed under the first episode naming it (see select)
        block = rec_pb.TableBlock(sha256=digest, data=data)
        yield rec_pb.CheckpointRecord(episode_id=first[digest].to_pb(), table_block=block)


def _build_tables(
    environment: TableEnvironment, manifests: Mapping[str, bytes], blocks: Mapping[str, bytes]
) -> dict[str, TableSession]:
    """Worker thread: check every block's hash, decode each once, build every session, or DATA_LOSS naming each."""
    from gymrpc.snapshots import CheckpointInvalid, parse_records, restore_sessions

    try:
        return restore_sessions(
            parse_records(manifests),
            blocks.__getitem__,
            lambda _sid, exported, tables: environment.build_session(exported, tables),
            environment.known_frames(),
        )
    except CheckpointInvalid as exc:
        raise DataLoss(
            f"{exc}; nothing was installed", metadata={"sessions": ",".join(sorted(exc.problems)[:10])}
        ) from None


def _check_format(session_id: str, fmt: SnapshotFormat, name: str, version: int, protocol: int | None = None) -> None:
    """FAILED_PRECONDITION when a record was written in a snapshot format this server does not read."""
    if (name, version) == (fmt.name, fmt.version) and protocol in (None, SNAPSHOT_PROTOCOL_VERSION):
        return
    raise FailedPrecondition(
        f"session {session_id!r}: snapshot format {name} v{version} cannot be read by this server "
        f"({fmt.name} v{fmt.version}); nothing was installed",
        reason="SNAPSHOT_FORMAT_MISMATCH",
    )


def _replies(results: Results) -> list[rec_pb.CachedToolReply]:
    out = []
    for key, reply in results:
        result, digest = reply.result, reply.digest
        if isinstance(result, ToolResult):
            out.append(
                rec_pb.CachedToolReply(key=key, output=result.output, is_error=result.is_error, request_digest=digest)
            )
        elif isinstance(result, StepResult):
            out.append(
                rec_pb.CachedToolReply(
                    key=key,
                    observations=list(result.observations),
                    terminated=result.terminated,
                    truncated=result.truncated,
                    text_turn=True,
                    request_digest=digest,
                )
            )
    return out


def _reply(cached: rec_pb.CachedToolReply) -> Reply:
    if cached.text_turn:
        return Reply(StepResult(tuple(cached.observations), cached.terminated, cached.truncated), cached.request_digest)
    return Reply(ToolResult(cached.output, cached.is_error), cached.request_digest)


GATED = (
    "SeedSession",
    "CallTool",
    "Step",
    "Verify",
    "CloseSession",
    "CheckpointSession",
    "RestoreSession",
    "DiscardSession",
)


def gate_servicer(servicer: ResourcesServicer, participant: ResourcesParticipant) -> None:
    """Put the participant's admission gate in front of every data-plane method of `servicer`."""
    for method in GATED:
        setattr(servicer, method, participant.gated(method, getattr(servicer, method)))
