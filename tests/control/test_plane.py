"""`ControlPlane` with a scripted participant: replay, fencing, lease auto-abort, deadlines, restore."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from gymrpc.control import ControlPlane, EpisodeKey, Kind, Participant, Phase, Report, Scope
from gymrpc.control import plane as plane_module
from gymrpc.control import store as store_module
from gymrpc.errors import DataLoss, FailedPrecondition, GymrpcError, ResourceExhausted
from gymrpc.v1 import checkpoint_records_pb2 as rec_pb

E0, E1 = EpisodeKey("r0", 0), EpisodeKey("r1", 0)


class Scripted(Participant):
    """A participant whose blockers, restarts and failures the test sets."""

    kind = Kind.RESOURCES

    def __init__(self) -> None:
        super().__init__()
        self.blockers: set[EpisodeKey] = set()
        self.restarts: set[EpisodeKey] = set()
        self.episodes: list[EpisodeKey] = [E0, E1]
        self.installed: list[EpisodeKey] = []
        self.retired: list[EpisodeKey] = []
        self.exports = 0
        self.fail_install = False
        self.fail_retire = False

    def block(self, *episodes: EpisodeKey) -> None:
        self.blockers = set(episodes)
        self.changed.notify()

    def readiness(self) -> Report:
        return Report(blockers=tuple(sorted(self.blockers)), restarts=tuple(sorted(self.restarts)))

    async def export(self, scope: Scope) -> list[rec_pb.CheckpointRecord]:
        self.exports += 1
        return [
            rec_pb.CheckpointRecord(episode_id=e.to_pb())
            for e in self.episodes
            if (scope is None or e in scope) and e not in self.restarts
        ]

    async def stage(self, records: Sequence[rec_pb.CheckpointRecord], scope: frozenset[EpisodeKey]) -> Any:
        if any(r.episode_id.rollout_id == "corrupt" for r in records):
            raise DataLoss("corrupt record")
        return [EpisodeKey.of(r.episode_id).next() for r in records]

    async def install(self, staged: Any) -> list[EpisodeKey]:
        if self.fail_install:
            raise FailedPrecondition("install failed")
        self.installed = list(staged)
        return self.installed

    async def retire(self, episodes: Sequence[EpisodeKey]) -> None:
        if self.fail_retire:
            raise FailedPrecondition("retire failed")
        self.retired.extend(episodes)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def soon(seconds: float = 5.0) -> float:
    return time.time() + seconds


async def plane(grace: float = 60.0) -> tuple[ControlPlane, Scripted]:
    participant = Scripted()
    control = ControlPlane(participant, name="resources/test", lease_grace=grace)
    control.start()
    return control, participant


def reason(exc: pytest.ExceptionInfo[GymrpcError]) -> str:
    return exc.value.reason


def gated_writes(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Every records write signals `entered`, then waits for `release` (10 s at most) before writing."""
    entered, release = threading.Event(), threading.Event()
    real = store_module.write_checkpoint

    def gated(*args: Any) -> Any:
        entered.set()
        release.wait(10)
        return real(*args)

    monkeypatch.setattr(store_module, "write_checkpoint", gated)
    return entered, release


def test_prepare_commit_resume_and_replay(tmp_path: Path) -> None:
    async def main() -> None:
        control, part = await plane()
        reply = await control.prepare("c1", soon())
        assert reply[0] is Phase.PREPARED
        assert not part.admission.is_open
        assert await control.prepare("c1", soon()) is reply  # a retry gets the first reply
        manifest = await control.commit("c1", soon(), str(tmp_path), None)
        assert manifest.record_count == 2
        assert control.fence.phase is Phase.COMMITTED
        assert await control.commit("c1", soon(), str(tmp_path), None) is manifest
        assert part.exports == 1
        with pytest.raises(GymrpcError) as caught:
            await control.commit("c1", soon(), str(tmp_path / "other"), None)
        assert reason(caught) == "CHECKPOINT_CONFLICT"
        assert await control.resume("c1") is False
        assert part.admission.is_open
        assert control.fence.phase is Phase.IDLE
        assert await control.resume("c1") is True  # already resumed
        with pytest.raises(GymrpcError) as caught:
            await control.prepare("c1", soon())
        assert reason(caught) == "STALE_CHECKPOINT"
        await control.close()

    run(main())


