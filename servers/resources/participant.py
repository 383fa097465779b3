"""The resources participant: many sessions exported, restored and retired at once (SPEC §7).

Modes, declared by the environment (`Environment.checkpoint_mode`):
- `exported`: sessions are snapshotted with `Session.export` and restored with
  `Environment.restore`;
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
is in flight.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from gymrpc.control import EpisodeKey, Kind, Participant, Report, Scope
from gymrpc.control.admission import WhenClosed
from gymrpc.envkit import CheckpointMode, SnapshotCorrupt, SnapshotUnsupported, StepResult, ToolResult
from gymrpc.errors import DataLoss, FailedPrecondition, GymrpcError
from gymrpc.ids import check_id
from gymrpc.messages import task_spec, tool_definition
from gymrpc.v1 import checkpoint_records_pb2 as rec_pb
from gymrpc.v1 import common_pb2
from gymrpc.v1 import resources_service_pb2 as pb
from servers.resources.service import SNAPSHOT_PROTOCOL_VERSION, ResourcesServicer
from servers.resources.sessions import EpisodeKey as HostKey
from servers.resources.sessions import Slot

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
        self._tasks: dict[str, common_pb2.Task] = {}
        """Seed tasks by session id (stateless mode re-seeds them on restore)."""
        self._pending: dict[str, EpisodeKey] = {}
        """Restored sessions no call of the new attempt has touched yet."""
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
            finally:
                if blocks:
                    admission.leave(episode)
            self._observe(method, request)
            return reply

        return call

    def _observe(self, method: str, request: Any) -> None:
        session_id = request.session_id
        self._pending.pop(session_id, None)
        if method == "SeedSession" and self.mode is CheckpointMode.STATELESS:
            self._tasks[session_id] = request.task
        elif method in ("CloseSession", "DiscardSession"):
            self._tasks.pop(session_id, None)

    # -- readiness ---------------------------------------------------------------------------

    def readiness(self) -> Report:
        counts = {"sessions": len(self.host), "restored_pending": len(self._pending)}
        if self.mode is CheckpointMode.RESTART_ONLY:
            restarts = {_key(s.episode) for s in self.host.live().values()}
            return Report(restarts=tuple(sorted(restarts)), counts=counts)
        in_flight = self.admission.in_flight()
        counts["in_flight"] = len(in_flight)
        return Report(blockers=tuple(sorted(in_flight)), counts=counts)

    # -- export ------------------------------------------------------------------------------

    async def export(self, scope: Scope) -> list[rec_pb.CheckpointRecord]:
        if self.mode is CheckpointMode.RESTART_ONLY:
            return []
        records = []
        for session_id, slot in sorted(self.host.live().items()):
            episode = _key(slot.episode)
            if scope is not None and episode not in scope:
                continue
            body = rec_pb.ResourcesSessionRecord(session_id=session_id, replies=_replies(slot))
            if self.mode is CheckpointMode.EXPORTED:
                body.snapshot.CopyFrom(await self._snapshot(session_id, slot))
            elif session_id in self._tasks:
                body.task.CopyFrom(self._tasks[session_id])
            records.append(rec_pb.CheckpointRecord(episode_id=episode.to_pb(), resources_session=body))
        return records

    async def _snapshot(self, session_id: str, slot: Slot) -> common_pb2.SessionSnapshot:
        fmt = self.environment.snapshot_format
        assert fmt is not None
        try:
            payload = await self.host.run(slot.session.export)
        except SnapshotUnsupported as exc:
            raise FailedPrecondition(f"session {session_id!r}: {exc}", reason="SNAPSHOT_UNSUPPORTED") from None
        return common_pb2.SessionSnapshot(
            protocol_version=SNAPSHOT_PROTOCOL_VERSION,
            format_name=fmt.name,
            format_version=fmt.version,
            content_type=fmt.content_type,
            payload=payload,
            sha256=hashlib.sha256(payload).hexdigest(),
        )

    async def delete_restored(self, scope: Scope) -> None:
        if scope is None:
            return
        for session_id, episode in list(self._pending.items()):
            if episode not in scope:
                await self._free(session_id, episode)

    # -- restore -----------------------------------------------------------------------------

    def not_fresh(self) -> str | None:
        if self.host.served:
            return f"it holds or held {len(self.host.live())} sessions"
        return super().not_fresh()

    async def stage(self, records: Sequence[rec_pb.CheckpointRecord], scope: frozenset[EpisodeKey]) -> _Staged:
        staged = _Staged()
        if self.mode is CheckpointMode.RESTART_ONLY:
            if records:
                raise DataLoss(f"{len(records)} records for a restart_only environment; nothing was installed")
            return staged
        slots, tasks = staged.slots, staged.tasks
        reply = pb.SeedSessionResponse(tools=[tool_definition(t) for t in self.environment.tools()])
        for record in records:
            if record.WhichOneof("body") != "resources_session":
                raise DataLoss(f"a record of {record.episode_id.rollout_id!r} is not a resources session")
            body = record.resources_session
            try:
                session_id = check_id(body.session_id, "session_id")
            except GymrpcError:
                raise DataLoss(f"a record holds an invalid session id {body.session_id[:100]!r}") from None
            if session_id in slots:
                raise DataLoss(f"session {session_id!r} appears twice in the checkpoint")
            nxt = EpisodeKey.of(record.episode_id).next()
            session = await self._decode(session_id, body)
            slot = Slot(session, HostKey(*nxt), f"restored:{record.episode_id.rollout_id}", reply)
            for cached in body.replies:
                slot.results[cached.key] = _result(cached)
            slots[session_id] = slot
            if self.mode is CheckpointMode.STATELESS:
                tasks[session_id] = body.task
        return staged

    async def _decode(self, session_id: str, body: rec_pb.ResourcesSessionRecord) -> Any:
        if self.mode is CheckpointMode.STATELESS:
            try:
                session, _ = await self.host.run(self.environment.seed, task_spec(body.task))
            except Exception as exc:
                raise DataLoss(f"session {session_id!r}: its seed task no longer seeds: {exc}") from None
            return session
        snap, fmt = body.snapshot, self.environment.snapshot_format
        assert fmt is not None
        if (snap.protocol_version, snap.format_name, snap.format_version) != (
            SNAPSHOT_PROTOCOL_VERSION,
            fmt.name,
            fmt.version,
        ):
            raise FailedPrecondition(
                f"session {session_id!r}: snapshot format {snap.format_name} v{snap.format_version} cannot be read "
                f"by this server ({fmt.name} v{fmt.version}); nothing was installed",
                reason="SNAPSHOT_FORMAT_MISMATCH",
            )
        if hashlib.sha256(snap.payload).hexdigest() != snap.sha256:
            raise DataLoss(f"session {session_id!r}: snapshot fails its sha256 check; nothing was installed")
        try:
            return await self.host.run(self.environment.restore, snap.payload)
        except SnapshotCorrupt as exc:
            raise DataLoss(f"session {session_id!r}: snapshot does not decode: {exc}; nothing was installed") from None

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
        await self.host.close(session_id, HostKey(*episode))

    def details(self) -> dict[str, str]:
        return {"mode": self.mode.value, "verify": self.verify, "environment": self.environment.name}


def _replies(slot: Slot) -> list[rec_pb.CachedToolReply]:
    out = []
    for key, result in slot.results.items():
        if isinstance(result, ToolResult):
            out.append(rec_pb.CachedToolReply(key=key, output=result.output, is_error=result.is_error))
        elif isinstance(result, StepResult):
            out.append(
                rec_pb.CachedToolReply(
                    key=key,
                    observations=list(result.observations),
                    terminated=result.terminated,
                    truncated=result.truncated,
                    text_turn=True,
                )
            )
    return out


def _result(cached: rec_pb.CachedToolReply) -> ToolResult | StepResult:
    if cached.text_turn:
        return StepResult(tuple(cached.observations), cached.terminated, cached.truncated)
    return ToolResult(cached.output, cached.is_error)


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
