"""The phase machine and checkpoint-id fencing, case by case (pure logic, no I/O)."""

from __future__ import annotations

import pytest

from gymrpc.control.fencing import REMEMBERED_RESUMES, Fence, Op, ResumeOutcome
from gymrpc.control.types import Phase
from gymrpc.errors import GymrpcError

OK = None
# (phase, open id, operation, id) -> reason refused, or OK
TABLE = [
    (Phase.IDLE, None, Op.PREPARE, "c1", OK),
    (Phase.IDLE, None, Op.RESTORE, "c1", OK),
    (Phase.IDLE, None, Op.COMMIT, "c1", "INVALID_PHASE"),
    (Phase.IDLE, None, Op.RENEW, "c1", "INVALID_PHASE"),
    (Phase.IDLE, None, Op.RETIRE, "op", OK),
    (Phase.IDLE, None, Op.FORGET, "op", OK),
    (Phase.PREPARING, "c1", Op.PREPARE, "c1", OK),  # a retry after a missed deadline waits again
    (Phase.PREPARING, "c1", Op.PREPARE, "c2", "CHECKPOINT_CONFLICT"),
    (Phase.PREPARING, "c1", Op.COMMIT, "c1", "INVALID_PHASE"),
    (Phase.PREPARING, "c1", Op.RENEW, "c1", OK),
    (Phase.PREPARING, "c1", Op.RETIRE, "op", "INVALID_PHASE"),
    (Phase.PREPARING, "c1", Op.FORGET, "op", "INVALID_PHASE"),
    (Phase.PREPARED, "c1", Op.COMMIT, "c1", OK),
    (Phase.PREPARED, "c1", Op.COMMIT, "c2", "CHECKPOINT_CONFLICT"),
    (Phase.PREPARED, "c1", Op.RESTORE, "c1", "INVALID_PHASE"),
    (Phase.PREPARED, "c1", Op.RETIRE, "op", "INVALID_PHASE"),
    (Phase.PREPARED, "c1", Op.RENEW, "c2", "CHECKPOINT_CONFLICT"),
    (Phase.COMMITTED, "c1", Op.COMMIT, "c1", "INVALID_PHASE"),  # a replay is answered before this check
    (Phase.COMMITTED, "c1", Op.PREPARE, "c1", "INVALID_PHASE"),
    (Phase.COMMITTED, "c1", Op.RENEW, "c1", OK),
    (Phase.COMMITTED, "c1", Op.RETIRE, "op", "INVALID_PHASE"),
    (Phase.RESTORED, "r1", Op.RETIRE, "op", OK),
    (Phase.RESTORED, "r1", Op.FORGET, "op", OK),
    (Phase.RESTORED, "r1", Op.PREPARE, "c1", "CHECKPOINT_CONFLICT"),
    (Phase.RESTORED, "r1", Op.RESTORE, "r1", "INVALID_PHASE"),
    (Phase.RESTORED, "r1", Op.RENEW, "r1", OK),
]


@pytest.mark.parametrize(("phase", "active", "op", "checkpoint_id", "refused"), TABLE)
def test_phase_and_id_table(phase: Phase, active: str | None, op: Op, checkpoint_id: str, refused: str | None) -> None:
    fence = Fence()
    if active is not None:
        fence.open(active, phase)
    if refused is None:
        fence.check(op, checkpoint_id)
    else:
        with pytest.raises(GymrpcError) as caught:
            fence.check(op, checkpoint_id)
        assert caught.value.reason == refused


def test_resumed_ids_are_stale_for_every_fenced_operation() -> None:
    fence = Fence()
    fence.open("c1", Phase.PREPARING)
    fence.close("c1")
    assert fence.phase is Phase.IDLE
    assert fence.active is None
    for op in (Op.PREPARE, Op.COMMIT, Op.RENEW, Op.RESTORE):
        with pytest.raises(GymrpcError) as caught:
            fence.check(op, "c1")
        assert caught.value.reason == "STALE_CHECKPOINT"
    assert fence.resume_outcome("c1") is ResumeOutcome.ALREADY


def test_resume_outcomes() -> None:
    fence = Fence()
    assert fence.resume_outcome("late") is ResumeOutcome.RECORD_ONLY
    fence.close("late")  # the plane records it: a late prepare of an aborted checkpoint is refused
    with pytest.raises(GymrpcError, match="already resumed"):
        fence.check(Op.PREPARE, "late")
    fence.open("c1", Phase.PREPARED)
    assert fence.resume_outcome("c1") is ResumeOutcome.END
    with pytest.raises(GymrpcError) as caught:
        fence.resume_outcome("c2")
    assert caught.value.reason == "CHECKPOINT_CONFLICT"


def test_abandon_keeps_the_id_usable_and_advance_needs_the_open_id() -> None:
    fence = Fence()
    fence.open("c1", Phase.PREPARING)
    assert not fence.advance("c2", Phase.PREPARED)
    fence.abandon("c1")
    fence.check(Op.PREPARE, "c1")  # not fenced: the failed prepare never took effect


def test_only_the_last_resumed_ids_are_remembered() -> None:
    fence = Fence()
    for i in range(REMEMBERED_RESUMES + 1):
        fence.close(f"c{i}")
    assert not fence.is_resumed("c0")
    assert fence.is_resumed(f"c{REMEMBERED_RESUMES}")
