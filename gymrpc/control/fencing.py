"""The phase machine and checkpoint-id fencing, as pure synchronous logic.

    idle --prepare--> preparing --(ready)--> prepared --commit--> committed
    idle --restore--> restored
    preparing | prepared | committed | restored --resume--> idle   (resume aborts if unpublished)
    retire, forget: only in idle or restored; renew: any phase but idle

An id that was resumed is stale for good (the last `REMEMBERED_RESUMES` are kept), so a
late or duplicated prepare of an aborted checkpoint can never close admission again; an
id other than the open one conflicts. Keeping this apart from the async plane lets a
table test pin every (phase, operation, id) case.
"""

from __future__ import annotations

import enum
from collections import OrderedDict

from gymrpc.control.types import Phase
from gymrpc.errors import Aborted, FailedPrecondition

REMEMBERED_RESUMES = 64


class Op(enum.Enum):
    PREPARE = "prepare"
    RENEW = "renew"
    COMMIT = "commit"
    RESUME = "resume"
    RESTORE = "restore"
    RETIRE = "retire"
    FORGET = "forget"


ALLOWED: dict[Op, frozenset[Phase]] = {
    # PREPARING: a retried prepare after a missed deadline waits again (and renews the lease).
    Op.PREPARE: frozenset({Phase.IDLE, Phase.PREPARING}),
    Op.RENEW: frozenset({Phase.PREPARING, Phase.PREPARED, Phase.COMMITTED, Phase.RESTORED}),
    Op.COMMIT: frozenset({Phase.PREPARED}),
    Op.RESUME: frozenset(Phase),
    Op.RESTORE: frozenset({Phase.IDLE}),
    Op.RETIRE: frozenset({Phase.IDLE, Phase.RESTORED}),
    Op.FORGET: frozenset({Phase.IDLE, Phase.RESTORED}),
}
FENCED: frozenset[Op] = frozenset({Op.PREPARE, Op.RENEW, Op.COMMIT, Op.RESTORE})
"""Operations whose id names the checkpoint; retire and forget carry the caller's own operation id."""


class ResumeOutcome(enum.Enum):
    ALREADY = "already"
    """The id was resumed before: reply at once, change nothing."""
    RECORD_ONLY = "record_only"
    """Nothing is open: remember the id as resumed so a late prepare of it is refused."""
    END = "end"
    """The id is open: abort or finish it and reopen admission."""


class Fence:
    """Phase, open checkpoint id, and the ids already resumed."""

    def __init__(self) -> None:
        self.phase = Phase.IDLE
        self.active: str | None = None
        self._resumed: OrderedDict[str, None] = OrderedDict()

    def is_resumed(self, checkpoint_id: str) -> bool:
        return checkpoint_id in self._resumed

    def check(self, op: Op, checkpoint_id: str) -> None:
        """Raise the error `op` with `checkpoint_id` gets in the current state, if any."""
        if op is Op.RESUME:
            raise ValueError("use resume_outcome() for resume")
        if op in FENCED:
            if checkpoint_id in self._resumed:
                raise FailedPrecondition(
                    f"checkpoint {checkpoint_id!r} was already resumed or aborted; use a new id",
                    reason="STALE_CHECKPOINT",
                    metadata={"checkpoint_id": checkpoint_id},
                )
            if self.active is not None and self.active != checkpoint_id:
                raise Aborted(
                    f"checkpoint {self.active!r} is open; {op.value} of {checkpoint_id!r} conflicts with it "
                    f"(resume {self.active!r} first)",
                    reason="CHECKPOINT_CONFLICT",
                    metadata={"checkpoint_id": checkpoint_id, "active": self.active},
                )
        if self.phase not in ALLOWED[op]:
            hint = f"; checkpoint {self.active!r} is open, resume it first" if self.active else ""
            raise FailedPrecondition(
                f"{op.value} is not allowed in phase {self.phase.name.lower()}{hint}",
                reason="INVALID_PHASE",
                metadata={"phase": self.phase.name, "operation": op.value},
            )

    def resume_outcome(self, checkpoint_id: str) -> ResumeOutcome:
        if checkpoint_id in self._resumed:
            return ResumeOutcome.ALREADY
        if self.active is None:
            return ResumeOutcome.RECORD_ONLY
        if self.active != checkpoint_id:
            raise Aborted(
                f"checkpoint {self.active!r} is open; resume of {checkpoint_id!r} conflicts with it",
                reason="CHECKPOINT_CONFLICT",
                metadata={"checkpoint_id": checkpoint_id, "active": self.active},
            )
        return ResumeOutcome.END

    def open(self, checkpoint_id: str, phase: Phase) -> None:
        """Enter `phase` (preparing or restored) with `checkpoint_id` open."""
        self.active, self.phase = checkpoint_id, phase

    def advance(self, checkpoint_id: str, phase: Phase) -> bool:
        """Move the open checkpoint to `phase`; False (and no change) if it is no longer open."""
        if self.active != checkpoint_id:
            return False
        self.phase = phase
        return True

    def close(self, checkpoint_id: str) -> None:
        """Remember `checkpoint_id` as resumed and go idle (if it was the open one)."""
        self._resumed[checkpoint_id] = None
        self._resumed.move_to_end(checkpoint_id)
        while len(self._resumed) > REMEMBERED_RESUMES:
            self._resumed.popitem(last=False)
        if self.active == checkpoint_id:
            self.active, self.phase = None, Phase.IDLE

    def abandon(self, checkpoint_id: str) -> None:
        """Go idle without fencing the id (a prepare or restore that failed before taking effect)."""
        if self.active == checkpoint_id:
            self.active, self.phase = None, Phase.IDLE
