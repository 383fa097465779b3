"""`Controller`: drives coordinated checkpoints across every participant of a stack (SPEC §7).

    async with gymrpc.Client() as client:
        controller = gymrpc.Controller(client)
        result = await controller.checkpoint("/ckpt", episode_ids=in_flight)   # prepare, commit, resume
        ...
        await controller.restore("restore-1", result.checkpoint_dir, result.continued)  # fresh stack
        await controller.resume("restore-1")

Participants are found by name: every endpoint the registry lists is asked `GetStatus`;
UNIMPLEMENTED means "not a participant". Orders (`gymrpc.control.types`): prepare stage by
stage (environment, model, agent, resources) and stop at the first stage not prepared by
the deadline; commit and restore all at once; resume in reverse, past failures (a
participant that cannot be reached aborts by itself when its lease runs out); retire and
forget callers before callees. Restore is all or nothing: on any failure the half
installed attempts are retired everywhere and everyone is resumed before the error is raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gymrpc.client import Client
from gymrpc.control.types import PREPARE_ORDER, RESUME_ORDER, RETIRE_ORDER, EpisodeKey, Kind
from gymrpc.errors import GymrpcError, Unimplemented
from gymrpc.pbtime import timestamp
from gymrpc.v1 import common_pb2
from gymrpc.v1 import participant_service_pb2 as pb

RPC_SLACK = 5.0
"""Seconds an RPC may outlive its deadline: a participant replies *at* the deadline (e.g. PREPARING)."""
CLEANUP_SECONDS = 30.0


class CoordinationError(Exception):
    """One control operation failed on some participants; `failures` maps name to error."""

    def __init__(self, operation: str, failures: dict[str, GymrpcError]) -> None:
        self.operation, self.failures = operation, failures
        detail = "; ".join(f"{name}: {err}" for name, err in sorted(failures.items()))
        super().__init__(f"{operation} failed on {len(failures)} participant(s): {detail}")


@dataclass(frozen=True)
class Member:
    name: str
    kind: Kind


@dataclass
class PrepareResult:
    prepared: bool
    replies: dict[str, pb.PrepareResponse]
    """Replies of the stages reached, by participant name."""

    def blockers(self) -> dict[str, list[EpisodeKey]]:
        return {n: [EpisodeKey.of(e) for e in r.report.blockers] for n, r in self.replies.items() if r.report.blockers}

    def restarts(self) -> set[EpisodeKey]:
        return {EpisodeKey.of(e) for r in self.replies.values() for e in r.report.restarts}

    def continued(self, episodes: Iterable[EpisodeKey]) -> list[EpisodeKey]:
        """The commit scope: `episodes` minus those some participant can only restart."""
        restarts = self.restarts()
        return [e for e in episodes if e not in restarts]


@dataclass
class CheckpointResult:
    checkpoint_id: str
    checkpoint_dir: Path
    prepare: PrepareResult
    manifests: dict[str, pb.CheckpointManifest] = field(default_factory=dict)
    continued: list[EpisodeKey] = field(default_factory=list)
    restarted: list[EpisodeKey] = field(default_factory=list)

    @property
    def committed(self) -> bool:
        return bool(self.manifests)


def new_checkpoint_id(prefix: str = "ckpt") -> str:
    return f"{prefix}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(4)}"


def _absolute(path: str | Path) -> str:
    """Checkpoint folders travel as absolute paths: every participant resolves them alike."""
    return os.path.abspath(path)


def _ids(episodes: Iterable[EpisodeKey]) -> list[common_pb2.EpisodeId]:
    return [e.to_pb() for e in episodes]


class Controller:
    """Control calls across the participants of the stack `client` reaches.

    Args:
        client: a `gymrpc.Client` holding the control token.
        names: the participants; default: every registered name that answers `GetStatus`.
        prefix: with `names` unset, only registry names starting with it.
    """

    def __init__(self, client: Client, *, names: Sequence[str] | None = None, prefix: str = "") -> None:
        self.client = client
        self._names = list(names) if names is not None else None
        self._prefix = prefix
        self.members: list[Member] = []

    # -- discovery ---------------------------------------------------------------------------

    async def discover(self, timeout: float = 10.0) -> list[Member]:
        """(Re)discover participants, sorted by prepare order then name."""
        names = self._names
        if names is None:
            names = sorted({e.name for e in await self.client.registry.list(self._prefix)})
        replies = await self._fan(
            "discover",
            names,
            lambda n: self._stub(n).GetStatus(pb.GetStatusRequest(), timeout=timeout),
            skip=(Unimplemented,),
        )
        members = [Member(n, Kind(r.kind)) for n, r in replies.items() if r.kind in set(Kind)]
        self.members = sorted(members, key=lambda m: (PREPARE_ORDER.index(m.kind), m.name))
        return self.members

    async def _members(self) -> list[Member]:
        return self.members or await self.discover()

    def _stub(self, name: str) -> Any:
        return self.client.participant(name)

    async def _fan(
        self,
        operation: str,
        names: Sequence[str],
        call: Callable[[str], Awaitable[Any]],
        *,
        skip: tuple[type[GymrpcError], ...] = (),
    ) -> dict[str, Any]:
        """Call every name at once; raise `CoordinationError` naming each failure."""
        results = await asyncio.gather(*(call(n) for n in names), return_exceptions=True)
        replies, failures = {}, {}
        for name, result in zip(names, results, strict=True):
            if isinstance(result, skip):
                continue
            if isinstance(result, GymrpcError):
                failures[name] = result
            elif isinstance(result, BaseException):
                raise result
            else:
                replies[name] = result
        if failures:
            raise CoordinationError(operation, failures)
        return replies

    @staticmethod
    def _left(deadline: float) -> float:
        return max(deadline - time.time(), 0.0) + RPC_SLACK

    # -- operations --------------------------------------------------------------------------

    async def prepare(self, checkpoint_id: str, *, timeout: float = 30.0) -> PrepareResult:
        """Stage by stage; stops at the first stage not prepared by the deadline (admission stays closed)."""
        deadline = time.time() + timeout
        request = pb.PrepareRequest(checkpoint_id=checkpoint_id, deadline=timestamp(deadline))
        members = await self._members()
        replies: dict[str, pb.PrepareResponse] = {}
        for kind in PREPARE_ORDER:
            stage = [m.name for m in members if m.kind is kind]
            if not stage:
                continue
            got = await self._fan(
                "prepare", stage, lambda n: self._stub(n).Prepare(request, timeout=self._left(deadline))
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
    ) -> dict[str, pb.CheckpointManifest]:
        """All at once. `episode_ids` names every episode continued (restored ones by their new attempt)."""
        deadline = time.time() + timeout
        request = pb.CommitRequest(
            checkpoint_id=checkpoint_id,
            deadline=timestamp(deadline),
            checkpoint_dir=_absolute(checkpoint_dir),
            episode_ids=_ids(episode_ids or ()),
            stop=stop,
        )
        names = [m.name for m in await self._members()]
        replies = await self._fan(
            "commit", names, lambda n: self._stub(n).Commit(request, timeout=self._left(deadline))
        )
        return {n: r.manifest for n, r in replies.items()}

    async def resume(self, checkpoint_id: str, *, timeout: float = 30.0) -> dict[str, pb.ResumeResponse]:
        """Reverse order, past failures; raises `CoordinationError` at the end if any failed."""
        request = pb.ResumeRequest(checkpoint_id=checkpoint_id)
        members = await self._members()
        replies: dict[str, pb.ResumeResponse] = {}
        failures: dict[str, GymrpcError] = {}
        for kind in RESUME_ORDER:
            stage = [m.name for m in members if m.kind is kind]
            try:
                replies.update(
                    await self._fan("resume", stage, lambda n: self._stub(n).Resume(request, timeout=timeout))
                )
            except CoordinationError as exc:
                failures.update(exc.failures)
        if failures:
            raise CoordinationError("resume", failures)
        return replies

    async def restore(
        self,
        restore_id: str,
        checkpoint_dir: str | Path,
        episode_ids: Iterable[EpisodeKey],
        *,
        timeout: float = 120.0,
    ) -> dict[str, pb.RestoreResponse]:
        """All at once, all or nothing; the episodes come back as attempt + 1 (then `resume`)."""
        episodes = list(episode_ids)
        deadline = time.time() + timeout
        request = pb.RestoreRequest(
            checkpoint_id=restore_id,
            deadline=timestamp(deadline),
            checkpoint_dir=_absolute(checkpoint_dir),
            episode_ids=_ids(episodes),
        )
        names = [m.name for m in await self._members()]
        try:
            return await self._fan(
                "restore", names, lambda n: self._stub(n).Restore(request, timeout=self._left(deadline))
            )
        except CoordinationError:
            cleanup = max(deadline - time.time(), CLEANUP_SECONDS)
            replacements = [e.next() for e in episodes]
            try:
                if replacements:
                    await self.retire(new_checkpoint_id("undo"), replacements, timeout=cleanup)
            finally:
                await self.resume(restore_id)
            raise

    async def retire(
        self, operation_id: str, episode_ids: Iterable[EpisodeKey], *, timeout: float = 60.0
    ) -> dict[str, pb.RetireResponse]:
        """Callers before callees; refused while a checkpoint is open (resume it first)."""
        deadline = time.time() + timeout
        request = pb.RetireRequest(
            checkpoint_id=operation_id, deadline=timestamp(deadline), episode_ids=_ids(episode_ids)
        )
        return await self._ordered("retire", lambda n: self._stub(n).Retire(request, timeout=self._left(deadline)))

    async def forget(
        self, operation_id: str, rollout_ids: Iterable[str], *, timeout: float = 30.0
    ) -> dict[str, pb.ForgetResponse]:
        """Drop retire marks once the rollouts are done for good; callers before callees."""
        request = pb.ForgetRequest(checkpoint_id=operation_id, rollout_ids=list(rollout_ids))
        return await self._ordered("forget", lambda n: self._stub(n).Forget(request, timeout=timeout))

    async def _ordered(self, operation: str, call: Callable[[str], Awaitable[Any]]) -> dict[str, Any]:
        members = await self._members()
        replies: dict[str, Any] = {}
        for kinds in RETIRE_ORDER:
            stage = [m.name for m in members if m.kind in kinds]
            replies.update(await self._fan(operation, stage, call))
        return replies

    async def open(self, operation_id: str | None = None) -> dict[str, pb.ResumeResponse]:
        """Open admission of processes started with `--await-restore`, when there is nothing to restore."""
        return await self.resume(operation_id or new_checkpoint_id("open"))

    async def renew(self, checkpoint_id: str, *, timeout: float = 60.0) -> dict[str, pb.RenewResponse]:
        """Extend every lease past a new deadline (for a controller that publishes slowly)."""
        request = pb.RenewRequest(checkpoint_id=checkpoint_id, deadline=timestamp(time.time() + timeout))
        names = [m.name for m in await self._members()]
        return await self._fan("renew", names, lambda n: self._stub(n).Renew(request, timeout=timeout))

    async def status(self, *, timeout: float = 10.0) -> dict[str, pb.GetStatusResponse]:
        names = [m.name for m in await self._members()]
        return await self._fan(
            "status", names, lambda n: self._stub(n).GetStatus(pb.GetStatusRequest(), timeout=timeout)
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
    ) -> CheckpointResult:
        """Prepare, commit into `<root>/<checkpoint_id>`, then resume (unless `stop`).

        Not prepared by the deadline: resume (abort) and return with `committed` False and the
        blockers in `prepare`. Any failure: resume (abort) and raise.
        """
        checkpoint_id = checkpoint_id or new_checkpoint_id()
        folder = Path(_absolute(root)) / checkpoint_id
        result = CheckpointResult(checkpoint_id, folder, PrepareResult(False, {}))
        try:
            result.prepare = await self.prepare(checkpoint_id, timeout=timeout)
            if result.prepare.prepared:
                scope = None
                if episode_ids is not None:
                    wanted = list(episode_ids)
                    scope = result.continued = result.prepare.continued(wanted)
                    result.restarted = [e for e in wanted if e not in set(scope)]
                result.manifests = await self.commit(checkpoint_id, folder, scope, timeout=timeout, stop=stop)
        except BaseException:
            await asyncio.shield(self._abort(checkpoint_id))
            raise
        if not (stop and result.committed):
            await self.resume(checkpoint_id)
        return result

    async def _abort(self, checkpoint_id: str) -> None:
        with contextlib.suppress(CoordinationError):  # unreachable ones abort when their lease runs out
            await self.resume(checkpoint_id)
