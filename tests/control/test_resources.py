"""The resources participant in-process: admission, readiness, many sessions exported and restored, modes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest

from gymrpc.control import ControlPlane, EpisodeKey, Phase
from gymrpc.control import store as store_module
from gymrpc.envkit import CheckpointMode, Environment, Session, TaskSpec, ToolResult, ToolSpec, VerifyResult
from gymrpc.envs.blackjack import BlackjackEnvironment
from gymrpc.envs.counter import CounterEnvironment
from gymrpc.errors import AlreadyExists, DataLoss, FailedPrecondition, GymrpcError
from gymrpc.servers.resources.participant import ResourcesParticipant, _reply, gate_servicer
from gymrpc.servers.resources.service import ResourcesServicer
from gymrpc.v1 import checkpoint_records_pb2 as rec_pb
from gymrpc.v1 import common_pb2
from gymrpc.v1 import resources_service_pb2 as pb
from tests.agent.fakes import blackjack_tasks, counter_task


def soon() -> float:
    return time.time() + 5


class Server:
    """A resources servicer with its participant and control plane, called without sockets."""

    def __init__(self, environment: Environment, verify: str = "wait", name: str = "resources/test") -> None:
        self.servicer = ResourcesServicer(environment, workers=2)
        self.participant = ResourcesParticipant(self.servicer, verify=verify)
        gate_servicer(self.servicer, self.participant)
        self.plane = ControlPlane(self.participant, name=name)
        self.plane.start()

    async def seed(self, rollout: str, task: common_pb2.Task, attempt: int = 0) -> str:
        sid = f"{rollout}-s"
        await self.servicer.SeedSession(
            pb.SeedSessionRequest(session_id=sid, episode_id=ep(rollout, attempt), task=task), None
        )
        return sid

    async def add(self, rollout: str, count: int, attempt: int = 0, call_id: str = "") -> str:
        call = common_pb2.ToolCall(id=call_id, name="increment_counter", arguments_json=json.dumps({"count": count}))
        reply = await self.servicer.CallTool(
            pb.CallToolRequest(session_id=f"{rollout}-s", episode_id=ep(rollout, attempt), call=call), None
        )
        return reply.output

    async def value(self, rollout: str, attempt: int = 0) -> int:
        call = common_pb2.ToolCall(id="", name="get_counter_value", arguments_json="{}")
        reply = await self.servicer.CallTool(
            pb.CallToolRequest(session_id=f"{rollout}-s", episode_id=ep(rollout, attempt), call=call), None
        )
        return json.loads(reply.output)["count"]

    async def verify(self, rollout: str, attempt: int = 0) -> float:
        request = pb.VerifyRequest(session_id=f"{rollout}-s", episode_id=ep(rollout, attempt))
        return (await self.servicer.Verify(request, None)).reward

    async def checkpoint(self, root: Path, checkpoint_id: str = "c1", scope: Any = None) -> Any:
        phase, report = await self.plane.prepare(checkpoint_id, soon())
        assert phase is Phase.PREPARED, report
        return await self.plane.commit(checkpoint_id, soon(), str(root), scope)

    async def close(self) -> None:
        await self.plane.close()
        self.servicer.host.shutdown()


def ep(rollout: str, attempt: int = 0) -> common_pb2.EpisodeId:
    return common_pb2.EpisodeId(rollout_id=rollout, attempt=attempt)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def reason(caught: pytest.ExceptionInfo[GymrpcError]) -> str:
    return caught.value.reason


def test_calls_wait_while_prepared_and_in_flight_calls_block(tmp_path: Path) -> None:
    async def main() -> None:
        server = Server(CounterEnvironment())
        await server.seed("r0", counter_task("t", 0, 3))
        slot = server.servicer.host.live()["r0-s"]
        await slot.lock.acquire()  # the next call is "in flight" until released
        in_flight = asyncio.ensure_future(server.add("r0", 1))
        await asyncio.sleep(0.02)
        phase, report = await server.plane.prepare("c1", time.time() + 0.2)
        assert phase is Phase.PREPARING
        assert report.blockers == (EpisodeKey("r0", 0),)
        late = asyncio.ensure_future(server.add("r0", 2))  # admitted after prepare: waits for resume
        slot.lock.release()
        await in_flight
        assert (await server.plane.prepare("c1", soon()))[0] is Phase.PREPARED
        await asyncio.sleep(0.05)
        assert not late.done()
        manifest = await server.plane.commit("c1", soon(), str(tmp_path), None)
        await server.plane.resume("c1")
        await late
        assert await server.value("r0") == 3
        _, records = store_module.read_checkpoint(tmp_path, server.participant.kind, "resources/test")
        snapshot = json.loads(records[0].resources_session.snapshot.payload)
        assert manifest.record_count == 1
        assert snapshot["count"] == 1
        await server.close()

    run(main())


def test_many_sessions_restore_as_the_next_attempt_and_continue_exactly(tmp_path: Path) -> None:
    async def play(server: Server, attempt: int, ids: list[str]) -> list[Any]:
        out = []
        for rollout in ids:
            await server.add(rollout, 10, attempt, call_id="c9")
            out.append((await server.value(rollout, attempt), await server.verify(rollout, attempt)))
        return out

    async def main() -> None:
        ids = [f"r{i}" for i in range(20)]
        first = Server(CounterEnvironment())
        for i, rollout in enumerate(ids):
            await first.seed(rollout, counter_task("t", i, i + 11))
            await first.add(rollout, 1, call_id="c0")
        scope = frozenset(EpisodeKey(r, 0) for r in ids[:15])
        manifest = await first.checkpoint(tmp_path, scope=scope)
        assert manifest.record_count == 15
        await first.plane.resume("c1")
        expected = await play(first, 0, ids[:15])

        fresh = Server(CounterEnvironment())
        _, restored = await fresh.plane.restore("x1", soon(), str(tmp_path), sorted(scope))
        assert restored == sorted(e.next() for e in scope)
        await fresh.plane.resume("x1")
        assert await play(fresh, 1, ids[:15]) == expected
        assert await fresh.add("r0", 1, attempt=1, call_id="c0") == '{"success": true}'  # cached reply, not rerun
        assert await fresh.value("r0", 1) == 0 + 1 + 10
        with pytest.raises(GymrpcError) as caught:
            await fresh.value("r1", 0)
        assert reason(caught) == "STALE_ATTEMPT"
        with pytest.raises(GymrpcError) as caught:
            await fresh.plane.restore("x2", soon(), str(tmp_path), sorted(scope))
        assert "fresh" in caught.value.message
        for server in (first, fresh):
            await server.close()

    run(main())


def test_blackjack_restores_its_deck(tmp_path: Path) -> None:
    async def turn(server: Server, rollout: str, attempt: int, turn: str) -> Any:
        message = common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, content="<action>hit</action>")
        request = pb.StepRequest(
            session_id=f"{rollout}-s", episode_id=ep(rollout, attempt), turn_id=turn, message=message
        )
        return await server.servicer.Step(request, None)

    async def main() -> None:
        first = Server(BlackjackEnvironment())
        tasks = blackjack_tasks(seed=7)[:3]
        for i, task in enumerate(tasks):
            await first.seed(f"b{i}", task)
        await first.checkpoint(tmp_path)
        await first.plane.resume("c1")
        expected = [await turn(first, f"b{i}", 0, "t1") for i in range(3)]
        fresh = Server(BlackjackEnvironment())
        await fresh.plane.restore("x1", soon(), str(tmp_path), [EpisodeKey(f"b{i}", 0) for i in range(3)])
        await fresh.plane.resume("x1")
        assert [await turn(fresh, f"b{i}", 1, "t1") for i in range(3)] == expected
        for server in (first, fresh):
            await server.close()

    run(main())


async def refused(call: Any, error: type[GymrpcError], why: str) -> GymrpcError:
    """The error `call` raises, checked to be an `error` with reason `why`."""
    with pytest.raises(error) as caught:
        await call
    assert caught.value.reason == why
    return caught.value


def test_a_known_call_id_asking_another_call_is_refused_also_after_a_restore(tmp_path: Path) -> None:
    def reused(call: Any) -> Any:
        return refused(call, AlreadyExists, "REQUEST_ID_REUSED")

    async def main() -> None:
        first = Server(CounterEnvironment())
        await first.seed("r0", counter_task("t", 0, 3))
        assert await first.add("r0", 1, call_id="c0") == '{"success": true}'
        assert await first.add("r0", 1, call_id="c0") == '{"success": true}'  # a retry: its first result
        error = await reused(first.add("r0", 2, call_id="c0"))
        assert error.metadata == {"session_id": "r0-s", "id": "c0"}
        assert "nothing was run" in error.message
        assert await first.value("r0") == 1
        await first.checkpoint(tmp_path)  # the record keeps what each cached call asked
        await first.plane.resume("c1")
        fresh = Server(CounterEnvironment())
        await fresh.plane.restore("x1", soon(), str(tmp_path), [EpisodeKey("r0", 0)])
        await fresh.plane.resume("x1")
        assert await fresh.add("r0", 1, attempt=1, call_id="c0") == '{"success": true}'
        await reused(fresh.add("r0", 2, attempt=1, call_id="c0"))
        assert await fresh.value("r0", 1) == 1
        # A reply restored from a record written before digests were kept answers any retry of its id.
        slot = fresh.servicer.host.live()["r0-s"]
        slot.results["call:old"] = _reply(rec_pb.CachedToolReply(key="call:old", output="kept"))
        assert await fresh.add("r0", 5, attempt=1, call_id="old") == "kept"
        for server in (first, fresh):
            await server.close()

    run(main())


def test_a_retried_run_must_repeat_the_calls_that_changed_its_session_before_any_other() -> None:
    def diverged(call: Any) -> Any:
        return refused(call, FailedPrecondition, "REPLAY_DIVERGENCE")

    async def main() -> None:
        server = Server(CounterEnvironment())
        task = counter_task("t", 0, 3)
        await server.seed("r0", task)
        await server.seed("r0", task)  # a retried seed before anything changed: no replay
        assert await server.add("r0", 1, call_id="c0") == '{"success": true}'
        await server.add("r0", 2, call_id="c1")
        await server.seed("r0", task)  # a retried run: the session changed since its seed
        error = await diverged(server.add("r0", 5, call_id="c9"))
        assert error.metadata == {"session_id": "r0-s", "id": "c9", "unrepeated": "2"}
        assert "c0, c1" in error.message
        assert "asked for its reward" in (await diverged(server.verify("r0"))).message
        await diverged(server.add("r0", 7, call_id="c1"))  # a recorded id asking something else
        assert await server.add("r0", 1, call_id="c0") == '{"success": true}'  # repeated: its first result
        error = await diverged(server.add("r0", 5, call_id="c9"))
        assert error.metadata["unrepeated"] == "1"
        await server.add("r0", 2, call_id="c1")
        await server.add("r0", 5, call_id="c9")  # every recorded call repeated: the run goes on live
        assert await server.value("r0") == 1 + 2 + 5
        assert await server.verify("r0") == 0.0
        await server.close()

    run(main())


def test_a_known_turn_id_with_other_text_is_refused() -> None:
    async def turn(server: Server, text: str) -> pb.StepResponse:
        message = common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, content=f"<action>{text}</action>")
        request = pb.StepRequest(session_id="b0-s", episode_id=ep("b0"), turn_id="t1", message=message)
        return await server.servicer.Step(request, None)

    async def main() -> None:
        server = Server(BlackjackEnvironment())
        await server.seed("b0", blackjack_tasks(seed=7)[0])
        first = await turn(server, "stand")
        assert await turn(server, "stand") == first
        error = await refused(turn(server, "hit"), AlreadyExists, "REQUEST_ID_REUSED")
        assert "other text" in error.message
        await server.close()

    run(main())


def test_a_corrupt_session_installs_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        first = Server(CounterEnvironment())
        for rollout in ("r0", "r1"):
            await first.seed(rollout, counter_task("t", 0, 1))
        await first.checkpoint(tmp_path)
        _manifest, records = store_module.read_checkpoint(tmp_path, first.participant.kind, "resources/test")
        records[1].resources_session.snapshot.payload = b'{"count": "x"}'
        records[1].resources_session.snapshot.sha256 = __import__("hashlib").sha256(b'{"count": "x"}').hexdigest()
        other = tmp_path / "tampered"
        store_module.write_checkpoint(
            other, first.participant.kind, "resources/test", "c9", records, store_module.WriteStop()
        )
        fresh = Server(CounterEnvironment())
        with pytest.raises(DataLoss, match="does not decode"):
            await fresh.plane.restore("x1", soon(), str(other), [EpisodeKey("r0", 0), EpisodeKey("r1", 0)])
        assert fresh.servicer.host.live() == {}
        assert fresh.participant.admission.is_open
        assert fresh.plane.fence.phase is Phase.IDLE
        for server in (first, fresh):
            await server.close()

    run(main())


class Stateless(Environment):
    name = "stateless"
    checkpoint_mode = CheckpointMode.STATELESS
    seeds: ClassVar[list[str]] = []

    class _Session(Session):
        def call_tool(self, name: str, arguments: Mapping[str, Any]) -> ToolResult:
            return ToolResult("pong")

        def verify(self, messages: Sequence[Mapping[str, Any]]) -> VerifyResult:
            return VerifyResult(1.0)

    def tools(self) -> Sequence[ToolSpec]:
        return (ToolSpec("ping", "", {"type": "object", "properties": {}}),)

    def seed(self, task: TaskSpec) -> tuple[Session, Sequence[str]]:
        self.seeds.append(task.task_id)
        return self._Session(), ()


class RestartOnly(Stateless):
    name = "restart"
    checkpoint_mode = CheckpointMode.RESTART_ONLY


def test_stateless_sessions_are_seeded_again(tmp_path: Path) -> None:
    async def main() -> None:
        first = Server(Stateless())
        await first.seed("s0", counter_task("t", 0, 1, task_id="task-s0"))
        await first.checkpoint(tmp_path)
        Stateless.seeds.clear()
        fresh = Server(Stateless())
        await fresh.plane.restore("x1", soon(), str(tmp_path), [EpisodeKey("s0", 0)])
        await fresh.plane.resume("x1")
        assert Stateless.seeds == ["task-s0"]
        call = common_pb2.ToolCall(name="ping", arguments_json="{}")
        reply = await fresh.servicer.CallTool(
            pb.CallToolRequest(session_id="s0-s", episode_id=ep("s0", 1), call=call), None
        )
        assert reply.output == "pong"
        for server in (first, fresh):
            await server.close()

    run(main())


def test_restart_only_reports_restarts_and_never_blocks(tmp_path: Path) -> None:
    async def main() -> None:
        server = Server(RestartOnly())
        await server.seed("q0", counter_task("t", 0, 1))
        phase, report = await server.plane.prepare("c1", soon())
        assert phase is Phase.PREPARED
        assert report.restarts == (EpisodeKey("q0", 0),)
        call = common_pb2.ToolCall(name="ping", arguments_json="{}")
        request = pb.CallToolRequest(session_id="q0-s", episode_id=ep("q0"), call=call)
        assert (await server.servicer.CallTool(request, None)).output == "pong"  # does not wait
        seeding = asyncio.ensure_future(server.seed("q1", counter_task("t", 0, 1)))
        await asyncio.sleep(0.05)
        assert not seeding.done()  # seeds wait
        with pytest.raises(GymrpcError) as caught:
            await server.plane.commit("c1", soon(), str(tmp_path), frozenset({EpisodeKey("q0", 0)}))
        assert reason(caught) == "RESTART_IN_SCOPE"
        assert (await server.plane.commit("c1", soon(), str(tmp_path), None)).record_count == 0
        await server.plane.resume("c1")
        await seeding
        await server.close()

    run(main())


class Flaky(Stateless):
    """Its verify raises while `failing` holds the session's task id."""

    name = "flaky"
    failing: ClassVar[set[str]] = set()

    class _Flaky(Stateless._Session):
        def __init__(self, task_id: str) -> None:
            self.task_id = task_id

        def verify(self, messages: Sequence[Mapping[str, Any]]) -> VerifyResult:
            if self.task_id in Flaky.failing:
                raise RuntimeError("reward function crashed")
            return VerifyResult(1.0)

    def seed(self, task: TaskSpec) -> tuple[Session, Sequence[str]]:
        return self._Flaky(task.task_id), ()


