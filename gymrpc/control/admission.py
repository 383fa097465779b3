"""The data-plane gate a participant puts in front of its work.

Prepare closes it: new calls wait for resume (their own gRPC deadline bounds the wait),
or are refused with UNAVAILABLE `ADMISSION_CLOSED` where waiting is wrong (the caller
asked not to wait, or a `stop` commit means no resume will come to this process; a
`gymrpc.Client` then retries against the replacement). It counts admitted calls per
episode so readiness is "nothing in flight", and wakes whoever waits on a change.
Retired attempts are refused at the gate, before and after any wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections import Counter
from collections.abc import Iterable

from gymrpc.control.marks import RetiredAttempts
from gymrpc.control.types import EpisodeKey
from gymrpc.errors import Unavailable


class WhenClosed(enum.Enum):
    """What a call does when it arrives while admission is closed."""

    WAIT = "wait"
    """Wait for resume (most calls)."""
    PASS = "pass"
    """Run anyway: work that is safe to replay or that the checkpoint does not capture."""
    REFUSE = "refuse"
    """Fail at once with ADMISSION_CLOSED."""


class Notifier:
    """Wakes every waiter on the next `notify`; waiters re-check their condition."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._waiting = 0

    def notify(self) -> None:
        """Wake the current waiters; free when nobody waits (every data-plane call notifies)."""
        if self._waiting:
            event, self._event, self._waiting = self._event, asyncio.Event(), 0
            event.set()

    async def wait(self, timeout: float | None) -> None:
        """Return on the next change or after `timeout` seconds, whichever is first."""
        event = self._event
        self._waiting += 1
        try:
            # Not asyncio.wait_for: on 3.11 it can swallow a cancellation that races the wake-up.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await event.wait()
        finally:
            if self._event is event:  # still waiting on it (timed out or cancelled): not woken
                self._waiting -= 1


class Admission:
    def __init__(self, marks: RetiredAttempts, changed: Notifier) -> None:
        self.marks = marks
        self.changed = changed
        self._open = asyncio.Event()
        self._open.set()
        self._stopping = False
        self._state = Notifier()
        """Wakes calls waiting for admission: only open and stop, not every finished call."""
        self._in_flight: Counter[EpisodeKey] = Counter()
        self.admitted_total = 0
        """Calls admitted since start; a process that admitted any is not fresh."""

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def close(self) -> None:
        self._open.clear()
        self._state.notify()
        self.changed.notify()

    def open(self) -> None:
        self._stopping = False
        self._open.set()
        self._state.notify()
        self.changed.notify()

    def stop(self) -> None:
        """No resume will come (the stack is stopping): waiting calls and new ones are refused."""
        self._stopping = True
        self._open.clear()
        self._state.notify()
        self.changed.notify()

    async def wait_open(self, what: str = "the call") -> None:
        """Wait until admission reopens; refuse at once when waiting is pointless."""
        while not self._open.is_set():
            if self._stopping:
                raise self.refusal(what)
            await self._state.wait(None)

    def refusal(self, what: str) -> Unavailable:
        why = "the server is stopping after a checkpoint" if self._stopping else "a checkpoint is being taken"
        return Unavailable(
            f"admission is closed: {why}; {what} was not started (retry later, or against the restarted server)",
            reason="ADMISSION_CLOSED",
        )

    async def enter(self, episode: EpisodeKey, *, closed: WhenClosed = WhenClosed.WAIT, blocks: bool = True) -> None:
        """Admit one call of `episode`; pair with `leave` when `blocks` (counted as in flight)."""
        self.marks.check(episode)
        if not self._open.is_set() and closed is not WhenClosed.PASS:
            if closed is WhenClosed.REFUSE:
                raise self.refusal("the call")
            await self.wait_open()
            self.marks.check(episode)  # retired while it waited
        self.admitted_total += 1
        if blocks:
            self._in_flight[episode] += 1

    def leave(self, episode: EpisodeKey) -> None:
        left = self._in_flight[episode] - 1
        if left > 0:
            self._in_flight[episode] = left
        else:
            del self._in_flight[episode]
        self.changed.notify()

    def in_flight(self) -> list[EpisodeKey]:
        return list(self._in_flight)

    def count(self, episode: EpisodeKey) -> int:
        return self._in_flight.get(episode, 0)

    async def drained(self, episodes: Iterable[EpisodeKey]) -> None:
        """Wait until no call of `episodes` is in flight."""
        wanted = set(episodes)
        while any(self._in_flight.get(e) for e in wanted):
            await self.changed.wait(1.0)