def test_prepare_misses_its_deadline_and_keeps_admission_closed() -> None:
    async def main() -> None:
        control, part = await plane()
        part.block(E0)
        phase, report = await control.prepare("c1", time.time() + 0.2)
        assert phase is Phase.PREPARING
        assert report.blockers == (E0,)
        assert not part.admission.is_open
        with pytest.raises(GymrpcError) as caught:
            await control.commit("c1", soon(), "/tmp/x", None)
        assert reason(caught) == "INVALID_PHASE"
        waiting = asyncio.ensure_future(control.prepare("c1", soon()))
        await asyncio.sleep(0.05)
        part.block()  # the episode parks
        assert (await waiting)[0] is Phase.PREPARED
        await control.close()

    run(main())


def test_resume_during_a_waiting_prepare_aborts_it() -> None:
    async def main() -> None:
        control, part = await plane()
        part.block(E0)
        waiting = asyncio.ensure_future(control.prepare("c1", soon()))
        await asyncio.sleep(0.05)
        assert await control.resume("c1") is False
        with pytest.raises(GymrpcError) as caught:
            await waiting
        assert reason(caught) == "STALE_CHECKPOINT"
        assert part.admission.is_open
        assert control.fence.phase is Phase.IDLE
        await control.close()

    run(main())


def test_fencing_conflicts_and_late_prepares() -> None:
    async def main() -> None:
        control, part = await plane()
        assert await control.resume("aborted-early") is False  # nothing open: only remembered
        with pytest.raises(GymrpcError) as caught:
            await control.prepare("aborted-early", soon())
        assert reason(caught) == "STALE_CHECKPOINT"
        assert part.admission.is_open
        await control.prepare("c1", soon())
        with pytest.raises(GymrpcError) as caught:
            await control.prepare("c2", soon())
        assert reason(caught) == "CHECKPOINT_CONFLICT"
        with pytest.raises(GymrpcError) as caught:
            await control.resume("c2")
        assert reason(caught) == "CHECKPOINT_CONFLICT"
        with pytest.raises(GymrpcError) as caught:
            await control.retire("op", soon(), [E0])
        assert reason(caught) == "INVALID_PHASE"  # refused while a checkpoint is open
        with pytest.raises(GymrpcError) as caught:
            await control.prepare("c3", time.time() - 1)
        assert reason(caught) == "DEADLINE_EXCEEDED"
        await control.close()

    run(main())


def test_commit_refuses_regressed_readiness_and_restarts_in_scope(tmp_path: Path) -> None:
    async def main() -> None:
        control, part = await plane()
        part.restarts = {E1}
        await control.prepare("c1", soon())
        with pytest.raises(GymrpcError) as caught:
            await control.commit("c1", soon(), str(tmp_path), frozenset({E0, E1}))
        assert reason(caught) == "RESTART_IN_SCOPE"
        part.block(E0)  # a held response was delivered after all
        with pytest.raises(GymrpcError) as caught:
            await control.commit("c1", soon(), str(tmp_path), frozenset({E0}))
        assert reason(caught) == "INVALID_PHASE"
        part.block()
        manifest = await control.commit("c1", soon(), str(tmp_path), frozenset({E0}))
        assert [EpisodeKey.of(e) for e in manifest.episode_ids] == [E0]
        await control.close()

    run(main())


