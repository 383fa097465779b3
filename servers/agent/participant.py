"""The agent participant (kind AGENT): episodes park at boundaries, export their loop state, continue as N+1.

What each hook means here (the contract is `gymrpc.control.participant`):
- admission: a new `Run` waits for resume; a running episode checks admission at every
  boundary of `EpisodeLoop.steps` and parks there. Time parked is added to
  `EpisodeState.parked_s` and the episode's deadline is paused meanwhile.
- readiness: an episode between boundaries blocks, except one waiting on `Generate`
  (the model, prepared before us, holds or cuts the reply, so the state is still the
  boundary before the call) and one in a `replay` verify (the restored agent verifies again).
- capture: a copy of each parked episode's `EpisodeState` (`frozen`: its lists copied, the
  messages in them shared, since the loop never changes one once appended) and the restored
  records in scope. The write makes each an `EpisodeCheckpoint` packed in
  `CheckpointRecord.other`. The record's inner `episode_id` carries the rollout id only:
  the attempt is the outer record's, so a restored-but-unclaimed episode exports the very
  bytes it was restored from (a second checkpoint equals the first).
- stage/install: records are validated (DATA_LOSS on damage) and kept by attempt N+1;
  a re-dispatched `Run` of that attempt with the same task claims its record and continues
  from the boundary. A `Run` of N+1 without a record starts over (a restart). Staging also
  has the agent's client resolve its resources and model names again (`refresh`): a restore
  may have put their sessions on replicas that registered after this agent last looked.
- retire: the tasks of fenced episodes are cancelled (their `Run` ends with
  STALE_ATTEMPT), waited for, and unclaimed restored records of fenced attempts dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass

from google.protobuf.message import Message

from gymrpc import tracing
from gymrpc.control import Capture, EpisodeKey, Kind, Participant, Report, Scope
from gymrpc.errors import AlreadyExists, DataLoss, GymrpcError
from gymrpc.pbtime import duration
from gymrpc.servers.agent.checkpoint import check_running, new_record, record_boundary, restore_state
from gymrpc.servers.agent.state import EpisodeState, Phase, caller_retries
from gymrpc.store import EpisodeCheckpoint
from gymrpc.store.encoded import pack
from gymrpc.v1 import checkpoint_records_pb2 as rec_pb
from gymrpc.v1 import common_pb2

log = logging.getLogger(__name__)


@dataclass
class _Live:
    """An episode this process is running."""

    state: EpisodeState
    fingerprint: str
    task: asyncio.Task[object] | None
    parked_since: float | None = None
    """Loop time it parked at, while parked (an export counts the time parked so far)."""
    deadline: asyncio.Timeout | None = None
    held: tuple[float, float | None] | None = None
    """(loop time, deadline) when admission closed while it waited on Generate: held time is free too."""


class AgentParticipant(Participant):
    kind = Kind.AGENT

    def __init__(self, refresh: Callable[[], Awaitable[None]] | None = None) -> None:
        """`refresh`: re-resolve the downstream names and forget session placements (`Client.refresh`)."""
        super().__init__()
        self._refresh = refresh
        self._live: dict[EpisodeKey, _Live] = {}
        self._moving: dict[EpisodeKey, _Live] = {}
        """The live episodes between boundaries (not standing at one, not parked): all readiness looks at."""
        self._restored: dict[EpisodeKey, EpisodeCheckpoint] = {}
        """Restored records by the attempt that continues them, until a `Run` that claims one ends well."""
        self.replay_verify = False
        """The resources server verifies in `replay` mode: a running verify does not block."""
        self.continued = 0
        """Restored episodes claimed by a re-dispatched `Run` (status detail, for tests and operators)."""

    # -- data plane --------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def admitted(self, state: EpisodeState, fingerprint: str) -> AsyncIterator[None]:
        """Admit one `Run` (waiting while a checkpoint is open), continue a restored record if any.

        A `Run` cancelled by a retire ends with STALE_ATTEMPT rather than CANCELLED.
        """
        key = EpisodeKey(state.rollout_id, state.attempt)
        await self.admission.enter(key, blocks=False)
        record = self._restored.get(key)
        if record is not None:
            if record.request_fingerprint != fingerprint:
                raise AlreadyExists(
                    f"episode {state.label} was restored from a checkpoint of another task; nothing was changed",
                    reason="FINGERPRINT_MISMATCH",
                    metadata={"rollout_id": state.rollout_id, "attempt": str(state.attempt)},
                )
            del self._restored[key]
            restore_state(state, record, snapshot=False)
            tracing.link_previous(record.traceparent)
            state.resume_count += 1
            state.keeps_session_for_retry = True
            self.continued += 1
        task = asyncio.current_task()
        self._live[key] = self._moving[key] = _Live(state, fingerprint, task)
        self.changed.notify()
        try:
            yield
        except BaseException as exc:
            if record is not None and caller_retries(exc) and not self.marks.is_retired(key):
                # The caller sends the `Run` again (its connection broke, say): the retry continues from
                # the restored boundary once more, in the session the loop kept open, and the calls it
                # repeats return their first replies (de-duplication keys). Else it would start over.
                self._restored.setdefault(key, record)
            if not isinstance(exc, asyncio.CancelledError) or task is None or not self.marks.is_retired(key):
                raise
            task.uncancel()
            self.marks.check(key)  # raises STALE_ATTEMPT
            raise
        finally:
            del self._live[key]
            self._moving.pop(key, None)
            self.changed.notify()

    async def drive(
        self,
        state: EpisodeState,
        steps: AsyncIterator[common_pb2.Message | None],
        deadline: asyncio.Timeout | None = None,
    ) -> AsyncGenerator[common_pb2.Message | None, None]:
        """`steps` (an `EpisodeLoop.steps`), parked at each boundary while admission is closed."""
        key = EpisodeKey(state.rollout_id, state.attempt)
        live = self._live[key]
        live.deadline = deadline
        async for message in steps:
            self._moving.pop(key, None)
            self.changed.notify()
            yield message
            if not self.admission.is_open and state.phase is not Phase.COMPLETED:
                await self._park(state, deadline)
            self.marks.check(key)  # retired while it stood at the boundary
            self._moving[key] = live

    async def _park(self, state: EpisodeState, deadline: asyncio.Timeout | None) -> None:
        """Wait for resume with the episode's deadline paused; the time goes to `parked_s`."""
        loop = asyncio.get_running_loop()
        live = self._live[EpisodeKey(state.rollout_id, state.attempt)]
        if live.held is not None:  # its held Generate returned early: `open_admission` accounts for it all
            await self.admission.wait_open(f"episode {state.label}")
            return
        started = live.parked_since = loop.time()
        when = deadline.when() if deadline is not None else None
        if deadline is not None:
            deadline.reschedule(None)
        try:
            await self.admission.wait_open(f"episode {state.label}")
        finally:
            parked = loop.time() - started
            state.parked_s += parked
            live.parked_since = None
            if deadline is not None and when is not None:
                deadline.reschedule(when + parked)

    async def close_admission(self) -> None:
        """Also pause the deadline of episodes waiting on Generate: the model holds them until resume."""
        await super().close_admission()
        now = asyncio.get_running_loop().time()
        for live in self._moving.values():
            if live.state.phase is Phase.READY_FOR_MODEL and live.held is None:
                live.held = (now, live.deadline.when() if live.deadline is not None else None)
                if live.deadline is not None:
                    live.deadline.reschedule(None)

    async def open_admission(self) -> None:
        now = asyncio.get_running_loop().time()
        for live in self._live.values():
            if live.held is not None:
                (started, when), live.held = live.held, None
                live.state.parked_s += now - started
                if live.deadline is not None and when is not None:
                    live.deadline.reschedule(when + now - started)
        await super().open_admission()

    # -- readiness ---------------------------------------------------------------------------

    def _blocks(self, live: _Live) -> bool:
        """Whether a moving episode blocks."""
        phase = live.state.phase
        if phase is Phase.READY_FOR_MODEL:
            return False  # in Generate: the model holds or cuts it
        return not (phase is Phase.READY_FOR_VERIFY and self.replay_verify)

    def readiness(self) -> Report:
        blockers = tuple(sorted(k for k, live in self._moving.items() if self._blocks(live)))
        counts = {
            "live": len(self._live),
            "parked": len(self._live) - len(self._moving),
            "restored_pending": len(self._restored),
            "continued": self.continued,
        }
        return Report(blockers=blockers, counts=counts)

    # -- commit ------------------------------------------------------------------------------

    async def capture(self, scope: Scope) -> Capture:
        now = asyncio.get_running_loop().time()
        parked: list[tuple[EpisodeKey, EpisodeState, str, float]] = []
        for key, live in self._live.items():
            if (scope is None or key in scope) and live.state.phase not in (Phase.NEW, Phase.COMPLETED):
                since = live.parked_since if live.held is None else live.held[0]
                parked.append((key, frozen(live.state), live.fingerprint, 0.0 if since is None else now - since))
        restored = [(k, r) for k, r in self._restored.items() if scope is None or k in scope]  # never changed
        return Capture(functools.partial(_records, parked, restored), len(parked) + len(restored))

    async def delete_restored(self, scope: Scope) -> None:
        if scope is not None:
            for key in [k for k in self._restored if k not in scope]:
                del self._restored[key]
            self.changed.notify()

    # -- restore -----------------------------------------------------------------------------

    def not_fresh(self) -> str | None:
        if self._live or self._restored:
            return f"it holds {len(self._live)} running and {len(self._restored)} restored episodes"
        return super().not_fresh()

    async def stage(
        self, records: Sequence[rec_pb.CheckpointRecord], scope: frozenset[EpisodeKey]
    ) -> dict[EpisodeKey, EpisodeCheckpoint]:
        if self._refresh is not None:
            try:  # before any restored episode calls out: place its sessions among today's replicas
                await self._refresh()
            except GymrpcError as exc:
                log.warning("could not resolve the resources and model names again: %s", exc)
        staged: dict[EpisodeKey, EpisodeCheckpoint] = {}
        for record in records:
            key = EpisodeKey.of(record.episode_id)
            body = EpisodeCheckpoint()
            if record.WhichOneof("body") != "other" or not record.other.Unpack(body):
                raise DataLoss(f"the record of {key} is not an agent episode; nothing was installed")
            if body.episode_id.rollout_id != key.rollout_id:
                raise DataLoss(f"the record of {key} holds episode {body.episode_id.rollout_id!r}; nothing installed")
            if key.next() in staged:
                raise DataLoss(f"{key} appears twice in the checkpoint; nothing was installed")
            try:
                check_running(body, snapshot=False)
            except GymrpcError as err:
                raise DataLoss(f"{err.message}; nothing was installed") from None
            staged[key.next()] = body
        return staged

    async def install(self, staged: dict[EpisodeKey, EpisodeCheckpoint]) -> list[EpisodeKey]:
        self._restored.update(staged)
        self.changed.notify()
        return sorted(staged)

    # -- retire ------------------------------------------------------------------------------

    async def retire(self, episodes: Sequence[EpisodeKey]) -> None:
        doomed = {k: live for k, live in self._live.items() if self.marks.is_retired(k)}
        for live in doomed.values():
            if live.task is not None:
                live.task.cancel()
        while any(self._live.get(k) is live for k, live in doomed.items()):
            await self.changed.wait(1.0)
        for key in [k for k in self._restored if self.marks.is_retired(k)]:
            del self._restored[key]

    def details(self) -> dict[str, str]:
        return {"running": str(len(self._live)), "restored_pending": str(len(self._restored))}


