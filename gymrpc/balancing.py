"""Replica choice for `gymrpc.Client`: several endpoints behind one name, with session affinity.

A name may have several replicas (endpoint ids `0`..`N-1`). Servers keep per-session state in
memory (a resources session, an agent's running episode, a model's request cache), so every
call of a session must reach the replica that holds it. The affinity key of a call is its
`session_id`, else its episode's `rollout_id` (`affinity_key`); calls without one (`ListTools`)
go round-robin.

Placement of a new key is rendezvous hashing (highest random weight) over the healthy replicas:
every client computes the same replica for a key without talking to the others, so when an
episode moves to another agent replica, that agent's resources calls still reach the replica
holding the session. The choice is then remembered (a bounded LRU table), so a replica that
joins or comes back later does not pull live sessions away from where they are.

A replica is marked down when a call to it fails with UNAVAILABLE; its keys then move to their
next choice, which every client agrees on, and each move is counted per key as a failover (the
session's state is gone with the process: the caller resumes it from a checkpoint there). A mark
clears when the registry shows the endpoint at a new address (it restarted) or after
`down_seconds`. When every replica is down, calls keep going to their own replica and wait for it,
exactly as with a single endpoint.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

log = logging.getLogger(__name__)
MAX_SESSIONS = 100_000
"""Keys remembered per client: far more than the sessions one client has in flight."""
DOWN_SECONDS = 30.0
"""How long an address that failed stays out of new placements unless the registry shows a new one."""
MAX_EVENTS = 10_000


class Endpoint(Protocol):
    """What the balancer needs of a registry endpoint (`gymrpc.v1.Endpoint`)."""

    endpoint_id: str
    address: str


@dataclass(frozen=True)
class Failover:
    """A key's calls moved from one replica to another because the first failed."""

    name: str
    key: str
    from_endpoint: str
    to_endpoint: str
    at: float
    """`time.time()` of the move."""


@dataclass(slots=True)
class _Placement:
    endpoint_id: str
    failovers: int = 0


class _Replicas:
    """The endpoints of one name as last resolved, and which of their addresses failed."""

    def __init__(self) -> None:
        self.addresses: dict[str, str] = {}  # endpoint id -> address
        self.down: dict[str, float] = {}  # address -> monotonic time it stays down until
        self.ids: list[str] = []
        self.round_robin = itertools.count()