def test_lease_auto_aborts_when_the_controller_vanishes(tmp_path: Path) -> None:
    async def main() -> None:
        control, part = await plane(grace=0.3)
        await control.prepare("c1", time.time() + 0.1)
        assert not part.admission.is_open
        started = time.monotonic()
        while control.fence.phase is not Phase.IDLE:
            assert time.monotonic() - started < 5, "the lease never expired"
            await asyncio.sleep(0.02)
        assert part.admission.is_open
        assert "expired" in control.status().details["last_abort"]
        with pytest.raises(GymrpcError) as caught:
            await control.commit("c1", soon(), str(tmp_path), None)
        assert reason(caught) == "STALE_CHECKPOINT"
        # Renewing keeps it open.
        await control.prepare("c2", time.time() + 0.1)
        for _ in range(6):
            await asyncio.sleep(0.1)
            await control.renew("c2", time.time() + 0.1)
        assert control.fence.phase is Phase.PREPARED
        await control.close()

    run(main())


def test_a_shorter_lease_after_a_resume_still_expires_on_time(tmp_path: Path) -> None:
    """Renewals do not wake the lease watcher, so this checks the one case that must: a new
    lease expiring before the time the watcher sleeps until (that of a long, resumed one)."""

    async def main() -> None:
        control, part = await plane(grace=0.3)
        await control.prepare("long", time.time() + 60)
        await asyncio.sleep(0.05)  # the watcher now sleeps for about a minute
        await control.resume("long")
        await control.prepare("short", time.time() + 0.1)
        started = time.monotonic()
        while control.fence.phase is not Phase.IDLE:
            assert time.monotonic() - started < 5, "the short lease never expired"
            await asyncio.sleep(0.02)
        assert "'short' expired" in control.status().details["last_abort"]
        assert part.admission.is_open
        await control.close()

    run(main())


def test_a_slow_write_outlives_its_deadline_and_a_retry_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release, calls = threading.Event(), []
    real = store_module.write_checkpoint

    def slow(*args: Any) -> Any:
        calls.append(args)
        release.wait(10)
        return real(*args)

    monkeypatch.setattr(store_module, "write_checkpoint", slow)

    async def main() -> None:
        control, _ = await plane()
        await control.prepare("c1", soon())
        with pytest.raises(GymrpcError) as caught:
            await control.commit("c1", time.time() + 0.2, str(tmp_path), None)
        assert reason(caught) == "DEADLINE_EXCEEDED"
        retry = asyncio.ensure_future(control.commit("c1", soon(), str(tmp_path), None))
        await asyncio.sleep(0.05)
        release.set()
        assert (await retry).record_count == 2
        assert len(calls) == 1  # exported and written once
        await control.close()

    run(main())


def test_resume_during_a_write_publishes_no_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entered, release = gated_writes(monkeypatch)

    async def main() -> None:
        control, _ = await plane()
        await control.prepare("c1", soon())
        commit = asyncio.ensure_future(control.commit("c1", soon(), str(tmp_path), None))
        await asyncio.to_thread(entered.wait, 10)
        resuming = asyncio.ensure_future(control.resume("c1"))
        await asyncio.sleep(0.05)
        release.set()
        await resuming
        with pytest.raises(GymrpcError) as caught:
            await commit
        assert reason(caught) == "STALE_CHECKPOINT"
        assert not await asyncio.to_thread(lambda: list(tmp_path.glob("**/manifest.json")))
        await control.close()

    run(main())


