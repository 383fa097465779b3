"""`Participant`: the per-role hooks the control plane drives (agent, resources, model, environment).

The plane owns phases, fencing, replay, the lease, deadlines and the files; a role only
says what admission, readiness, export, restore and retire mean for its own state. The
base gives every role the same data-plane gate (`admission`) and retired-attempt marks
(`marks`); hooks change them only through the plane's calls.

Contract of each hook, as the plane relies on it:
- `close_admission` / `open_admission`: idempotent; after close, in-flight work heads for
  its next boundary and new work waits (`admission.enter`).
- `readiness`: cheap and synchronous (every Prepare and every wake of a waiting one calls
  it): no scan of every episode or session, only of what is moving; call `changed.notify()`
  whenever it may have changed. Counts that need a scan go in `status_counts` (GetStatus only).
- `capture(scope)`: called once per checkpoint, while prepared and ready (the episodes are
  parked for it, so it must be cheap); returns a `Capture` of the episodes in `scope` (None:
  every parked episode): references to state that is never changed in place, or copies of
  what is. Must not change state. Its `records()` builds the records later, in a worker
  thread while the episodes run again; a capture taken copy-on-write has a `settle` the write
  awaits first, on the event loop. A scope may be a `scope.PackedScope`, a set once first used:
  testing membership in the pause costs the set, so a capture that can applies it in
  `records()`. `export(scope)` is `capture(scope).records()` (settled first); a role may
  implement `export` alone (its capture then builds the records at once).
- `select(records, scope)`: the records a restore passes to `stage` (default: those of
  the episodes in `scope`; a role whose records are shared by episodes keeps those too).
- `placement_key(record)`: the affinity key clients route the record's calls by; a restore
  onto several replicas stages a record only on the replica `gymrpc.balancing.place` gives
  that key (None: on every replica).
- `stage(records, scope)`: decode and validate every record (DATA_LOSS on damage) without
  changing anything; `install(staged)` then swaps it in all at once and returns the new
  attempts it installed. A failed stage or install leaves the process as it was.
- `retire(episodes)`: runs after the attempts are marked; stops their work, waits for it,
  frees their state; idempotent. `delete_restored(scope)` frees restored state the commit
  scope left out, without marking it.

What the hooks mean for an agent (kind AGENT; resources and model are implemented in
`servers.*.participant`):
- admission: new runs wait (`admission.enter`); each running episode loop checks
  `admission.is_open` at every boundary and parks there (`admission.wait_open()`), adding
  the time parked to `EpisodeState.parked_s` and to its deadline (parked time is free).
- readiness: a blocker is an episode between boundaries. An episode waiting on `Generate`
  counts as parked at the boundary before the call (the model holds or cuts the response);
  a running tool call, or a verify in `wait` mode, blocks; a `replay` verify does not.
- capture: a copy of each parked episode's `EpisodeState` at that boundary (its lists copied,
  their messages shared); `records()` makes one record per episode in scope from it, in
  `CheckpointRecord.other` (or a new typed field of the record).
- stage/install: restored episodes wait as attempt N+1 until a re-dispatched `Run` of that
  attempt claims one and continues from its boundary; `delete_restored` frees the unclaimed.
- retire: cancel the episode tasks of fenced attempts, wait for them, free their state.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, ClassVar

from gymrpc.control.admission import Admission, Notifier
from gymrpc.control.marks import RetiredAttempts
from gymrpc.control.types import EpisodeKey, Kind, Report
from gymrpc.v1 import checkpoint_records_pb2 as rec_pb

Scope = AbstractSet[EpisodeKey] | None
"""Episodes a commit continues; None means every parked episode. A `frozenset`, or a
`scope.PackedScope`, which becomes one on first use: a capture that can leave the scope to its
`records()` (the write's worker thread) keeps it out of the pause."""


@dataclass(frozen=True)
class Capture:
    """A participant's state in a commit scope as it stood at the capture; its records are built later.

    Taken while the episodes are parked (`Participant.capture`), so taking it costs references
    and small copies, not serialisation. `records()` may run in a worker thread while the
    episodes go on, and more than once (a failed write is retried from the same capture): `build`
    reads only what the capture holds, never the participant's live state, and returns equal
    records every time.
    """

    build: Callable[[], Iterable[rec_pb.CheckpointRecord]]
    """Makes the records one by one (a generator): the write pauses between them to let the event loop run."""
    episodes: int = 0
    """How many episodes (or sessions) it holds, for logs."""
    settle: Callable[[], Awaitable[None]] | None = None
    """For a capture taken copy-on-write: takes, on the event loop after the resume, the state of
    everything not changed since the capture (what changed was taken before it changed). The
    write awaits it before `build`; awaiting it again does nothing."""

    def records(self) -> list[rec_pb.CheckpointRecord]:
        return list(self.build())

    @classmethod
    def of(cls, records: Sequence[rec_pb.CheckpointRecord]) -> Capture:
        """A capture whose records were built at once (a role that implements `export` only)."""
        built = list(records)
        return cls(lambda: list(built), len(built))


class Participant(abc.ABC):
    kind: ClassVar[Kind]

    def __init__(self) -> None:
        self.changed = Notifier()
        self.marks = RetiredAttempts()
        self.admission = Admission(self.marks, self.changed)

    # -- admission ---------------------------------------------------------------------------

    async def close_admission(self) -> None:
        """Prepare (and restore) closed admission: park in-flight work at its next boundary."""
        self.admission.close()

    async def open_admission(self) -> None:
        """Resume (or an abort) reopened it: release parked and held work."""
        self.admission.open()

    async def park_exported(self, scope: Scope) -> None:
        """A `stop` commit: the process is about to go; refuse new work instead of queueing it."""
        self.admission.stop()

    # -- readiness ---------------------------------------------------------------------------

    @abc.abstractmethod
    def readiness(self) -> Report:
        """What still blocks a commit, and which episodes can only restart."""

    def status_counts(self) -> dict[str, int]:
        """Counts that take a scan (ledger rows, ...): added to the GetStatus report, not to Prepare's."""
        return {}

    # -- commit ------------------------------------------------------------------------------

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.capture is Participant.capture and cls.export is Participant.export:
            raise TypeError(f"{cls.__name__} must implement capture (or export)")

    async def capture(self, scope: Scope) -> Capture:
        """The state of the parked episodes in `scope`, cheap to take; see `Capture`.

        The default builds the records at once (`export`): a role whose records are cheap may
        implement `export` alone.
        """
        return Capture.of(await self.export(scope))

    async def export(self, scope: Scope) -> list[rec_pb.CheckpointRecord]:
        """Records of the parked episodes in `scope`, one or more per episode: `capture(scope).records()`."""
        capture = await self.capture(scope)
        if capture.settle is not None:
            await capture.settle()
        return capture.records()

    async def delete_restored(self, scope: Scope) -> None:  # noqa: B027 - optional hook
        """Free restored-but-unclaimed state of episodes outside `scope` (no mark)."""

    # -- restore -----------------------------------------------------------------------------

    def not_fresh(self) -> str | None:
        """Why this process cannot take a restore (it served work), or None when it can."""
        if self.admission.admitted_total:
            return f"it already admitted {self.admission.admitted_total} data-plane calls"
        return None

    def select(
        self, records: Sequence[rec_pb.CheckpointRecord], scope: frozenset[EpisodeKey]
    ) -> list[rec_pb.CheckpointRecord]:
        """The records a restore of `scope` stages: those of its episodes, plus any a role shares across episodes."""
        return [r for r in records if EpisodeKey.of(r.episode_id) in scope]

    def placement_key(self, record: rec_pb.CheckpointRecord) -> str | None:
        """The affinity key (`gymrpc.balancing.affinity_key`) of the calls that will use `record`.

        A restore onto several replicas installs the record only where clients route that key;
        the default is the rollout id (`Run`, `Generate`). None: the record goes to every replica.
        """
        return record.episode_id.rollout_id

    def check_records(  # noqa: B027 - optional hook
        self, records: Sequence[rec_pb.CheckpointRecord], *, allow_weight_version_mismatch: bool = False
    ) -> None:
        """Refuse a restore from records this participant must not install (before `stage`)."""

    @abc.abstractmethod
    async def stage(self, records: Sequence[rec_pb.CheckpointRecord], scope: frozenset[EpisodeKey]) -> Any:
        """Decode and validate every record of the restore scope; change nothing."""

    @abc.abstractmethod
    async def install(self, staged: Any) -> list[EpisodeKey]:
        """Install what `stage` returned, all at once; return the attempts now live."""

    # -- retire ------------------------------------------------------------------------------

    @abc.abstractmethod
    async def retire(self, episodes: Sequence[EpisodeKey]) -> None:
        """Stop and free every attempt up to each of `episodes` (already marked)."""

    async def forget(self, rollout_ids: Iterable[str]) -> None:  # noqa: B027 - optional hook
        """The marks of these rollouts were dropped; free any bookkeeping kept for them."""

    # -- status ------------------------------------------------------------------------------

    def details(self) -> dict[str, str]:
        """Role-specific status facts (`GetStatusResponse.details`)."""
        return {}