def test_verify_failed_counts_the_sessions_whose_last_verify_raised(tmp_path: Path) -> None:
    """Readiness checks only the sessions whose verify raised, not every session; the count stays exact."""

    async def main() -> None:
        server = Server(Flaky())
        for rollout in ("a", "b", "c"):
            await server.seed(rollout, counter_task("t", 0, 1, task_id=rollout))

        def failed() -> int:
            return server.participant.readiness().counts["verify_failed"]

        Flaky.failing.update({"a", "b"})
        for rollout in ("a", "b", "c"):
            with contextlib.suppress(GymrpcError, RuntimeError):
                await server.verify(rollout)
        assert failed() == 2
        with pytest.raises(GymrpcError):  # refused before it ran (a stale attempt): a's flag is unchanged
            await server.verify("a", attempt=5)
        assert failed() == 2
        Flaky.failing.discard("a")
        await server.verify("a")
        assert failed() == 1
        await server.servicer.CloseSession(pb.CloseSessionRequest(session_id="b-s", episode_id=ep("b")), None)
        assert failed() == 0
        await server.close()

    run(main())


@pytest.mark.parametrize("verify", ["wait", "replay"])
def test_checkpoint_verify_modes(tmp_path: Path, verify: str) -> None:
    async def main() -> None:
        server = Server(CounterEnvironment(), verify=verify)
        assert (await server.servicer.ListTools(pb.ListToolsRequest(), None)).checkpoint_verify == (
            pb.CHECKPOINT_VERIFY_WAIT if verify == "wait" else pb.CHECKPOINT_VERIFY_REPLAY
        )
        await server.seed("r0", counter_task("t", 0, 0))
        await server.plane.prepare("c1", soon())
        verifying = asyncio.ensure_future(server.verify("r0"))
        await asyncio.sleep(0.05)
        assert verifying.done() is (verify == "replay")
        await server.plane.resume("c1")
        assert await verifying == 1.0
        await server.close()

    run(main())


