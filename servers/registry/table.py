"""The registry's state: endpoints under leases, expiry, and change notification.

Pure Python and synchronous, so the lease rules are tested without a server. Time
comes from a callable so tests can move it.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from gymrpc.errors import AlreadyExists, NotFound

MIN_TTL = 0.2
MAX_TTL = 300.0
DEFAULT_TTL = 10.0


@dataclass(frozen=True)
class Entry:
    """One live endpoint."""

    name: str
    endpoint_id: str
    address: str
    lease_id: str
    ttl: float
    expires_at: float
    registered_at: float
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Change:
    """An event for watchers: `added`, `removed` or `expired`."""

    kind: str
    entry: Entry


class Table:
    """Endpoints keyed by (name, endpoint_id), with leases keyed by lease id."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._entries: dict[tuple[str, str], Entry] = {}
        self._by_lease: dict[str, tuple[str, str]] = {}
        self._seen: set[str] = set()  # names that were ever registered (tell "expired" from "unknown")
        self._watchers: set[asyncio.Queue[Change | None]] = set()

    def register(
        self, name: str, endpoint_id: str, address: str, ttl: float, labels: dict[str, str], lease_id: str = ""
    ) -> Entry:
        """Add an endpoint, or replace the caller's own; the same address keeps its lease (an idempotent retry).

        A (name, endpoint id) held by another live lease at another address is NAME_TAKEN unless
        `lease_id` is that lease: only the server that holds it may move its entry, so a token
        holder cannot silently point a live server's name elsewhere.
        """
        now = self._clock()
        self.expire()
        ttl = min(max(ttl or DEFAULT_TTL, MIN_TTL), MAX_TTL)
        key = (name, endpoint_id)
        old = self._entries.get(key)
        if old is not None and old.address != address and not secrets.compare_digest(old.lease_id, lease_id):
            left = max(old.expires_at - now, 0.0)
            raise AlreadyExists(
                f"{name} replica {endpoint_id} is registered by another live server (lease expires in {left:.1f}s "
                "unless renewed); a restarted server passes its previous lease id, anyone else waits for it to expire",
                reason="NAME_TAKEN",
                metadata={"name": name, "endpoint_id": endpoint_id},
                retry_delay=min(left, old.ttl),
            )
        if old is not None and old.address == address:
            entry = replace(old, ttl=ttl, expires_at=now + ttl, labels=labels)
        else:
            if old is not None:
                del self._by_lease[old.lease_id]
            entry = Entry(name, endpoint_id, address, secrets.token_hex(12), ttl, now + ttl, now, labels)
        self._entries[key] = entry
        self._by_lease[entry.lease_id] = key
        self._seen.add(name)
        if old is None or old.address != address:
            self._publish(Change("added", entry))
        return entry

    def keep_alive(self, lease_id: str) -> Entry:
        """Extend a lease by its TTL; NotFound(LEASE_EXPIRED) when it is gone."""
        self.expire()
        key = self._by_lease.get(lease_id)
        if key is None:
            raise NotFound(
                f"lease {lease_id[:32]!r} is unknown or expired; register again",
                reason="LEASE_EXPIRED",
                metadata={"lease_id": lease_id[:32]},
            )
        entry = self._entries[key]
        entry = replace(entry, expires_at=self._clock() + entry.ttl)
        self._entries[key] = entry
        return entry

    def deregister(self, lease_id: str) -> bool:
        """Remove an endpoint by lease; False when it was already gone."""
        key = self._by_lease.pop(lease_id, None)
        if key is None:
            return False
        self._publish(Change("removed", self._entries.pop(key)))
        return True

    def resolve(self, name: str) -> list[Entry]:
        """Live endpoints of a name, by endpoint id; NotFound says whether the name ever lived."""
        self.expire()
        found = sorted((e for (n, _), e in self._entries.items() if n == name), key=lambda e: e.endpoint_id)
        if found:
            return found
        if name in self._seen:
            raise NotFound(
                f"service {name!r} has no live endpoint: its lease expired or it deregistered (it may be restarting)",
                reason="LEASE_EXPIRED",
                metadata={"name": name},
            )
        raise NotFound(
            f"service {name!r} was never registered; check the name (registered: {self.names_hint()})",
            reason="NOT_FOUND",
            metadata={"name": name},
        )

    def names_hint(self) -> str:
        names = sorted({n for n, _ in self._entries})
        return ", ".join(names[:20]) + (" ..." if len(names) > 20 else "") if names else "none"

    def list(self, prefix: str = "") -> list[Entry]:
        """Live endpoints whose name starts with `prefix`, by name then endpoint id."""
        self.expire()
        return sorted(
            (e for (n, _), e in self._entries.items() if n.startswith(prefix)),
            key=lambda e: (e.name, e.endpoint_id),
        )

    def expire(self) -> list[Entry]:
        """Drop every entry whose lease ran out; returns them."""
        now = self._clock()
        gone = [e for e in self._entries.values() if e.expires_at <= now]
        for entry in gone:
            del self._entries[(entry.name, entry.endpoint_id)]
            del self._by_lease[entry.lease_id]
            self._publish(Change("expired", entry))
        return gone

    def next_expiry(self) -> float | None:
        return min((e.expires_at for e in self._entries.values()), default=None)

    def subscribe(self) -> asyncio.Queue[Change | None]:
        """A queue of changes; a `None` in it means the watcher fell behind and was dropped."""
        queue: asyncio.Queue[Change | None] = asyncio.Queue(maxsize=10_000)
        self._watchers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[Change | None]) -> None:
        self._watchers.discard(queue)

    def _publish(self, change: Change) -> None:
        for queue in list(self._watchers):
            try:
                queue.put_nowait(change)
            except asyncio.QueueFull:  # a stuck watcher loses its stream, not the registry
                self._watchers.discard(queue)
                queue.get_nowait()
                queue.put_nowait(None)
