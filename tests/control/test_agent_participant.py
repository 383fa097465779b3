"""The agent participant in-process: park at boundaries, export, restore as N+1, retire, parked time."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gymrpc.control import ControlPlane, EpisodeKey, Kind, Phase
from gymrpc.control import store as store_module
from gymrpc.envs.counter import CounterEnvironment
from gymrpc.errors import DataLoss, GymrpcError
from gymrpc.pbtime import seconds
from gymrpc.servers.agent.participant import AgentParticipant
from gymrpc.servers.agent.service import AgentConfig, AgentServicer
from gymrpc.servers.resources.participant import ResourcesParticipant, gate_servicer
from gymrpc.servers.resources.service import ResourcesServicer
from gymrpc.store import EpisodeCheckpoint
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import checkpoint_records_pb2 as rec_pb
from gymrpc.v1 import common_pb2
from gymrpc.v1 import model_service_pb2 as model_pb
from tests.agent.fakes import DirectStub, counter_task, reply

TASK = counter_task("count to three", 0, 3)


def soon() -> float:
    return time.time() + 5


async def until(predicate: Callable[[], bool]) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")


class GatedModel:
    """Replies by step (`…/step<n>` request ids): a tool call for `tool_steps` steps, then an answer.

    `gate` cleared: calls wait, as behind a model that holds them.
    """

    def __init__(self, tool_steps: int = 2) -> None:
        self.tool_steps = tool_steps
        self.gate = asyncio.Event()
        self.gate.set()
        self.calls: list[str] = []

    async def Generate(self, request: model_pb.GenerateRequest, *, timeout: float | None = None) -> Any:
        self.calls.append(request.request_id)
        await self.gate.wait()
        step = int(request.request_id.rpartition("step")[2])
        if step < self.tool_steps:
            return reply(calls=[("", "increment_counter", json.dumps({"count": step + 1}))])
        return reply("done")


class SlowTools(DirectStub):
    """The resources servicer, with `CallTool` taking `delay` seconds."""

    def __init__(self, servicer: Any, delay: float = 0.0) -> None:
        super().__init__(servicer)
        self.delay = delay

    def __getattr__(self, method: str) -> Any:
        call = super().__getattr__(method)
        if method != "CallTool":
            return call

        async def slow(request: Any, *, timeout: float | None = None) -> Any:
            await asyncio.sleep(self.delay)
            return await call(request, timeout=timeout)

        return slow


class Stack:
    """Resources (with its participant) and an agent (with its), called without sockets."""

    def __init__(self, model: GatedModel, *, tool_delay: float = 0.0, episode_timeout: float = 60.0) -> None:
        self.resources = ResourcesServicer(CounterEnvironment(), workers=2)
        self.res_participant = ResourcesParticipant(self.resources)
        gate_servicer(self.resources, self.res_participant)
        self.participant = AgentParticipant()
        self.model = model
        config = AgentConfig(resources_name="resources/counter", episode_timeout=episode_timeout)
        self.tools = SlowTools(self.resources, tool_delay)
        self.agent = AgentServicer(config, self.tools, model, participant=self.participant)
        self.planes = [ControlPlane(self.participant, name="agent/c"), ControlPlane(self.res_participant, name="r/c")]
        for plane in self.planes:
            plane.start()

    async def run(self, rollout: str, attempt: int = 0, task: common_pb2.Task | None = None) -> agent_pb.Trajectory:
        request = agent_pb.RunRequest(
            task=task or TASK, episode_id=common_pb2.EpisodeId(rollout_id=rollout, attempt=attempt)
        )
        return (await self.agent.Run(request, None)).trajectory

    async def prepare(self, cid: str) -> list[tuple[Phase, Any]]:
        return [await plane.prepare(cid, soon()) for plane in self.planes]  # agent before resources

    async def commit(self, cid: str, root: Path, scope: Any) -> None:
        for plane in self.planes:
            await plane.commit(cid, soon(), str(root), scope)

    async def resume(self, cid: str) -> None:
        for plane in reversed(self.planes):
            await plane.resume(cid)

    async def restore(self, cid: str, folder: Path, scope: list[EpisodeKey]) -> list[list[EpisodeKey]]:
        return [(await plane.restore(cid, soon(), str(folder), scope))[1] for plane in self.planes]

    async def close(self) -> None:
        await asyncio.gather(*self.agent.loop._cleanups, return_exceptions=True)
        for plane in self.planes:
            await plane.close()
        self.resources.host.shutdown()


def agent_records(folder: Path) -> list[rec_pb.CheckpointRecord]:
    return store_module.read_checkpoint(folder, Kind.AGENT, "agent/c")[1]


async def checkpoint_mid_episode(tmp_path: Path) -> tuple[agent_pb.Trajectory, Path, EpisodeCheckpoint, int]:
    """An uninterrupted run's trajectory, and episode `ep` checkpointed at its step-1 boundary, then killed.

    Returns (reference trajectory, checkpoint folder, the agent's record, model calls made before the kill).
    """
    reference = Stack(GatedModel())
    expected = await reference.run("ref")
    await reference.close()

    first = Stack(GatedModel(), tool_delay=0.2)
    running = asyncio.ensure_future(first.run("ep"))
    live = first.participant._live
    await until(lambda: bool(live) and live[EpisodeKey("ep", 0)].state.step >= 1)
    # The episode is in a slow tool call: it blocks until the call returns, then parks before Generate.
    (phase, report), _ = await first.prepare("c1")
    assert phase is Phase.PREPARED, report
    assert first.participant.readiness().counts["parked"] == 1
    folder = tmp_path / "c1"
    await first.commit("c1", folder, frozenset({EpisodeKey("ep", 0)}))
    [record] = agent_records(folder)
    body = EpisodeCheckpoint()
    assert record.other.Unpack(body)
    assert body.phase == agent_pb.EPISODE_PHASE_READY_FOR_MODEL
    assert (body.step, len(body.tool_calls), body.episode_id.attempt) == (1, 1, 0)
    calls_before = len(first.model.calls)
    running.cancel()  # the process dies
    await asyncio.gather(running, return_exceptions=True)
    await first.resume("c1")  # lets the cancelled episode's session close
    await first.close()
    return expected, folder, body, calls_before


def test_episodes_park_export_and_continue_as_the_next_attempt_from_their_boundary(tmp_path: Path) -> None:
    async def main() -> None:
        expected, folder, body, calls_before = await checkpoint_mid_episode(tmp_path)
        second = Stack(GatedModel())
        restored = await second.restore("r1", folder, [EpisodeKey("ep", 0)])
        assert restored == [[EpisodeKey("ep", 1)], [EpisodeKey("ep", 1)]]
        await second.resume("r1")
        with pytest.raises(GymrpcError) as caught:
            await second.run("ep", 0)
        assert caught.value.reason == "STALE_ATTEMPT"
        with pytest.raises(GymrpcError) as caught:
            await second.run("ep", 1, task=counter_task("count to nine", 0, 9))
        assert caught.value.reason == "FINGERPRINT_MISMATCH"
        trajectory = await second.run("ep", 1)
        assert trajectory.resume_count == 1
        assert trajectory.reward == expected.reward
        assert len(trajectory.model_calls) == len(expected.model_calls)
        assert len(trajectory.tool_calls) == len(expected.tool_calls)
        assert len(second.model.calls) == len(expected.model_calls) - body.step  # no step was made twice
        assert calls_before == body.step
        assert seconds(trajectory.timing.parked) > 0
        await second.close()

    asyncio.run(main())


def test_a_run_that_fails_after_claiming_its_restored_boundary_is_retried_from_that_boundary(tmp_path: Path) -> None:
    """The client retries a `Run` whose connection broke: the retry continues the restored episode
    (resume_count 1) instead of starting it over, and repeats the lost model call under the same key."""

    async def main() -> None:
        expected, folder, _, _ = await checkpoint_mid_episode(tmp_path)
        model = GatedModel()
        second = Stack(model)
        await second.restore("r1", folder, [EpisodeKey("ep", 0)])
        await second.resume("r1")
        model.gate.clear()
        broken = asyncio.ensure_future(second.run("ep", 1))
        await until(lambda: bool(model.calls))  # claimed the restored record, inside its first Generate
        assert second.participant.readiness().counts["restored_pending"] == 0
        broken.cancel()  # the caller's connection broke
        await asyncio.gather(broken, return_exceptions=True)
        assert second.participant.readiness().counts["restored_pending"] == 1
        model.gate.set()
        trajectory = await second.run("ep", 1)
        assert (trajectory.resume_count, trajectory.restart_count) == (1, 0)
        assert trajectory.reward == expected.reward
        assert len(trajectory.model_calls) == len(expected.model_calls)
        assert model.calls[0] == model.calls[1]  # the lost call, asked again under its first key
        assert second.participant.readiness().counts["restored_pending"] == 0
        await second.close()

    asyncio.run(main())


def test_an_episode_waiting_on_generate_counts_as_parked_and_parked_time_is_free(tmp_path: Path) -> None:
    async def main() -> None:
        model = GatedModel()
        stack = Stack(model, episode_timeout=0.5)
        model.gate.clear()
        running = asyncio.ensure_future(stack.run("ep"))
        await until(lambda: bool(model.calls))
        (phase, _), _ = await stack.prepare("c1")
        assert phase is Phase.PREPARED  # inside Generate: the model holds it
        await stack.commit("c1", tmp_path, None)
        model.gate.set()
        await asyncio.sleep(0.8)  # parked at its next boundary, past the episode's 0.5 s timeout
        assert not running.done()
        await stack.resume("c1")
        trajectory = await running
        assert trajectory.stop_reason == agent_pb.STOP_REASON_FINAL_ANSWER
        assert seconds(trajectory.timing.parked) >= 0.7
        await stack.close()

    asyncio.run(main())


def test_retire_stops_a_running_episode_and_drops_unclaimed_restored_state(tmp_path: Path) -> None:
    async def main() -> None:
        model = GatedModel()
        stack = Stack(model)
        model.gate.clear()
        running = asyncio.ensure_future(stack.run("ep"))
        await until(lambda: bool(model.calls))
        await stack.planes[0].retire("retire-1", soon(), [EpisodeKey("ep", 0)])
        with pytest.raises(GymrpcError) as caught:
            await running
        assert caught.value.reason == "STALE_ATTEMPT"
        assert stack.participant.readiness().counts["live"] == 0
        await stack.planes[0].forget("forget-1", ["ep"])
        model.gate.set()
        await stack.run("ep2")  # the agent still works
        await stack.close()

    asyncio.run(main())


def test_damaged_agent_records_are_refused_before_anything_is_installed() -> None:
    async def main() -> None:
        participant = AgentParticipant()
        good = EpisodeCheckpoint(schema_version=1, episode_id=common_pb2.EpisodeId(rollout_id="a"))
        bad_phase = rec_pb.CheckpointRecord(episode_id=common_pb2.EpisodeId(rollout_id="a"))
        bad_phase.other.Pack(good)
        not_agent = rec_pb.CheckpointRecord(
            episode_id=common_pb2.EpisodeId(rollout_id="b"), model_episode=rec_pb.ModelEpisodeRecord()
        )
        for record in (bad_phase, not_agent):
            with pytest.raises(DataLoss):
                await participant.stage([record], frozenset())
        assert participant.readiness().counts["restored_pending"] == 0

    asyncio.run(main())


def test_time_held_in_generate_while_a_checkpoint_is_open_is_free_too() -> None:
    async def main() -> None:
        model = GatedModel()
        stack = Stack(model, episode_timeout=0.5)
        model.gate.clear()
        running = asyncio.ensure_future(stack.run("ep"))
        await until(lambda: bool(model.calls))
        (phase, _), _ = await stack.prepare("c1")
        assert phase is Phase.PREPARED
        await asyncio.sleep(0.8)  # the model holds the call past the episode's 0.5 s timeout
        await stack.resume("c1")
        model.gate.set()
        trajectory = await running
        assert trajectory.stop_reason == agent_pb.STOP_REASON_FINAL_ANSWER
        assert seconds(trajectory.timing.parked) >= 0.7
        await stack.close()

    asyncio.run(main())