class Balancer:
    """Chooses the replica of each call; one per `Client`, used from one event loop (no locks).

    Args:
        max_sessions: affinity entries kept (least recently used go first; a forgotten key is
            placed again by hashing, which usually picks the same replica).
        down_seconds: how long a failed address is avoided unless it is replaced.
        clock: monotonic seconds (tests move it).
    """

    def __init__(
        self,
        *,
        max_sessions: int = MAX_SESSIONS,
        down_seconds: float = DOWN_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._names: dict[str, _Replicas] = {}
        self._sticky: OrderedDict[tuple[str, str], _Placement] = OrderedDict()
        self._max_sessions, self._down_seconds, self._clock = max_sessions, down_seconds, clock
        self.events: deque[Failover] = deque(maxlen=MAX_EVENTS)
        """The latest failovers, oldest first."""

    # -- what the registry says -------------------------------------------------------------

    def knows(self, name: str) -> bool:
        return name in self._names

    def update(self, name: str, endpoints: Iterable[Endpoint]) -> set[str]:
        """Take the registry's current endpoints of `name`; returns the addresses it no longer lists."""
        replicas = self._names.setdefault(name, _Replicas())
        fresh = {e.endpoint_id: e.address for e in endpoints}
        gone = set(replicas.addresses.values()) - set(fresh.values())
        replicas.addresses, replicas.ids = fresh, sorted(fresh)
        for address in gone:
            replicas.down.pop(address, None)
        return gone

    def addresses(self) -> set[str]:
        """Every address some name currently maps to (their channels stay open)."""
        return {a for r in self._names.values() for a in r.addresses.values()}

    def address_of(self, name: str, endpoint_id: str) -> str | None:
        """The address of one replica (a control call to every replica in turn), None if not listed."""
        replicas = self._names.get(name)
        return None if replicas is None else replicas.addresses.get(endpoint_id)

    def forget(self, name: str) -> None:
        """Drop every remembered placement and down mark of `name`.

        After a restore onto the replicas now registered, each restored session lives on the
        replica `place` gives it among them: new calls must be placed afresh, not sent where the
        session was before the crash, and no replica may be skipped because it failed back then.
        """
        for key in [k for k in self._sticky if k[0] == name]:
            del self._sticky[key]
        replicas = self._names.get(name)
        if replicas is not None:
            replicas.down.clear()

    # -- choosing ----------------------------------------------------------------------------

    def pick(self, name: str, key: str | None) -> str:
        """The address for a call of `name` with affinity key `key` (None: any healthy replica)."""
        replicas = self._names[name]
        if not replicas.ids:
            raise LookupError(f"{name!r} has no endpoints")
        placed = None
        if key is not None:
            placed = self._sticky.get((name, key))
            if placed is not None:  # the hot path: a session's next call
                self._sticky.move_to_end((name, key))
                address = replicas.addresses.get(placed.endpoint_id)
                if address is not None and self._up(replicas, address):
                    return address
        elif len(replicas.ids) == 1:
            return replicas.addresses[replicas.ids[0]]
        healthy = [i for i in replicas.ids if self._up(replicas, replicas.addresses[i])]
        if key is None:
            pool = healthy or replicas.ids
            return replicas.addresses[pool[next(replicas.round_robin) % len(pool)]]
        if placed is not None and not healthy and placed.endpoint_id in replicas.addresses:
            return replicas.addresses[placed.endpoint_id]  # nothing better: wait for its own replica
        choice = place(key, healthy or replicas.ids)
        if placed is None:
            self._sticky[(name, key)] = _Placement(choice)
            if len(self._sticky) > self._max_sessions:
                self._sticky.popitem(last=False)
        else:
            self._move(name, key, placed, choice)
        return replicas.addresses[choice]

    def _up(self, replicas: _Replicas, address: str) -> bool:
        return not replicas.down or replicas.down.get(address, 0.0) <= self._clock()

    def failed(self, name: str, address: str) -> None:
        """A call to `address` failed with UNAVAILABLE: keep new placements off it for a while."""
        replicas = self._names.get(name)
        if replicas is None or address not in replicas.addresses.values():
            return
        if replicas.down.get(address, 0.0) <= self._clock():
            endpoint = next(i for i, a in replicas.addresses.items() if a == address)
            message = (
                "replica unavailable; its sessions move to other replicas"
                if len(replicas.addresses) > 1
                else "server unavailable (restarting?); calls wait for it under the same name"
            )
            log.warning(
                message,
                extra={"service": name, "endpoint_id": endpoint, "address": address, "replicas": len(replicas.ids)},
            )
        replicas.down[address] = self._clock() + self._down_seconds

    # -- what happened -----------------------------------------------------------------------

    def endpoint_of(self, name: str, key: str) -> str | None:
        """The endpoint id `key`'s calls of `name` go to, if it was placed and is remembered."""
        placed = self._sticky.get((name, key))
        return None if placed is None else placed.endpoint_id

    def placements(self, name: str) -> dict[str, str]:
        """Every remembered key of `name` and the endpoint id its calls go to."""
        return {key: placed.endpoint_id for (n, key), placed in self._sticky.items() if n == name}

    def failovers(self, name: str, key: str) -> int:
        """How many times `key`'s calls of `name` moved to another replica after one failed."""
        placed = self._sticky.get((name, key))
        return 0 if placed is None else placed.failovers

    # -- internals ---------------------------------------------------------------------------

    def _move(self, name: str, key: str, placed: _Placement, choice: str) -> None:
        failover = Failover(name, key, placed.endpoint_id, choice, time.time())
        placed.endpoint_id, placed.failovers = choice, placed.failovers + 1
        self.events.append(failover)
        log.info(
            "session moved to another replica",
            extra={"service": name, "key": key, "from_endpoint": failover.from_endpoint, "to_endpoint": choice},
        )


def place(key: str, endpoint_ids: Iterable[str]) -> str:
    """The replica a new session `key` goes to among `endpoint_ids`, as every client computes it.

    A restore onto a different number of replicas gives each restored record to `place(key, new
    ids)` (`gymrpc.control.plane.Placement`): clients then route the session's calls to the
    replica that holds it, untold. The ids compare by their 8-byte BLAKE2b digest of
    `key NUL endpoint_id` (`RestoreRequest.endpoint_ids` states it for other languages).
    """
    return max(endpoint_ids, key=lambda i: _weight(key, i))


def _weight(key: str, endpoint_id: str) -> bytes:
    """Rendezvous weight of a replica for a key: the same in every process."""
    return hashlib.blake2b(f"{key}\0{endpoint_id}".encode(), digest_size=8).digest()


# -- affinity keys -----------------------------------------------------------------------------

_EXTRACTORS: dict[type, Callable[[Message], str | None]] = {}


def affinity_key(request: Message) -> str | None:
    """The session a request belongs to: its `session_id`, else `episode_id.rollout_id` (also one
    level down, as in `RunStreamRequest.request`); None when it names neither."""
    extract = _EXTRACTORS.get(type(request))
    if extract is None:
        extract = _EXTRACTORS[type(request)] = _extractor(request.DESCRIPTOR)
    return extract(request)


def _extractor(descriptor: Any, depth: int = 0) -> Callable[[Message], str | None]:
    """How to read the key of one message type, worked out once from its descriptor."""
    fields = descriptor.fields_by_name
    session = fields.get("session_id")
    if session is not None and session.type == FieldDescriptor.TYPE_STRING:
        return _session
    episode = fields.get("episode_id")
    if episode is not None and episode.message_type is not None and "rollout_id" in episode.message_type.fields_by_name:
        return _rollout
    if depth == 0:
        for field in descriptor.fields:
            if field.message_type is not None and not field.is_repeated:
                inner = _extractor(field.message_type, depth + 1)
                if inner is not _none:
                    return _nested(field.name, inner)
    return _none


def _session(m: Any) -> str | None:
    return m.session_id or None


def _rollout(m: Any) -> str | None:
    return m.episode_id.rollout_id or None


def _nested(name: str, inner: Callable[[Message], str | None]) -> Callable[[Message], str | None]:
    return lambda m: inner(getattr(m, name))


def _none(_: Message) -> str | None:
    return None
