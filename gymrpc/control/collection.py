"""No cyclic garbage collection while a process's episodes are parked for a non-stop checkpoint.

A background commit decodes the ids of every episode in flight and captures references to each
one's state; with thousands of episodes, the objects that allocates can set off a full
collection of the process's heap (75-130 ms at 5,000 episodes, measured) while the episodes
wait. A plane holds the collector from the start of such a commit until its checkpoint's
resume (or a failed commit, or the lease's abort), so the collection runs after the resume,
with the episodes running. Holders are counted per process (planes sharing one, as in tests
and benchmarks, share the pause), and the collector is left as it was found.

A resume lets go once its reply has been sent (`release_after_reply`, told by the RPC's done
callback): the first allocation after the collector is back collects every young object the
pause allocated (10-24 ms at 5,000 episodes, measured, before the captures became
copy-on-write), and inside the Resume RPC that would still be time the controller waits for.
A resume with no reply to send (a lease that ran out) lets go at once.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable

ReplySent = Callable[[Callable[[], None]], None]
"""Registers a function to call once a reply has been sent (`grpc.aio.ServicerContext.add_done_callback`)."""

_holders: set[int] = set()
_was_enabled = False
_later: dict[int, asyncio.Future[None]] = {}


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


def release_after_reply(holder: object, reply_sent: ReplySent | None = None) -> None:
    """`release` once `reply_sent` says the reply is out (needs the running loop), unless `hold` or
    `release` comes first; at once without `reply_sent` (no reply to wait for)."""
    if id(holder) not in _holders:
        return
    _cancel_later(holder)
    if reply_sent is None:
        release(holder)
        return
    done = asyncio.get_running_loop().create_future()

    def let_go() -> None:
        if _later.get(id(holder)) is done:  # not overtaken by a new hold (the next commit)
            del _later[id(holder)]
            release(holder)
            done.set_result(None)

    _later[id(holder)] = done
    reply_sent(let_go)


async def released(holder: object) -> None:
    """Wait until a `release_after_reply` of `holder` took effect (at once if none is pending)."""
    if (pending := _later.get(id(holder))) is not None:
        await asyncio.shield(pending)


def _cancel_later(holder: object) -> None:
    if (done := _later.pop(id(holder), None)) is not None and not done.done():
        done.set_result(None)
