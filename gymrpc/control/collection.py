"""No cyclic garbage collection while a process's episodes are parked for a non-stop checkpoint.

A background commit decodes the ids of every episode in flight and captures references to each
one's state; with thousands of episodes, the objects that allocates can set off a full
collection of the process's heap (75-130 ms at 5,000 episodes, measured) while the episodes
wait. A plane holds the collector from the start of such a commit until its checkpoint's
resume (or a failed commit, or the lease's abort), so the collection runs after the resume,
with the episodes running. Holders are counted per process (planes sharing one, as in tests
and benchmarks, share the pause), and the collector is left as it was found.
"""

from __future__ import annotations

import gc

_holders: set[int] = set()
_was_enabled = False


def hold(holder: object) -> None:
    """Pause the collector until every holder released it (idempotent per holder)."""
    global _was_enabled
    if not _holders:
        _was_enabled = gc.isenabled()
        gc.disable()
    _holders.add(id(holder))


def release(holder: object) -> None:
    """This holder no longer needs the pause; the last one restores the collector (idempotent)."""
    if id(holder) not in _holders:
        return
    _holders.discard(id(holder))
    if not _holders and _was_enabled:
        gc.enable()


def held() -> bool:
    return bool(_holders)
