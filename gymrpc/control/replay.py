"""Replay of completed control calls: a retry with the same arguments gets the first reply.

Keyed by (operation, id). The same id with other arguments (another directory, another
scope) is CHECKPOINT_CONFLICT, never a second execution. Replies of a checkpoint are
dropped when it is resumed (its id is fenced from then on); retire and forget replies are
kept for the last `REMEMBERED_OPERATIONS` operation ids.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from gymrpc.control.fencing import Op
from gymrpc.errors import Aborted

REMEMBERED_OPERATIONS = 256
UNFENCED = (Op.RETIRE, Op.FORGET)


def conflict(key: str, what: str) -> Aborted:
    return Aborted(f"id {key!r} {what}", reason="CHECKPOINT_CONFLICT", metadata={"checkpoint_id": key})


class Replies:
    def __init__(self, remembered: int = REMEMBERED_OPERATIONS) -> None:
        self.remembered = remembered
        self._replies: OrderedDict[tuple[Op, str], tuple[tuple[Any, ...], Any]] = OrderedDict()

    def get(self, op: Op, key: str, args: tuple[Any, ...]) -> Any:
        """The first reply of this call, or None if it never completed."""
        hit = self._replies.get((op, key))
        if hit is None:
            return None
        if hit[0] != args:
            raise conflict(key, f"was already used for a {op.value} with other arguments")
        return hit[1]

    def put(self, op: Op, key: str, args: tuple[Any, ...], reply: Any) -> None:
        self._replies[(op, key)] = (args, reply)
        if op in UNFENCED:
            kept = [k for k in self._replies if k[0] in UNFENCED]
            for old in kept[: max(len(kept) - self.remembered, 0)]:
                del self._replies[old]

    def drop(self, key: str) -> None:
        """Forget every reply of checkpoint `key` (it was resumed)."""
        for stale in [k for k in self._replies if k[1] == key and k[0] not in UNFENCED]:
            del self._replies[stale]