def test_retire_frees_sessions_and_fences_the_attempt_until_forget(tmp_path: Path) -> None:
    async def main() -> None:
        server = Server(CounterEnvironment())
        await server.seed("r0", counter_task("t", 0, 1))
        await server.seed("r1", counter_task("t", 0, 1))
        await server.plane.retire("op1", soon(), [EpisodeKey("r0", 0)])
        assert set(server.servicer.host.live()) == {"r1-s"}
        with pytest.raises(GymrpcError) as caught:
            await server.add("r0", 1)
        assert reason(caught) == "STALE_ATTEMPT"
        assert (await server.checkpoint(tmp_path)).record_count == 1
        await server.plane.resume("c1")
        await server.plane.forget("op2", ["r0"])
        with pytest.raises(GymrpcError) as caught:
            await server.add("r0", 1)
        assert reason(caught) == "SESSION_CLOSED"  # no longer fenced, but the session is gone
        await server.close()

    run(main())


def test_restored_sessions_outside_the_next_commit_scope_are_deleted(tmp_path: Path) -> None:
    async def main() -> None:
        first = Server(CounterEnvironment())
        for rollout in ("r0", "r1"):
            await first.seed(rollout, counter_task("t", 0, 1))
        await first.checkpoint(tmp_path / "one")
        fresh = Server(CounterEnvironment())
        await fresh.plane.restore("x1", soon(), str(tmp_path / "one"), [EpisodeKey("r0", 0), EpisodeKey("r1", 0)])
        await fresh.plane.resume("x1")
        manifest = await fresh.checkpoint(tmp_path / "two", "c2", scope=frozenset({EpisodeKey("r0", 1)}))
        assert [EpisodeKey.of(e) for e in manifest.episode_ids] == [EpisodeKey("r0", 1)]
        assert set(fresh.servicer.host.live()) == {"r0-s"}  # r1 was never re-dispatched: freed
        for server in (first, fresh):
            await server.close()

    run(main())
