"""Per-episode durable resume (docs/design.md §6): save at every boundary, continue a retried `Run` from the last one.

One `Run` of an episode holds its store lease from start to end, so two runs never
interleave. It loads the record and decides, in this order:
- another task under the same id → ALREADY_EXISTS `FINGERPRINT_MISMATCH`, nothing changes;
- an older attempt than stored → FAILED_PRECONDITION `STALE_ATTEMPT`, nothing changes;
- another `policy_version` (or a newer attempt) → archive a copy of the record, replace it
  by a fresh one (`restart_count + 1`) and start over;
- completed → the cached trajectory, no server is called;
- in progress → restore the resources session from the record's snapshot (also into a
  resources server that restarted and lost it), `resume_count + 1`, continue the phase.

After every transition the record is saved: after seeding and after each tool call or text
turn with a fresh snapshot of the session, after each model call with the previous one (a
model call does not touch the session). The episode's next call runs while that save goes to
the disk (`EpisodeStore.begin_save`); the next boundary is written only once it is durable,
and the completed record before `Run` returns. A crash in between loses that one boundary at
most: the run continues from the one before, whose snapshot undoes the call that ran
meanwhile. The snapshot comes in the reply of the call itself (`return_snapshot`) from a
resources server that advertises it (`snapshot_in_replies`), and from a separate
`CheckpointSession` call otherwise. A boundary that was saved is never run again; one that
was not is run again from restored state, so its effects are not applied twice either. If
the resources server loses the session mid-run (it restarted), the run goes back to the last
saved boundary and goes on from there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from google.protobuf.message import Message

from gymrpc import tracing
from gymrpc.errors import (
    AlreadyExists,
    FailedPrecondition,
    GymrpcError,
    Unimplemented,
    session_lost,
)
from gymrpc.servers.agent import checkpoint
from gymrpc.servers.agent.faults import CrashPlan
from gymrpc.servers.agent.loop import EpisodeLoop
from gymrpc.servers.agent.state import EpisodeState, Phase
from gymrpc.store import SAVED, EpisodeCheckpoint, EpisodeLease, EpisodeStore, PendingSave
from gymrpc.store.encoded import decoded, encoded
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2
from gymrpc.v1 import resources_service_pb2 as resources_pb

log = logging.getLogger(__name__)
SESSION_RECOVERIES = 3
"""Times one transition may go back to the last boundary because the resources server lost the session."""


@dataclass(frozen=True)
class ResumeConfig:
    """Options of durable resume; the store itself is passed separately."""

    completed_ttl: float = 7 * 24 * 3600.0
    """Seconds a completed episode's cached result is kept."""
    require_policy_version: bool = True
    """`Run` must name the weights (`policy_version`); a checkpoint of other weights is archived."""

    def __post_init__(self) -> None:
        if self.completed_ttl <= 0:
            raise ValueError(f"completed_ttl must be positive, got {self.completed_ttl}")