def frozen(state: EpisodeState) -> EpisodeState:
    """A copy of `state` that the episode's next steps leave as it is, cheap enough to take for every episode.

    The loop only appends to the state's lists or replaces them, never changes a message or call
    record once appended, and adds to `usage` in place: the lists are copied (their items shared)
    and `usage` is copied; every other field is a number, a string or a message that is replaced.
    """
    copy = object.__new__(EpisodeState)
    fields = copy.__dict__
    fields.update(state.__dict__)
    for name in _LISTS:
        fields[name] = list(fields[name])
    usage = fields["usage"] = type(state.usage)()
    usage.CopyFrom(state.usage)
    return copy


_LISTS = ("tools", "messages", "pending_tool_calls", "model_calls", "tool_calls")


def _records(
    parked: Sequence[tuple[EpisodeKey, EpisodeState, str, float]],
    restored: Sequence[tuple[EpisodeKey, EpisodeCheckpoint]],
) -> Iterator[rec_pb.CheckpointRecord]:
    """A capture's records (worker thread), by episode: a restored record as it was, else the boundary."""
    states = {key: (state, request_fingerprint, parking) for key, state, request_fingerprint, parking in parked}
    kept = dict(restored)
    for key in sorted(states.keys() | kept.keys()):
        record = rec_pb.CheckpointRecord(episode_id=key.to_pb())
        pack(record.other, kept[key] if key in kept else boundary_record(*states[key]))
        yield record


def boundary_record(state: EpisodeState, request_fingerprint: str, parking: float = 0.0) -> Message:
    """The `EncodedCheckpoint` of `state` at its boundary, without a session snapshot or attempt.

    `parking`: seconds of the current park, not yet in `state.parked_s`.
    """
    record = new_record(state, request_fingerprint, restart_count=state.restart_count)
    record_boundary(record, state, None)
    if parking:
        record.parked.CopyFrom(duration(state.parked_s + parking))
    record.episode_id.ClearField("attempt")
    return record
