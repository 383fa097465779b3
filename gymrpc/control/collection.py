"""No cyclic garbage collection while a process's episodes are parked for a non-stop checkpoint.

A background commit decodes the ids of every episode in flight and captures references to each
one's state; with thousands of episodes, the objects that allocates can set off a full
collection of the process's heap (75-130 ms at 5,000 episodes, measured) while the episodes
wait. A plane holds the collector from the start of such a commit until its checkpoint's
resume (or a failed commit, or the lease's abort), so the collection runs after the resume,
with the episodes running. Holders are counted per process (planes sharing one, as in tests
and benchmarks, share the pause), and the collector is left as it was found.

A resume lets go a little later (`release_after_reply`): the first allocation after the
collector is back collects every young object the pause allocated (10-24 ms at 5,000 episodes,
measured), and inside the Resume RPC that would still be time the controller waits for.
"""

from __future__ import annotations

import asyncio
import gc

AFTER_REPLY = 0.05
"""Seconds from a resume until its holder lets go: its reply, and the controller's resume of the rest
of the stack (several stages), are on their way by then."""

_holders: set[int] = set()
_was_enabled = False
_later: dict[int, tuple[asyncio.TimerHandle, asyncio.Future[None]]] = {}


def hold(holder: object) -> None:
    """Pause the collector until every holder released it (idempotent per holder)."""
    global _was_enabled
    _cancel_later(holder)  # a new commit soon after a resume: the hold goes on
    if not _holders:
        _was_enabled = gc.isenabled()
        gc.disable()
    _holders.add(id(holder))


def release(holder: object) -> None:
    """This holder no longer needs the pause; the last one restores the collector (idempotent)."""
    _cancel_later(holder)
    if id(holder) not in _holders:
        return
    _holders.discard(id(holder))
    if not _holders and _was_enabled:
        gc.enable()


def held() -> bool:
    return bool(_holders)


def release_after_reply(holder: object, delay: float = AFTER_REPLY) -> None:
    """`release` in `delay` seconds (needs the running loop), unless `hold` or `release` comes first."""
    if id(holder) not in _holders:
        return
    _cancel_later(holder)
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def let_go() -> None:
        _later.pop(id(holder), None)
        release(holder)
        if not done.done():
            done.set_result(None)

    _later[id(holder)] = (loop.call_later(delay, let_go), done)


async def released(holder: object) -> None:
    """Wait until a `release_after_reply` of `holder` took effect (at once if none is pending)."""
    if (pending := _later.get(id(holder))) is not None:
        await asyncio.shield(pending[1])


def _cancel_later(holder: object) -> None:
    if (pending := _later.pop(id(holder), None)) is not None:
        timer, done = pending
        timer.cancel()
        if not done.done():
            done.set_result(None)
