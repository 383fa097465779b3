"""Copy-on-write captures of a host's sessions: taking one costs a copy of the session table.

A non-stop commit captures every session in scope while the episodes are parked. Taking each
session's state then (its cached replies, `Session.capture`) is a Python loop over thousands of
sessions in the pause: about 5 ms a resources server at 1,250 sessions, and in a one-process
stack the pause holds every server's loop. Instead a capture copies the host's table of live
sessions and registers itself here (`FrozenSessions.freeze`). The host calls `before_change`
before anything changes a session (a tool call, a turn, a verify, a close, a restore): the
session's state is taken first, as it stood at the capture, since nothing ran in between
(admission was closed). After the resume, `settle` takes the state of every session not
changed yet, on the event loop, a slice at a time; the write's worker thread then reads only
what was taken, never a live session.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Mapping
from typing import Any

SLICE = 256
"""Sessions `settle` takes before it lets the event loop run other work."""


class Frozen:
    """One capture: the sessions live at it, and the state taken of each so far."""

    def __init__(self, slots: Mapping[str, Any], take: Callable[[str, Any], Any]) -> None:
        self.slots = dict(slots)
        """Session id -> the slot object live at the capture (a later slot under the id is another session)."""
        self.taken: dict[str, Any] = {}
        """Session id -> what `take` returned (or the exception it raised, for the write to report)."""
        self._take = take

    def keep(self, session_id: str, slot: Any) -> None:
        """Take the state of `session_id` unless taken already, or `slot` is not the one captured."""
        if session_id not in self.taken and self.slots.get(session_id) is slot:
            try:
                self.taken[session_id] = self._take(session_id, slot)
            except Exception as exc:  # never into the data-plane call that changes the session
                self.taken[session_id] = exc

    @property
    def settled(self) -> bool:
        return len(self.taken) == len(self.slots)


class FrozenSessions:
    """The open copy-on-write captures of one host (weakly held: a capture let go is no longer kept up)."""

    def __init__(self) -> None:
        self._open: weakref.WeakSet[Frozen] = weakref.WeakSet()

    def freeze(self, slots: Mapping[str, Any], take: Callable[[str, Any], Any]) -> Frozen:
        """A capture of `slots` (the live sessions now); `take(session_id, slot)` reads one session's state."""
        frozen = Frozen(slots, take)
        self._open.add(frozen)
        return frozen

    def before_change(self, session_id: str, slot: Any) -> None:
        """The session is about to change: every open capture that holds it takes its state first."""
        if self._open:
            for frozen in list(self._open):
                frozen.keep(session_id, slot)

    async def settle(self, frozen: Frozen) -> None:
        """Take the state of every session of `frozen` not changed since the capture; then it is closed."""
        for index, (session_id, slot) in enumerate(frozen.slots.items()):
            frozen.keep(session_id, slot)
            if index % SLICE == SLICE - 1:
                await asyncio.sleep(0)  # sessions changed meanwhile go through `before_change`
        self._open.discard(frozen)

    def __len__(self) -> int:
        return len(self._open)
