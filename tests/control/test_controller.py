"""`Controller` orders and all-or-nothing restore, over in-process participants (no sockets)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest

from gymrpc.control import ControlPlane, EpisodeKey, Kind, Phase, Scope
from gymrpc.control.types import CALLERS
from gymrpc.controller import Controller, CoordinationError
from gymrpc.errors import FailedPrecondition
from gymrpc.servers.participant import ParticipantServicer
from gymrpc.testing.participants import StubDirectory
from gymrpc.v1 import checkpoint_records_pb2 as rec_pb
from tests.agent.fakes import DirectStub
from tests.control.test_plane import Scripted

E0 = EpisodeKey("r0", 0)


class Logged(Scripted):
    """A scripted participant of any kind that logs the control hooks it runs."""

    def __init__(self, kind: Kind, log: list[tuple[str, str]], name: str) -> None:
        super().__init__()
        self.kind = kind  # type: ignore[misc]
        self.log, self.name = log, name

    async def close_admission(self) -> None:
        self.log.append(("close", self.name))
        await super().close_admission()

    async def open_admission(self) -> None:
        self.log.append(("open", self.name))
        await super().open_admission()

    async def export(self, scope: Scope) -> list[rec_pb.CheckpointRecord]:
        self.log.append(("capture", self.name))
        return [rec_pb.CheckpointRecord(episode_id=E0.to_pb())]

    async def retire(self, episodes: Sequence[EpisodeKey]) -> None:
        self.log.append(("retire", self.name))
        await super().retire(episodes)


class FakeClient(StubDirectory):
    """What `Controller` uses of `gymrpc.Client` (a `Directory`), here in-process, by name."""

    def __init__(self, planes: dict[str, ControlPlane]) -> None:
        super().__init__({name: DirectStub(ParticipantServicer(plane)) for name, plane in planes.items()})


NAMES = {"resources/a": Kind.RESOURCES, "agent/a": Kind.AGENT, "model/a": Kind.MODEL, "env/a": Kind.ENVIRONMENT}


def deployment(log: list[tuple[str, str]]) -> tuple[Controller, dict[str, Logged], dict[str, ControlPlane]]:
    parts = {name: Logged(kind, log, name) for name, kind in NAMES.items()}
    planes = {name: ControlPlane(part, name=name) for name, part in parts.items()}
    controller = Controller(FakeClient(planes), names=sorted(NAMES))
    return controller, parts, planes


def test_prepare_in_order_resume_in_reverse_and_stop_at_the_first_stage_not_ready(tmp_path: Path) -> None:
    async def main() -> None:
        log: list[tuple[str, str]] = []
        controller, parts, _ = deployment(log)
        members = await controller.discover()
        assert [m.kind for m in members] == [Kind.ENVIRONMENT, Kind.MODEL, Kind.AGENT, Kind.RESOURCES]
        result = await controller.checkpoint(tmp_path, episode_ids=[E0], checkpoint_id="c1", nonstop=False)
        assert result.committed
        assert sorted(result.manifests) == sorted(NAMES)
        assert [e for e in log if e[0] != "capture"] == [
            *(("close", n) for n in ("env/a", "model/a", "agent/a", "resources/a")),
            *(("open", n) for n in ("resources/a", "agent/a", "model/a", "env/a")),
        ]
        log.clear()
        parts["agent/a"].block(E0)
        result = await controller.checkpoint(tmp_path, episode_ids=[E0], checkpoint_id="c2", timeout=0.2)
        assert not result.committed
        assert result.prepare.blockers() == {"agent/a": [E0]}
        assert ("close", "resources/a") not in log  # the resources stage was never reached
        assert all(p.admission.is_open for p in parts.values())  # aborted: everyone open again

    asyncio.run(main())


def test_a_nonstop_checkpoint_resumes_each_member_once_it_and_its_callers_captured(tmp_path: Path) -> None:
    """Not all after the slowest capture, nor staged: a member never opens before it and every member
    that calls it captured (`CALLERS`), so no held reply reaches a caller not yet captured."""

    async def main() -> None:
        log: list[tuple[str, str]] = []
        controller, _, _ = deployment(log)
        result = await controller.checkpoint(tmp_path, episode_ids=[E0], checkpoint_id="c1")
        assert result.committed
        assert result.index is not None
        assert log[:4] == [("close", n) for n in ("env/a", "model/a", "agent/a", "resources/a")]
        for name, kind in NAMES.items():
            opened = log.index(("open", name))
            waited_for = [n for n, k in NAMES.items() if k in (kind, *CALLERS[kind])]
            assert all(log.index(("capture", n)) < opened for n in waited_for), (name, log)
        assert sorted(e for e in log if e[0] == "open") == sorted(("open", n) for n in NAMES)

    asyncio.run(main())


def test_restarts_leave_the_commit_scope() -> None:
    async def main() -> None:
        controller, parts, _ = deployment([])
        parts["resources/a"].restarts = {EpisodeKey("r1", 0)}
        result = await controller.prepare("c1", timeout=5)
        assert result.continued([E0, EpisodeKey("r1", 0)]) == [E0]
        await controller.resume("c1")

    asyncio.run(main())


def test_a_failed_restore_retires_the_half_installed_attempts_and_resumes_everyone(tmp_path: Path) -> None:
    async def main() -> None:
        log: list[tuple[str, str]] = []
        source, _, _ = deployment([])
        await source.checkpoint(tmp_path, episode_ids=[E0], checkpoint_id="c1")
        controller, parts, planes = deployment(log)
        parts["model/a"].fail_install = True
        with pytest.raises(CoordinationError) as caught:
            await controller.restore("x1", tmp_path / "c1", [E0])
        assert list(caught.value.failures) == ["model/a"]
        assert all(p.phase is Phase.IDLE for p in (pl.fence for pl in planes.values()))
        assert all(p.admission.is_open for p in parts.values())
        assert all(p.marks.is_retired(E0.next()) for p in parts.values())  # the half-installed attempt is fenced
        retires = [name for op, name in log if op == "retire"]
        assert retires.index("env/a") < retires.index("agent/a") < retires.index("model/a")  # callers first

    asyncio.run(main())


def test_resume_keeps_going_past_failures() -> None:
    async def main() -> None:
        controller, parts, _ = deployment([])
        await controller.prepare("c1", timeout=5)

        async def broken() -> None:
            raise FailedPrecondition("cannot reopen")

        parts["agent/a"].open_admission = broken  # type: ignore[method-assign]
        with pytest.raises(CoordinationError) as caught:
            await controller.resume("c1")
        assert list(caught.value.failures) == ["agent/a"]
        assert parts["model/a"].admission.is_open
        assert parts["env/a"].admission.is_open  # resumed after the failing stage

    asyncio.run(main())


def test_retire_is_refused_while_a_checkpoint_is_open_then_forget_clears() -> None:
    async def main() -> None:
        controller, parts, _ = deployment([])
        await controller.prepare("c1", timeout=5)
        with pytest.raises(CoordinationError) as caught:
            await controller.retire("op1", [E0])
        assert {e.reason for e in caught.value.failures.values()} == {"INVALID_PHASE"}
        await controller.resume("c1")
        await controller.retire("op2", [E0])
        assert all(p.marks.is_retired(E0) for p in parts.values())
        await controller.forget("op3", ["r0"])
        assert not any(p.marks.is_retired(E0) for p in parts.values())

    asyncio.run(main())
