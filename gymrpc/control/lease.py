"""The open checkpoint's lease: how long a participant waits for a silent controller.

Every control call with a deadline renews it to `max(lease, deadline + grace)`; a resume
clears it. A watcher task calls `on_expire` once the lease has run out, so a controller
that vanished (crashed, partitioned) never leaves admission closed. Times are wall-clock
seconds, like the deadlines controllers send.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from gymrpc.control.admission import Notifier


class Lease:
    def __init__(self, grace: float, clock: Callable[[], float], on_expire: Callable[[], Awaitable[None]]) -> None:
        if not grace > 0:
            raise ValueError("the lease grace must be positive")
        self.grace, self.clock, self.on_expire = grace, clock, on_expire
        self.expires_at: float | None = None
        self._changed = Notifier()
        self._watcher: asyncio.Task[None] | None = None
        self._wakes_at: float | None = None
        """When the sleeping watcher looks again by itself; None: only when notified."""

    def renew(self, deadline: float) -> float:
        """Extend the lease; wake the watcher only if it would look too late.

        A watcher asleep until an earlier time finds the later expiry when it wakes, so the
        control calls of a checkpoint (and of the next ones) cost no task step here.
        """
        self.expires_at = max(self.expires_at or 0.0, deadline + self.grace)
        if self._wakes_at is None or self.expires_at < self._wakes_at:
            self._changed.notify()
        return self.expires_at

    def clear(self) -> None:
        """Drop the lease; a watcher asleep until its old expiry wakes then and finds none."""
        self.expires_at = None

    @property
    def expired(self) -> bool:
        return self.expires_at is not None and self.clock() >= self.expires_at

    def start(self) -> None:
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch(), name="control-lease")

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher

    async def _watch(self) -> None:
        while True:
            expires = self.expires_at
            if expires is None:
                self._wakes_at = None
                await self._changed.wait(None)
                continue
            left = expires - self.clock()
            if left > 0:
                self._wakes_at = expires
                await self._changed.wait(left)
                continue
            await self.on_expire()  # it re-checks under its lock, then clears or renews
            if self.expires_at == expires:
                self.clear()  # never spin on a lease nobody cleared
