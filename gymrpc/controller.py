"""`Controller`: drives coordinated checkpoints across every participant of a stack (docs/design.md §7).

    async with gymrpc.Client() as client:
        controller = gymrpc.Controller(client)
        result = await controller.checkpoint("/ckpt", episode_ids=in_flight)   # prepare, commit, resume
        ...
        await controller.restore("restore-1", result.checkpoint_dir, result.continued)  # fresh stack
        await controller.resume("restore-1")

Participants are found through the registry: every endpoint it lists (every replica of every
name) is asked `GetStatus`; UNIMPLEMENTED means "not a participant". Each replica is a member of
its own, addressed directly (`Client.participant(name, endpoint_id)`), and writes its own folder
of the checkpoint. A restore reads every replica's records of a name and each new replica
installs those placed on it (`gymrpc.balancing.place` over the replicas registered now), so a
checkpoint restores onto any number of replicas. Orders (`gymrpc.control.types`): prepare stage by
stage (environment, model, agent, resources) and stop at the first stage not prepared by
the deadline; commit and restore all at once; resume in reverse, past failures (a
participant that cannot be reached aborts by itself when its lease runs out); retire and
forget callers before callees. When the registry itself does not answer, an operation raises
`gymrpc.errors.RegistryUnavailable` (the stack is gone), never a `CoordinationError` that
would read as some participants failing. Restore is all or nothing: on any failure the half
installed attempts are retired everywhere and everyone is resumed before the error is raised.

Once every member committed, the controller writes the checkpoint's index last
(`gymrpc.control.index`); a restore reads exactly the replicas it lists and refuses a folder
without one, so the controller must see the checkpoint folder its participants write.

`checkpoint` does not stop the world for the write: each participant's Commit
(`persist_in_background`) only captures its state in memory, the controller resumes at once,
then waits for every member's `Persist` (its manifest, fsynced) and only then writes the index.
A member that dies between its capture and its write makes the publish fail
(`CoordinationError("persist")`, reason CHECKPOINT_INCOMPLETE): no index, so the previous
published checkpoint is still the one a restore finds. `nonstop=False` keeps the older order
(write, then resume); a participant that does not know the flag writes first anyway.

A checkpoint that fails after its commit began is discarded (`discard`): every member is told to
stop its write for good and answers once it has ended (`Persist` with `abandon`), then the folder
is removed (`gymrpc.control.gc`), so failed checkpoints do not pile up. A member that cannot
confirm (unreachable) may still be writing: the folder is then kept, and `gymrpc ctl gc ROOT`
(`gc.sweep`) removes it once a newer checkpoint is published. From the capture until the
publish ends, the folder holds a lease (`gc.LEASE`) that keeps the sweep away from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from gymrpc import tracing
from gymrpc.control import gc
from gymrpc.control.index import endpoint_order, index_sources, read_index, sources_of, write_index
from gymrpc.control.membership import Directory, Member
from gymrpc.control.plane import writes_nothing
from gymrpc.control.store import checkpoint_episodes
from gymrpc.control.trainer_state import TrainerState, reference
from gymrpc.control.types import (
    CALLERS,
    PREPARE_ORDER,
    RECOVERY_DURABLE,
    RECOVERY_LABEL,
    RESUME_ORDER,
    RETIRE_ORDER,
    EpisodeKey,
    Kind,
    packed_scope,
)
from gymrpc.errors import (
    DataLoss,
    FailedPrecondition,
    GymrpcError,
    InvalidArgument,
    NotFound,
    RegistryUnavailable,
    Unimplemented,
)
from gymrpc.ids import check_attempt, check_id
from gymrpc.pbtime import timestamp
from gymrpc.v1 import common_pb2
from gymrpc.v1 import participant_service_pb2 as pb

log = logging.getLogger(__name__)
RPC_SLACK = 5.0
"""Seconds an RPC may outlive its deadline: a participant replies *at* the deadline (e.g. PREPARING)."""
CLEANUP_SECONDS = 30.0


class CoordinationError(Exception):
    """One control operation failed on some participants; `failures` maps member label to error."""

    def __init__(self, operation: str, failures: dict[str, GymrpcError]) -> None:
        self.operation, self.failures = operation, failures
        detail = "; ".join(f"{name}: {err}" for name, err in sorted(failures.items()))
        super().__init__(f"{operation} failed on {len(failures)} participant(s): {detail}")


_REFUSED_BEFORE_INSTALL = (InvalidArgument, NotFound, DataLoss)
"""Restore refusals a participant gives only before it installs anything (bad request, data)."""


def refused_before_install(error: GymrpcError) -> bool:
    """A participant's restore refusal that left it as it was: a bad request or data, or a process
    that has served work since it started (`NOT_FRESH`)."""
    return type(error) in _REFUSED_BEFORE_INSTALL or error.reason == "NOT_FRESH"


class _Labelled(Protocol):
    @property
    def label(self) -> str: ...


T = TypeVar("T", bound=_Labelled)


@dataclass
class PrepareResult:
    prepared: bool
    replies: dict[str, pb.PrepareResponse]
    """Replies of the stages reached, by member label (`Member.label`)."""

    def blockers(self) -> dict[str, list[EpisodeKey]]:
        return {n: [EpisodeKey.of(e) for e in r.report.blockers] for n, r in self.replies.items() if r.report.blockers}

    def restarts(self) -> set[EpisodeKey]:
        return {EpisodeKey.of(e) for r in self.replies.values() for e in r.report.restarts}

    def continued(self, episodes: Iterable[EpisodeKey]) -> list[EpisodeKey]:
        """The commit scope: `episodes` minus those some participant can only restart."""
        restarts = self.restarts()
        return [e for e in episodes if e not in restarts]


@dataclass
class Captured:
    """A commit every member answered: captured (`persisting`) or already written; not yet indexed."""

    checkpoint_id: str
    checkpoint_dir: Path
    members: list[Member]
    replies: dict[str, pb.CommitResponse]
    deadline: float
    weight_versions: dict[str, str]
    trainer_state: pb.TrainerStateRef | None = None


@dataclass
class CheckpointResult:
    checkpoint_id: str
    checkpoint_dir: Path
    prepare: PrepareResult
    manifests: dict[str, pb.CheckpointManifest] = field(default_factory=dict)
    continued: list[EpisodeKey] = field(default_factory=list)
    restarted: list[EpisodeKey] = field(default_factory=list)
    index: pb.CheckpointIndex | None = None
    """The index written into `checkpoint_dir` (`INDEX`) once every member committed."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds: `parked` (prepare's start to the end of the resume: episodes stood still) and
    `commit_to_publish` (commit's start to the index written); absent for phases not reached."""

    @property
    def committed(self) -> bool:
        """Every member committed and the index is written: the checkpoint can be restored."""
        return bool(self.manifests) and self.index is not None

    def sources(self) -> dict[str, list[str]]:
        """Name -> endpoint ids of the replicas that committed: `Controller.restore(sources=...)`."""
        return sources_of((m.name, m.endpoint_id) for m in self.manifests.values())


def _refuse_durable_agents(listed: Iterable[Any]) -> None:
    """A checkpoint would silently leave out the episodes of an agent with durable resume: refuse the stack."""
    durable = sorted({e.name for e in listed if e.labels.get(RECOVERY_LABEL) == RECOVERY_DURABLE})
    if durable:
        raise CoordinationError(
            "discover",
            {
                name: FailedPrecondition(
                    f"{name} runs durable resume (--resume-dir): it is not a ParticipantService participant, "
                    "so a coordinated checkpoint would leave its episodes out; run that agent without "
                    "resume_dir to checkpoint it, or recover it by durable resume alone (no controller)",
                    reason="INVALID_REQUEST",
                    metadata={"service": name, "recovery": RECOVERY_DURABLE},
                )
                for name in durable
            },
        )


def _phase_span(name: str) -> Callable[[Callable[..., Awaitable[Any]]], Callable[..., Awaitable[Any]]]:
    """A span `checkpoint.<name>` around an operation whose first argument is its id (tracing on)."""

    def wrap(operation: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(operation)
        async def traced(self: Any, operation_id: str, *args: Any, **kwargs: Any) -> Any:
            with tracing.span(f"checkpoint.{name}", **{"gymrpc.operation_id": operation_id}):
                return await operation(self, operation_id, *args, **kwargs)

        return traced

    return wrap


def new_checkpoint_id(prefix: str = "ckpt") -> str:
    return f"{prefix}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(4)}"


def _absolute(path: str | Path) -> str:
    """Checkpoint folders travel as absolute paths: every participant resolves them alike."""
    return os.path.abspath(path)


def _ids(episodes: Iterable[EpisodeKey]) -> list[common_pb2.EpisodeId]:
    return [e.to_pb() for e in episodes]


def _commit_requests(
    base: pb.CommitRequest, episode_ids: Iterable[EpisodeKey] | None, members: Sequence[Member]
) -> dict[bool, pb.CommitRequest]:
    """The Commit for each scope form some member reads: packed (True) or one `EpisodeId` each (False).

    The packed form costs two flat lists to build and to read, not one message per episode, which
    matters while thousands of episodes wait; a participant that does not say it reads that form
    (an older one) gets `episode_ids`, since it would take a packed scope for an empty one.
    """
    episodes = list(episode_ids or ())
    requests: dict[bool, pb.CommitRequest] = {}
    for packed in {m.packed_scope for m in members}:
        request = requests[packed] = pb.CommitRequest()
        request.CopyFrom(base)
        if packed:
            rollout_ids, attempts = packed_scope(episodes)
            request.scope_rollout_ids.extend(rollout_ids)
            request.scope_attempts.extend(attempts)
        else:
            request.episode_ids.extend(_ids(episodes))
    return requests


class Controller:
    """Control calls across the participants of the stack `client` reaches.

    Args:
        client: a `gymrpc.Client` holding the control token, or any other `Directory`
            (`gymrpc.control.membership`): how participants are listed and reached.
        names: the participants; default: every registered name that answers `GetStatus`.
        prefix: with `names` unset, only registry names starting with it.
    """

    def __init__(self, client: Directory, *, names: Sequence[str] | None = None, prefix: str = "") -> None:
        self.client = client
        self._names = list(names) if names is not None else None
        self._prefix = prefix
        self.members: list[Member] = []
        tracing.setup_from_env("controller")

    # -- discovery ---------------------------------------------------------------------------

    async def discover(self, timeout: float = 10.0) -> list[Member]:
        """(Re)discover participants, every replica of each name; sorted by prepare order, name, replica."""
        found = await self._endpoints()
        replies = await self._fan(
            "discover",
            found,
            lambda t: self._stub(t).GetStatus(pb.GetStatusRequest(), timeout=timeout),
            skip=(Unimplemented,),
        )
        kinds = set(Kind)
        members = [
            t.of_kind(Kind(reply.kind), packed_scope=reply.accepts_packed_scope)
            for t in found
            if (reply := replies.get(t.label)) is not None and reply.kind in kinds
        ]
        self.members = sorted(
            members, key=lambda m: (PREPARE_ORDER.index(m.kind), m.name, endpoint_order(m.endpoint_id))
        )
        return self.members

    async def _endpoints(self) -> list[Member]:
        """Every registered replica of the participant names (or of `names`), kind not yet known."""
        if self._names is None:
            listed = await self.client.list_endpoints(self._prefix)
        else:
            names = [Member(n) for n in self._names]
            resolved = await self._fan("discover", names, lambda t: self.client.resolve_endpoints(t.name))
            listed = [e for t in names for e in resolved[t.label]]
        _refuse_durable_agents(listed)
        ids: dict[str, set[str | None]] = {}
        for endpoint in listed:
            ids.setdefault(endpoint.name, set()).add(endpoint.endpoint_id or None)
        return [Member(n, None, i, len(ids[n])) for n in sorted(ids) for i in sorted(ids[n], key=endpoint_order)]

    async def _members(self) -> list[Member]:
        return self.members or await self.discover()

    def _stub(self, target: Member) -> Any:
        if target.endpoint_id is None:
            return self.client.participant(target.name)
        return self.client.participant(target.name, target.endpoint_id)

    async def _fan(
        self,
        operation: str,
        targets: Sequence[T],
        call: Callable[[T], Awaitable[Any]],
        *,
        skip: tuple[type[GymrpcError], ...] = (),
    ) -> dict[str, Any]:
        """Call every target at once; replies by label; raise `CoordinationError` naming each failure."""
        results = await asyncio.gather(*(call(t) for t in targets), return_exceptions=True)
        replies, failures = {}, {}
        for target, result in zip(targets, results, strict=True):
            if isinstance(result, skip):
                continue
            if isinstance(result, GymrpcError):
                failures[target.label] = result
            elif isinstance(result, BaseException):
                raise result
            else:
                replies[target.label] = result
        if failures:
            gone = next((e for e in failures.values() if isinstance(e, RegistryUnavailable)), None)
            if gone is not None:
                raise gone  # the whole stack, not some participants: say so, not "failed on N"
            raise CoordinationError(operation, failures)
        return replies

    @staticmethod
    def _left(deadline: float) -> float:
        return max(deadline - time.time(), 0.0) + RPC_SLACK

    # -- operations --------------------------------------------------------------------------

    @_phase_span("prepare")
    async def prepare(self, checkpoint_id: str, *, timeout: float = 30.0) -> PrepareResult:
        """Stage by stage; stops at the first stage not prepared by the deadline (admission stays closed)."""
        deadline = time.time() + timeout
        request = pb.PrepareRequest(checkpoint_id=checkpoint_id, deadline=timestamp(deadline))
        members = await self._members()
        replies: dict[str, pb.PrepareResponse] = {}
        for kind in PREPARE_ORDER:
            stage = [m for m in members if m.kind is kind]
            if not stage:
                continue
            got = await self._fan(
                "prepare", stage, lambda m: self._stub(m).Prepare(request, timeout=self._left(deadline))
            )
            replies.update(got)
            if any(r.phase != pb.PARTICIPANT_PHASE_PREPARED for r in got.values()):
                return PrepareResult(False, replies)
        return PrepareResult(True, replies)

    async def commit(
        self,
        checkpoint_id: str,
        checkpoint_dir: str | Path,
        episode_ids: Iterable[EpisodeKey] | None,
        *,
        timeout: float = 60.0,
        stop: bool = False,
        trainer_state: TrainerState | str | os.PathLike[str] | None = None,
    ) -> dict[str, pb.CheckpointManifest]:
        """All at once. `episode_ids` names every episode continued (restored ones by their new attempt);
        `None` commits every parked episode, an empty list none. Once every member committed, the
        checkpoint's index is written into `checkpoint_dir` (`write_index`), last, with
        `trainer_state` registered in it (see `checkpoint`). Episodes stay parked for the write:
        `capture` then `resume` then `publish` is the same without that pause."""
        captured = await self.capture(
            checkpoint_id,
            checkpoint_dir,
            episode_ids,
            timeout=timeout,
            stop=stop,
            trainer_state=trainer_state,
            background=False,
        )
        return (await self.publish(captured))[0]

    @_phase_span("commit")
    async def capture(
        self,
        checkpoint_id: str,
        checkpoint_dir: str | Path,
        episode_ids: Iterable[EpisodeKey] | None,
        *,
        timeout: float = 60.0,
        stop: bool = False,
        trainer_state: TrainerState | str | os.PathLike[str] | None = None,
        background: bool = True,
        base: str | Path | None = None,
        resume: bool = False,
    ) -> Captured:
        """Commit everyone at once; with `background` each member replies once its state is captured
        in memory and writes afterwards (resume may follow at once). Nothing is published: `publish`
        waits for every write and writes the index. The weight versions are read here, while the
        episodes are still parked, so they are those of the capture. `base`: the previous published
        checkpoint of the same root, for an incremental commit (members refer to the records it
        holds instead of writing them again).

        The lease file, the Commit fan-out and the weight-version reads run side by side. `resume`
        (with `background`): each member is resumed as soon as it and every member that calls it
        (`CALLERS`) captured, not once the slowest member did; a failure raises before the rest
        resume (resume, as the abort, then reaches every member)."""
        deadline = time.time() + timeout
        trainer_ref = None if trainer_state is None else await asyncio.to_thread(reference, trainer_state)
        request = pb.CommitRequest(
            checkpoint_id=checkpoint_id,
            deadline=timestamp(deadline),
            checkpoint_dir=_absolute(checkpoint_dir),
            stop=stop,
            explicit_scope=episode_ids is not None,
            persist_in_background=background,
            base_checkpoint_dir="" if base is None else _absolute(base),
        )
        members = await self._members()
        requests = _commit_requests(request, episode_ids, members)
        commits = {
            m.label: asyncio.ensure_future(self._stub(m).Commit(requests[m.packed_scope], timeout=self._left(deadline)))
            for m in members
        }
        versions = asyncio.ensure_future(self._weight_versions(members, deadline))
        leased = asyncio.ensure_future(
            asyncio.to_thread(self._lease, Path(request.checkpoint_dir), checkpoint_id, deadline)
        )
        resumes = self._resume_when_captured(checkpoint_id, members, commits, versions) if resume else {}
        try:
            replies = await self._fan("commit", members, lambda m: commits[m.label])
            weight_versions = await versions
            await leased
            if resumes:
                await self._fan("resume", members, lambda m: resumes[m.label])
        except BaseException:
            pending = [*commits.values(), versions, *resumes.values()]
            for task in pending:
                task.cancel()
            await asyncio.gather(leased, *pending, return_exceptions=True)  # every outcome retrieved
            raise
        return Captured(
            checkpoint_id, Path(request.checkpoint_dir), list(members), replies, deadline, weight_versions, trainer_ref
        )

    def _resume_when_captured(
        self,
        checkpoint_id: str,
        members: Sequence[Member],
        commits: Mapping[str, asyncio.Future[Any]],
        versions: asyncio.Future[dict[str, str]],
    ) -> dict[str, asyncio.Future[pb.ResumeResponse]]:
        """One Resume per member, sent once it and every member of its `CALLERS` kinds captured.

        A callee resumed before its callers captured could deliver what it held to a caller that
        is then captured past it (a model's reply would move an agent's episode on); a caller
        resumed early only sends calls that wait at its callees' closed admission. A model also
        waits for the weight versions, which are read while it is parked.
        """
        request = pb.ResumeRequest(checkpoint_id=checkpoint_id)
        by_kind: dict[Kind | None, list[asyncio.Future[Any]]] = {}
        for m in members:
            by_kind.setdefault(m.kind, []).append(commits[m.label])

        async def resume(member: Member) -> pb.ResumeResponse:
            known = CALLERS.get(member.kind) if member.kind is not None else None
            callers = known if known is not None else tuple(by_kind)  # an unknown kind waits for everyone
            waits = [commits[member.label], *(c for k in callers for c in by_kind.get(k, ()))]
            await asyncio.gather(*waits)
            if member.kind is Kind.MODEL:
                await versions
            with tracing.span(
                "checkpoint.resume", **{"gymrpc.operation_id": checkpoint_id, "gymrpc.member": member.label}
            ):
                return await self._stub(member).Resume(request, timeout=30.0)

        return {m.label: asyncio.ensure_future(resume(m)) for m in members}

    async def publish(
        self, captured: Captured, *, timeout: float | None = None
    ) -> tuple[dict[str, pb.CheckpointManifest], pb.CheckpointIndex]:
        """Wait for every member's write (`Persist`, until the commit's deadline or `timeout` from now),
        then write the index: only a checkpoint every member persisted is ever published. A member
        that restarted since its capture answers CHECKPOINT_INCOMPLETE: `CoordinationError`, no index."""
        with tracing.span("checkpoint.publish", **{"gymrpc.operation_id": captured.checkpoint_id}):
            return await self._publish(captured, timeout)

    async def _publish(
        self, captured: Captured, timeout: float | None
    ) -> tuple[dict[str, pb.CheckpointManifest], pb.CheckpointIndex]:
        deadline = captured.deadline if timeout is None else time.time() + timeout
        if timeout is not None:
            await asyncio.to_thread(self._lease, captured.checkpoint_dir, captured.checkpoint_id, deadline)
        request = pb.PersistRequest(checkpoint_id=captured.checkpoint_id, deadline=timestamp(deadline))
        waiting = [m for m in captured.members if captured.replies[m.label].persisting]
        persisted = await self._fan(
            "persist", waiting, lambda m: self._stub(m).Persist(request, timeout=self._left(deadline))
        )
        manifests = {
            m.label: (persisted[m.label] if m.label in persisted else captured.replies[m.label]).manifest
            for m in captured.members
        }
        index = await asyncio.to_thread(
            functools.partial(
                write_index,
                captured.checkpoint_dir,
                captured.checkpoint_id,
                [manifests[m.label] for m in captured.members],
                trainer_state=captured.trainer_state,
                weight_versions=captured.weight_versions,
            )
        )
        await asyncio.to_thread(gc.drop_lease, captured.checkpoint_dir)
        return manifests, index

    @staticmethod
    def _lease(folder: Path, checkpoint_id: str, deadline: float) -> None:
        """Keep the sweep (`gc.sweep`) off the folder until the publish's deadline; best effort."""
        try:
            gc.write_lease(folder, checkpoint_id, deadline + RPC_SLACK)
        except OSError as exc:
            log.warning("could not write the publish lease of %s: %s", folder, exc)

    async def discard(
        self, checkpoint_id: str, checkpoint_dir: str | Path, *, timeout: float = CLEANUP_SECONDS
    ) -> bool:
        """Give up on a checkpoint that will not be published, and remove its folder.

        Every member is told to stop its write for good (`Persist` with `abandon`) and answers once
        that write has ended; a member that never captured it answers CHECKPOINT_INCOMPLETE, which
        is as good. Once all have answered, nothing writes into the folder any more and it is removed
        (never one with an index: `gc.remove_unpublished`). True if removed (or never created);
        False if some member could not confirm (it may still be writing): the folder stays, for
        `gymrpc ctl gc` to remove once a newer checkpoint is published.
        """
        folder = Path(_absolute(checkpoint_dir))
        deadline = time.time() + timeout
        request = pb.PersistRequest(checkpoint_id=checkpoint_id, deadline=timestamp(deadline), abandon=True)
        members = await self._members()
        results = await asyncio.gather(
            *(self._stub(m).Persist(request, timeout=self._left(deadline)) for m in members), return_exceptions=True
        )
        unsure = {
            m.label: r
            for m, r in zip(members, results, strict=True)
            if isinstance(r, BaseException) and not writes_nothing(r)
        }
        if unsure:
            log.warning(
                "checkpoint %s not removed: %s may still write into it (%s); gymrpc ctl gc removes it later",
                checkpoint_id,
                ", ".join(sorted(unsure)),
                "; ".join(f"{k}: {v}" for k, v in sorted(unsure.items())),
            )
            return False
        try:
            removed = await asyncio.to_thread(gc.remove_unpublished, folder, checkpoint_id)
        except (GymrpcError, OSError) as exc:
            log.warning("checkpoint %s not removed: %s", checkpoint_id, exc)
            return False
        if removed:
            log.info("removed the folder of unpublished checkpoint %s (%s)", checkpoint_id, folder)
        return True

    async def _weight_versions(self, members: Sequence[Member], deadline: float) -> dict[str, str]:
        """Model server name -> the weight version it has loaded (its `GetStatus` details say)."""
        models = [m for m in members if m.kind is Kind.MODEL]
        if not models:
            return {}
        replies = await self._fan(
            "status",
            models,
            lambda m: self._stub(m).GetStatus(pb.GetStatusRequest(), timeout=self._left(deadline)),
        )
        by_label = {m.label: m.name for m in models}
        return {
            by_label[label]: r.details["weight_version"]
            for label, r in replies.items()
            if "weight_version" in r.details
        }

    @_phase_span("resume")
    async def resume(self, checkpoint_id: str, *, timeout: float = 30.0) -> dict[str, pb.ResumeResponse]:
        """Reverse order, past failures; raises `CoordinationError` at the end if any failed."""
        request = pb.ResumeRequest(checkpoint_id=checkpoint_id)
        members = await self._members()
        replies: dict[str, pb.ResumeResponse] = {}
        failures: dict[str, GymrpcError] = {}
        for kind in RESUME_ORDER:
            stage = [m for m in members if m.kind is kind]
            try:
                replies.update(
                    await self._fan("resume", stage, lambda m: self._stub(m).Resume(request, timeout=timeout))
                )
            except CoordinationError as exc:
                failures.update(exc.failures)
        if failures:
            raise CoordinationError("resume", failures)
        return replies

    @_phase_span("restore")
    async def restore(
        self,
        restore_id: str,
        checkpoint_dir: str | Path,
        episode_ids: Iterable[EpisodeKey],
        *,
        timeout: float = 120.0,
        sources: Mapping[str, Sequence[str]] | None = None,
        allow_weight_version_mismatch: bool = False,
    ) -> dict[str, pb.RestoreResponse]:
        """All at once, all or nothing; the episodes come back as attempt + 1 (then `resume`).

        Each replica reads the records of every replica of its name that committed and installs
        the ones placed on it among the replicas registered now (discovered again first), so the
        replica count may differ from the checkpoint's. The replicas that committed are those the
        checkpoint's index lists (`read_index`: each manifest checked against its sha256 first); a
        folder without an index is refused before anything is installed, as incomplete.
        `sources` (name -> endpoint ids that committed, `CheckpointResult.sources()`) is the escape
        hatch: the caller vouches for them and the index is not read (a controller that cannot see
        the folder, or a checkpoint committed by hand). Afterwards the client forgets where it had
        placed sessions of these names (`Client.refresh`): they are where `place` says.
        A model server with other weights loaded than it had at the commit refuses
        (WEIGHT_VERSION_MISMATCH, naming both) unless `allow_weight_version_mismatch`.
        """
        episodes = list(episode_ids)
        for index, episode in enumerate(episodes):  # refused here, before any participant is asked
            check_id(episode.rollout_id, f"episode_ids[{index}].rollout_id")
            check_attempt(episode.attempt, f"episode_ids[{index}].attempt")
        deadline = time.time() + timeout
        folder = _absolute(checkpoint_dir)
        if sources is None:
            sources = index_sources(await asyncio.to_thread(read_index, Path(folder)))
            held = await asyncio.to_thread(checkpoint_episodes, Path(folder))
            if missing := [e for e in episodes if e not in held]:
                shown = ", ".join(map(str, missing[:10]))
                raise NotFound(
                    f"checkpoint {folder[:200]} holds no episode {shown}{' ...' if len(missing) > 10 else ''}; "
                    "nothing was restored",
                    metadata={"episodes": shown, "missing": str(len(missing))},
                )
        # Placement is over the replicas registered now, never over those of a stack seen earlier.
        members = await self.discover(timeout=max(deadline - time.time(), 1.0))  # within the restore's own deadline
        replicas: dict[str, list[str]] = {}
        for member in members:
            if member.endpoint_id is not None:
                replicas.setdefault(member.name, []).append(member.endpoint_id)

        def request(member: Member) -> pb.RestoreRequest:
            out = pb.RestoreRequest(
                checkpoint_id=restore_id,
                deadline=timestamp(deadline),
                checkpoint_dir=folder,
                episode_ids=_ids(episodes),
                allow_weight_version_mismatch=allow_weight_version_mismatch,
            )
            if member.endpoint_id is not None and sources.get(member.name):
                out.source_endpoint_ids.extend(sources[member.name])
                out.endpoint_ids.extend(replicas[member.name])
                out.endpoint_id = member.endpoint_id
            elif member.replicas > 1:
                log.warning(
                    "no replica of this name in the checkpoint's sources: each replica restores its own folder",
                    extra={"service": member.name, "checkpoint_dir": folder},
                )
            return out

        try:
            replies = await self._fan(
                "restore", members, lambda m: self._stub(m).Restore(request(m), timeout=self._left(deadline))
            )
        except CoordinationError as exc:
            cleanup = max(deadline - time.time(), CLEANUP_SECONDS)
            replacements = [e.next() for e in episodes]
            # Every member refused before installing anything: there is nothing to undo, and fencing the
            # next attempts would change processes that are still as they were (all or nothing).
            refused = len(exc.failures) == len(members) and all(map(refused_before_install, exc.failures.values()))
            try:
                if replacements and not refused:
                    await self.retire(new_checkpoint_id("undo"), replacements, timeout=cleanup)
            finally:
                await self.resume(restore_id)
            raise
        await self._refresh(replicas)
        return replies

    async def _refresh(self, names: Iterable[str]) -> None:
        """Let the client place the restored names' sessions afresh (`Client.refresh`); best effort."""
        for name in names:
            try:
                await self.client.refresh(name)
            except GymrpcError as exc:
                log.warning("could not resolve %s again after the restore: %s", name, exc)

    async def retire(
        self, operation_id: str, episode_ids: Iterable[EpisodeKey], *, timeout: float = 60.0
    ) -> dict[str, pb.RetireResponse]:
        """Callers before callees; refused while a checkpoint is open (resume it first)."""
        deadline = time.time() + timeout
        request = pb.RetireRequest(
            checkpoint_id=operation_id, deadline=timestamp(deadline), episode_ids=_ids(episode_ids)
        )
        return await self._ordered("retire", lambda m: self._stub(m).Retire(request, timeout=self._left(deadline)))

    async def forget(
        self, operation_id: str, rollout_ids: Iterable[str], *, timeout: float = 30.0
    ) -> dict[str, pb.ForgetResponse]:
        """Drop retire marks once the rollouts are done for good; callers before callees."""
        request = pb.ForgetRequest(checkpoint_id=operation_id, rollout_ids=list(rollout_ids))
        return await self._ordered("forget", lambda m: self._stub(m).Forget(request, timeout=timeout))

    async def _ordered(self, operation: str, call: Callable[[Member], Awaitable[Any]]) -> dict[str, Any]:
        members = await self._members()
        replies: dict[str, Any] = {}
        for kinds in RETIRE_ORDER:
            stage = [m for m in members if m.kind in kinds]
            replies.update(await self._fan(operation, stage, call))
        return replies

    async def open(self, operation_id: str | None = None) -> dict[str, pb.ResumeResponse]:
        """Open admission of processes started with `--await-restore`, when there is nothing to restore."""
        return await self.resume(operation_id or new_checkpoint_id("open"))

    async def renew(self, checkpoint_id: str, *, timeout: float = 60.0) -> dict[str, pb.RenewResponse]:
        """Extend every lease past a new deadline (for a controller that publishes slowly)."""
        request = pb.RenewRequest(checkpoint_id=checkpoint_id, deadline=timestamp(time.time() + timeout))
        members = await self._members()
        return await self._fan("renew", members, lambda m: self._stub(m).Renew(request, timeout=timeout))

    async def status(self, *, timeout: float = 10.0) -> dict[str, pb.GetStatusResponse]:
        members = await self._members()
        return await self._fan(
            "status", members, lambda m: self._stub(m).GetStatus(pb.GetStatusRequest(), timeout=timeout)
        )

    # -- the whole thing ---------------------------------------------------------------------

    async def checkpoint(
        self,
        root: str | Path,
        *,
        episode_ids: Iterable[EpisodeKey] | None = None,
        checkpoint_id: str | None = None,
        timeout: float = 30.0,
        stop: bool = False,
        trainer_state: TrainerState | str | os.PathLike[str] | None = None,
        nonstop: bool = True,
        incremental: bool = False,
    ) -> CheckpointResult:
        """Prepare, commit into `<root>/<checkpoint_id>`, then resume (unless `stop`).

        `nonstop` (default; not with `stop`): the commit only captures each member's state, the
        episodes resume at once, and the checkpoint is published (its index written) once every
        member persisted. A publish that fails raises after the resume; the folder has no index and
        is never restored. `nonstop=False`: the episodes stay parked until every member has written.

        Not prepared by the deadline: resume (abort) and return with `committed` False and the
        blockers in `prepare`. Any failure: resume (abort) and raise.

        `trainer_state`: the trainer's own state for this checkpoint (a folder or a file it wrote
        first, or a `TrainerState` with a label or a URI). It is registered in the index with its
        size and sha256, beside the weight version each model server had loaded
        (`index.weight_versions`), so trainer and stack restore together:
        `read_trainer_state(read_index(folder))` finds it again.

        `incremental`: members refer to the records the newest published checkpoint under `root`
        already holds instead of writing them again (`gc.newest_published`), so a commit writes
        what changed. That checkpoint's folder must then be kept while this one is (`gc.sweep`
        keeps referenced folders). A member that restarted since writes everything.
        """
        checkpoint_id = checkpoint_id or new_checkpoint_id()
        with tracing.span("checkpoint", **{"gymrpc.operation_id": checkpoint_id}):
            folder = Path(_absolute(root)) / checkpoint_id
            result = CheckpointResult(checkpoint_id, folder, PrepareResult(False, {}))
            background = nonstop and not stop
            resumed = committed = False
            started = time.perf_counter()
            try:
                result.prepare = await self.prepare(checkpoint_id, timeout=timeout)
                if result.prepare.prepared:
                    scope = None
                    if episode_ids is not None:
                        wanted = list(episode_ids)
                        scope = result.continued = result.prepare.continued(wanted)
                        continued = set(scope)
                        result.restarted = [e for e in wanted if e not in continued]
                    committing = time.perf_counter()
                    committed = True
                    base = await asyncio.to_thread(gc.newest_published, folder.parent) if incremental else None
                    captured = await self.capture(
                        checkpoint_id,
                        folder,
                        scope,
                        timeout=timeout,
                        stop=stop,
                        trainer_state=trainer_state,
                        background=background,
                        base=base,
                        resume=background,  # each member resumes once it and its callers captured
                    )
                    if background:  # the capture is all the episodes waited for
                        resumed = True
                        result.timings["parked"] = time.perf_counter() - started
                    result.manifests, result.index = await self.publish(captured)
                    result.timings["commit_to_publish"] = time.perf_counter() - committing
            except BaseException:
                if not resumed:
                    await asyncio.shield(self._abort(checkpoint_id))
                if committed:  # some members may have written: stop them for good, remove the folder
                    await asyncio.shield(self.discard(checkpoint_id, folder, timeout=min(timeout, CLEANUP_SECONDS)))
                raise
            if not resumed and not (stop and result.committed):
                await self.resume(checkpoint_id)
                result.timings["parked"] = time.perf_counter() - started
            return result

    async def _abort(self, checkpoint_id: str) -> None:
        with contextlib.suppress(CoordinationError):  # unreachable ones abort when their lease runs out
            await self.resume(checkpoint_id)