def test_unfinished_background_writes_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each unfinished background write holds its capture: past the bound a commit is refused, clearly."""
    entered, release = gated_writes(monkeypatch)
    monkeypatch.setattr(plane_module, "MAX_UNFINISHED_CAPTURES", 1)

    async def main() -> None:
        control, _ = await plane()
        await control.prepare("c1", soon())
        assert await control.commit("c1", soon(), str(tmp_path / "c1"), None, background=True) is None
        await control.resume("c1")  # its write starts, and hangs
        await asyncio.to_thread(entered.wait, 10)
        assert control.status().details["persisting"] == "1"
        await control.prepare("c2", soon())
        with pytest.raises(ResourceExhausted) as caught:
            await control.commit("c2", soon(), str(tmp_path / "c2"), None, background=True)
        assert "(c1)" in caught.value.message
        assert caught.value.metadata["unfinished"] == "1"
        release.set()
        assert (await control.persist("c1", soon())).record_count == 2
        assert await control.commit("c2", soon(), str(tmp_path / "c2"), None, background=True) is None
        await control.resume("c2")
        assert (await control.persist("c2", soon())).record_count == 2
        await control.close()

    run(main())


def test_restore_is_all_or_nothing_and_fences_the_old_attempt(tmp_path: Path) -> None:
    async def main() -> None:
        source, _ = await plane()
        await source.prepare("c1", soon())
        await source.commit("c1", soon(), str(tmp_path), None)

        fresh, part = await plane()
        part.fail_install = True
        with pytest.raises(FailedPrecondition, match="install failed"):
            await fresh.restore("r1", soon(), str(tmp_path), [E0, E1])
        assert part.admission.is_open
        assert fresh.fence.phase is Phase.IDLE
        assert not part.installed
        part.fail_install = False
        source_id, restored = await fresh.restore("r1", soon(), str(tmp_path), [E0, E1])
        assert source_id == "c1"
        assert restored == [E0.next(), E1.next()]
        assert fresh.fence.phase is Phase.RESTORED
        assert not part.admission.is_open
        assert await fresh.restore("r1", soon(), str(tmp_path), [E0, E1]) == (source_id, restored)  # replay
        with pytest.raises(GymrpcError) as caught:
            await part.admission.enter(E0)
        assert reason(caught) == "STALE_ATTEMPT"
        await fresh.resume("r1")
        assert part.admission.is_open
        await part.admission.enter(E0.next())  # the new attempt runs
        part.admission.leave(E0.next())
        with pytest.raises(FailedPrecondition, match="fresh"):
            await fresh.restore("r2", soon(), str(tmp_path), [E0])
        for control in (source, fresh):
            await control.close()

    run(main())


def test_restore_of_a_corrupt_or_missing_checkpoint_installs_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        source, part = await plane()
        part.episodes = [E0, EpisodeKey("corrupt", 0)]
        await source.prepare("c1", soon())
        await source.commit("c1", soon(), str(tmp_path), None)
        fresh, target = await plane()
        with pytest.raises(DataLoss):
            await fresh.restore("r1", soon(), str(tmp_path), [E0, EpisodeKey("corrupt", 0)])
        with pytest.raises(GymrpcError) as caught:
            await fresh.restore("r1", soon(), str(tmp_path / "nothing"), [E0])
        assert caught.value.code.name == "NOT_FOUND"
        assert not target.installed
        assert target.admission.is_open
        assert fresh.fence.phase is Phase.IDLE
        for control in (source, fresh):
            await control.close()

    run(main())


def test_retire_marks_first_and_forget_clears() -> None:
    async def main() -> None:
        control, part = await plane()
        part.fail_retire = True
        with pytest.raises(FailedPrecondition):
            await control.retire("op1", soon(), [E0])
        assert part.marks.is_retired(E0)  # the mark outlives the failed retire
        part.fail_retire = False
        assert await control.retire("op2", soon(), [E0]) == [E0]
        assert await control.retire("op2", soon(), [E0]) == [E0]
        assert part.retired == [E0]
        with pytest.raises(GymrpcError) as caught:
            await control.retire("op2", soon(), [E1])
        assert reason(caught) == "CHECKPOINT_CONFLICT"
        assert control.status().retired == {"r0": 0}
        assert await control.forget("op3", ["r0", "r0"]) == ["r0"]
        assert not part.marks.is_retired(E0)
        assert control.status().retired == {}
        await control.close()

    run(main())
