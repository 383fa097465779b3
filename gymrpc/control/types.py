"""Value types of the control plane, and their one mapping to and from the wire.

The control plane works on these plain types so that its logic is testable without
protobuf; `gymrpc.servers.participant` and `gymrpc.controller` convert at the edge.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import NamedTuple

from gymrpc.errors import InvalidArgument
from gymrpc.ids import MAX_ATTEMPT, all_ids_valid, check_attempt, check_id
from gymrpc.v1 import common_pb2
from gymrpc.v1 import participant_service_pb2 as pb

RECOVERY_LABEL = "recovery"
"""Registry label a server sets when it recovers episodes without coordinated checkpoints."""
RECOVERY_DURABLE = "durable"
"""`recovery=durable`: an agent with per-episode durable resume, not a participant; controllers refuse its stack."""
MAX_REPORTED_BLOCKERS = 100
"""Blockers listed in a report; `blocker_count` is always the full count."""


class EpisodeKey(NamedTuple):
    """One episode attempt: hashable, ordered, cheap."""

    rollout_id: str
    attempt: int

    @classmethod
    def of(cls, episode_id: common_pb2.EpisodeId, field: str = "episode_id") -> EpisodeKey:
        """Validate a wire `EpisodeId` (its rollout id may reach file names)."""
        return cls(
            check_id(episode_id.rollout_id, f"{field}.rollout_id"),
            check_attempt(episode_id.attempt, f"{field}.attempt"),
        )

    def next(self) -> EpisodeKey:
        """The attempt a restore continues this one as."""
        return EpisodeKey(self.rollout_id, self.attempt + 1)

    def to_pb(self) -> common_pb2.EpisodeId:
        return common_pb2.EpisodeId(rollout_id=self.rollout_id, attempt=self.attempt)

    def __str__(self) -> str:
        return f"{self.rollout_id}/a{self.attempt}"


def episode_keys(episode_ids: Iterable[common_pb2.EpisodeId], field: str = "episode_ids") -> list[EpisodeKey]:
    """Validate a repeated `EpisodeId` field; duplicates collapse, order is kept.

    A commit names every episode in flight while they are parked, so this checks them all in
    one pass (`all_ids_valid`) and looks at each one alone only to name the first invalid one.
    """
    pairs = [(e.rollout_id, e.attempt) for e in episode_ids]
    if pairs:
        attempts = [a for _, a in pairs]
        if not (all_ids_valid([r for r, _ in pairs]) and min(attempts) >= 0 and max(attempts) <= MAX_ATTEMPT):
            for index, (rollout_id, attempt) in enumerate(pairs):
                check_id(rollout_id, f"{field}[{index}].rollout_id")
                check_attempt(attempt, f"{field}[{index}].attempt")
    new = tuple.__new__  # what EpisodeKey(...) does, without its Python-level __new__
    return list(dict.fromkeys([new(EpisodeKey, pair) for pair in pairs]))


def packed_episode_keys(
    rollout_ids: Sequence[str], attempts: Sequence[int], field: str = "scope_rollout_ids"
) -> frozenset[EpisodeKey]:
    """Validate a packed scope (`CommitRequest.scope_rollout_ids` and `scope_attempts`), as a set."""
    ids, numbers = checked_packed_scope(rollout_ids, attempts, field)
    return frozenset(map(tuple.__new__, repeat(EpisodeKey), zip(ids, numbers, strict=True)))


def checked_packed_scope(
    rollout_ids: Sequence[str], attempts: Sequence[int], field: str = "scope_rollout_ids"
) -> tuple[Sequence[str], list[int]]:
    """Validate a packed scope: its two lists, checked (`scope.PackedScope` makes them a set when used).

    The form exists so that a commit of thousands of episodes costs one pass over two flat lists
    while they are parked: one regex pass over every id, `min` and `max` over the attempts, and each
    one alone only to name the first invalid one. Lists of different lengths are refused. The ids
    are returned as given (a request's repeated field is not copied while the episodes wait); the
    attempts as a list, since `min`/`max` over a protobuf container cost 4x a copy of it.
    """
    ids, numbers = rollout_ids, list(attempts)
    if len(ids) != len(numbers):
        raise InvalidArgument(
            f"{field} has {len(ids)} entries but scope_attempts has {len(numbers)}: "
            "entry i of each names one episode, so they must be the same length",
            metadata={"field": field, "rollout_ids": str(len(ids)), "attempts": str(len(numbers))},
        )
    if not all_ids_valid(ids):
        for index, rollout_id in enumerate(ids):
            check_id(rollout_id, f"{field}[{index}]")
    if numbers and (min(numbers) < 0 or max(numbers) > MAX_ATTEMPT):
        for index, attempt in enumerate(numbers):
            check_attempt(attempt, f"scope_attempts[{index}]")
    return ids, numbers


def packed_scope(episodes: Iterable[EpisodeKey]) -> tuple[list[str], list[int]]:
    """`episodes` as `CommitRequest.scope_rollout_ids` and `scope_attempts` (no message per episode)."""
    listed = list(episodes)
    return [e[0] for e in listed], [e[1] for e in listed]


class Phase(enum.IntEnum):
    """Control-plane phase; values are `gymrpc.v1.ParticipantPhase`'s."""

    IDLE = pb.PARTICIPANT_PHASE_IDLE
    PREPARING = pb.PARTICIPANT_PHASE_PREPARING
    PREPARED = pb.PARTICIPANT_PHASE_PREPARED
    COMMITTED = pb.PARTICIPANT_PHASE_COMMITTED
    RESTORED = pb.PARTICIPANT_PHASE_RESTORED


class Kind(enum.IntEnum):
    """Participant kind; values are `gymrpc.v1.ParticipantKind`'s. Fixes the place in every order."""

    ENVIRONMENT = pb.PARTICIPANT_KIND_ENVIRONMENT
    MODEL = pb.PARTICIPANT_KIND_MODEL
    AGENT = pb.PARTICIPANT_KIND_AGENT
    RESOURCES = pb.PARTICIPANT_KIND_RESOURCES

    @property
    def folder(self) -> str:
        """Folder name under a checkpoint directory (`resources`, `model`, ...)."""
        return self.name.lower()


PREPARE_ORDER: tuple[Kind, ...] = (Kind.ENVIRONMENT, Kind.MODEL, Kind.AGENT, Kind.RESOURCES)
"""Environments park first; the model then holds and cuts, so agents waiting on it reach a
boundary; resources go last because agents and environments call them until they park."""
RESUME_ORDER: tuple[Kind, ...] = tuple(reversed(PREPARE_ORDER))
CALLERS: dict[Kind, tuple[Kind, ...]] = {
    Kind.ENVIRONMENT: (),
    Kind.AGENT: (Kind.ENVIRONMENT,),
    Kind.MODEL: (Kind.ENVIRONMENT, Kind.AGENT),
    Kind.RESOURCES: (Kind.ENVIRONMENT, Kind.AGENT),
}
"""The kinds whose work calls each kind. A member resumed early delivers what it held (a model's
replies) to its callers, so it may resume only once every caller captured; a caller resumed before
its callees is safe, since its calls wait at their closed admission until they resume."""
RETIRE_ORDER: tuple[tuple[Kind, ...], ...] = ((Kind.ENVIRONMENT,), (Kind.AGENT,), (Kind.MODEL, Kind.RESOURCES))
"""Callers before callees, so no retired caller can re-create state in a callee already retired."""


@dataclass(frozen=True)
class Report:
    """Readiness of one participant for a commit."""

    blockers: tuple[EpisodeKey, ...] = ()
    """Episodes still running between boundaries (or unknown work, keyed by an empty rollout id)."""
    restarts: tuple[EpisodeKey, ...] = ()
    """Episodes this participant cannot capture; they restart after a crash."""
    counts: Mapping[str, int] = field(default_factory=dict)
    busy: int = 0
    """Blocking work not tied to an episode (for example a retire still running)."""

    @property
    def ready(self) -> bool:
        return not self.blockers and not self.busy

    def to_pb(self) -> pb.PrepareReport:
        return pb.PrepareReport(
            ready=self.ready,
            blockers=[k.to_pb() for k in self.blockers[:MAX_REPORTED_BLOCKERS]],
            blocker_count=len(self.blockers) + self.busy,
            restarts=[k.to_pb() for k in self.restarts],
            counts={k: int(v) for k, v in self.counts.items()},
        )