class DurableEpisodes:
    """Runs episodes through `loop`, checkpointing each boundary in `store`."""

    def __init__(
        self,
        loop: EpisodeLoop,
        store: EpisodeStore,
        config: ResumeConfig,
        *,
        crash: CrashPlan | None = None,
    ) -> None:
        self.loop, self.store, self.config, self.crash = loop, store, config, crash
        self._capable = False

    async def check_resources(self) -> None:
        """Refuse up front, with a clear error, a resources server that cannot snapshot sessions."""
        if self._capable:
            return
        name = self.loop.resources_name
        try:
            request = resources_pb.GetSessionCheckpointingRequest()
            probe = await self.loop.call_resources("GetSessionCheckpointing", request)
            supported = probe.supported
            self.loop.snapshots_in_replies = supported and probe.snapshot_in_replies
        except Unimplemented:
            supported = False
        if not supported:
            raise FailedPrecondition(
                f"durable resume is on, but resources server {name!r} cannot snapshot sessions "
                "(GetSessionCheckpointing says unsupported), so an episode could not be resumed there; "
                "use an environment with session snapshots or start the agent without --resume-dir",
                reason="SNAPSHOT_UNSUPPORTED",
                metadata={"resources": name},
            )
        self._capable = True

    async def run(
        self, state: EpisodeState, *, progress: bool = True
    ) -> AsyncGenerator[agent_pb.EpisodeProgress | agent_pb.Trajectory, None]:
        """Progress events at each boundary reached (if `progress`), then the trajectory (cached if completed).

        The trajectory is the record's own `final_result`, not a copy: the caller's reply copies it once.
        """
        await self.check_resources()
        fingerprint = checkpoint.fingerprint(state.task)
        async with self.store.lease(state.rollout_id) as lease:
            record = await self._open(lease, state, fingerprint)
            if record.phase == agent_pb.EPISODE_PHASE_COMPLETED:
                yield record.final_result
                return
            async for event in self._drive(lease, record, state, progress):
                yield event
        yield record.final_result

    # -- opening -------------------------------------------------------------------------------

    async def _open(self, lease: EpisodeLease, state: EpisodeState, fingerprint: str) -> Message:
        """The record this run continues: a fresh one, the completed one, or a resumed one (all but the
        completed one as an `EncodedCheckpoint`: the record the boundaries update)."""
        record = await self.store.load(lease)
        if record is None:
            return checkpoint.new_record(state, fingerprint)
        stored = record.episode_id.attempt
        if record.request_fingerprint != fingerprint:
            raise AlreadyExists(
                f"episode {state.rollout_id!r} was already used for another task (fingerprint "
                f"{record.request_fingerprint[:24]}…, this request {fingerprint[:24]}…); use a new episode id",
                reason="FINGERPRINT_MISMATCH",
                metadata={"rollout_id": state.rollout_id},
            )
        if state.attempt < stored:
            raise FailedPrecondition(
                f"attempt {state.attempt} of episode {state.rollout_id!r} is stale: the checkpoint belongs to "
                f"attempt {stored}",
                reason="STALE_ATTEMPT",
                metadata={"rollout_id": state.rollout_id, "attempt": str(state.attempt)},
            )
        reason = None
        if record.policy_version != state.policy_version:
            reason = "policy_mismatch"
        elif state.attempt > stored:
            reason = "superseded_attempt"
        if reason is not None:
            where = await self.store.archive(lease, reason)
            log.info("episode starts over", extra={"episode": state.label, "reason": reason, "archive": where})
            # The old run's session may still be live under the same id, with state a fresh seed would reuse.
            await self.loop.call_resources(
                "DiscardSession",
                resources_pb.DiscardSessionRequest(session_id=record.session_id, episode_id=record.episode_id),
            )
            fresh = checkpoint.new_record(state, fingerprint, restart_count=record.restart_count + 1)
            fresh.revision = record.revision  # replaces the old record: counted even if this run dies now
            await self.store.save(lease, fresh)
            return fresh
        if record.phase == agent_pb.EPISODE_PHASE_COMPLETED:
            checkpoint.check_completed(record)
            return record
        if record.phase == agent_pb.EPISODE_PHASE_UNSPECIFIED:  # restarted, never seeded: nothing to resume
            state.restart_count = record.restart_count
            record.max_steps, record.text_turns = state.max_steps, state.text_turns
            return encoded(record)
        checkpoint.restore_state(state, record)
        tracing.link_previous(record.traceparent)
        self.loop.count_failovers(state)  # baseline before RestoreSession: a move of it counts
        await self._restore_session(state, record)
        record = encoded(record)
        state.resume_count += 1
        record.resume_count, record.traceparent = state.resume_count, state.traceparent
        await self.store.save(lease, record)
        log.info(
            "episode resumed",
            extra={"episode": state.label, "phase": state.phase.name, "step": state.step, "resume": state.resume_count},
        )
        return record

    async def _restore_session(self, state: EpisodeState, record: EpisodeCheckpoint) -> None:
        request = resources_pb.RestoreSessionRequest(
            session_id=state.session_id, episode_id=state.episode_id, snapshot=record.resource_snapshot
        )
        await self.loop.call_resources("RestoreSession", request)

    # -- running -------------------------------------------------------------------------------

    async def _drive(
        self, lease: EpisodeLease, record: Message, state: EpisodeState, progress: bool
    ) -> AsyncGenerator[agent_pb.EpisodeProgress, None]:
        started, base = time.monotonic(), state.elapsed_s
        writer, saving = checkpoint.RecordWriter(record), SAVED
        try:
            while state.phase is not Phase.COMPLETED:
                message, saving = await self._transition(lease, writer, state, started, base, saving)
                if progress:
                    yield state.progress(message)
        except BaseException:
            saving.abandon()  # still written; the lease lets the episode go once it is
            if state.phase not in (Phase.NEW, Phase.COMPLETED):
                self.loop.close_in_background(state)  # a retry restores the session from the record anyway
            raise

    async def _transition(
        self,
        lease: EpisodeLease,
        writer: checkpoint.RecordWriter,
        state: EpisodeState,
        started: float,
        base: float,
        saving: PendingSave,
    ) -> tuple[common_pb2.Message | None, PendingSave]:
        """One transition, while the previous boundary's save (`saving`) goes to the disk, and its own save begun.

        Goes back to the last save when the resources session was lost.
        """
        record = writer.record
        for recovery in range(SESSION_RECOVERIES + 1):
            phase = state.phase
            try:
                state.session_snapshot = None
                message = await self.loop.advance(state)
                if self.crash is not None and phase is Phase.READY_FOR_TOOL and not state.text_turns:
                    self.crash.at("unsaved_tool", len(state.tool_calls) - 1)
                state.elapsed_s = base + time.monotonic() - started
                if state.phase is Phase.COMPLETED:
                    checkpoint.record_completion(record, state, self.config.completed_ttl)
                else:
                    snapshot = await self._snapshot(state) if phase in (Phase.NEW, Phase.READY_FOR_TOOL) else None
                    writer.boundary(state, snapshot)
                await saving  # the previous boundary is durable before this one is written
                if state.phase is Phase.COMPLETED:
                    await self.store.save(lease, record)  # durable before `Run` returns the result
                else:
                    saving = await self.store.begin_save(lease, record)
            except GymrpcError as err:
                if recovery < SESSION_RECOVERIES and phase is Phase.NEW and _seeded_before(err):
                    # A session of this id outlived the record that would have resumed it (the record
                    # was deleted, say by `gymrpc episodes delete`): no saved boundary is its state, so
                    # it goes, and the episode is seeded afresh.
                    log.warning("a session left by an earlier run is discarded", extra={"episode": state.label})
                    await self.loop.discard_session(state)
                    continue
                if recovery == SESSION_RECOVERIES or not session_lost(err, state.session_id):
                    raise
                log.warning(
                    "the resources session was lost; continuing from the last checkpoint",
                    extra={"episode": state.label, "phase": Phase(record.phase).name, "error": err.message},
                )
                await saving  # awaiting a save again is free: it tells its outcome once more
                await self._back_to_last_save(record, state)
                state.session_recoveries += 1
                continue
            if self.crash is not None:
                await saving  # a crash point stands after a durable boundary
                self._crash_point(phase, state)
            return message, saving
        raise AssertionError("unreachable")

    async def _snapshot(self, state: EpisodeState) -> common_pb2.SessionSnapshot:
        """The session's state after the transition: the one its reply carried, else a `CheckpointSession`
        (a resources server that does not return snapshots in replies, or a call that never reached it)."""
        if state.session_snapshot is not None:
            return state.session_snapshot
        request = resources_pb.CheckpointSessionRequest(session_id=state.session_id, episode_id=state.episode_id)
        reply = await self.loop.call_resources("CheckpointSession", request)
        return reply.snapshot

    async def _back_to_last_save(self, record: Message, state: EpisodeState) -> None:
        if record.phase == agent_pb.EPISODE_PHASE_UNSPECIFIED:  # lost before the first save: seed again
            state.phase, state.messages, state.tools = Phase.NEW, [], []  # all that seeding sets
            return
        saved = decoded(record)
        moved = state.failovers  # the moves since that save happened all the same (the one that lost the session)
        checkpoint.restore_state(state, saved)
        state.failovers = moved
        await self._restore_session(state, saved)

    def _crash_point(self, phase: Phase, state: EpisodeState) -> None:
        assert self.crash is not None
        if phase is Phase.NEW:
            self.crash.at("after_seed")
        elif phase is Phase.READY_FOR_MODEL:
            self.crash.at("after_model", state.step - 1)
        elif phase is Phase.READY_FOR_TOOL:
            kind = "after_turn" if state.text_turns else "after_tool"
            self.crash.at(kind, state.step - 1 if state.text_turns else len(state.tool_calls) - 1)


def _seeded_before(err: GymrpcError) -> bool:
    """The seed found the session seeded and changed since: it has no state right after a seed to give."""
    return isinstance(err, FailedPrecondition) and err.metadata.get("call") == "seed"


__all__ = ["DurableEpisodes", "ResumeConfig"]
