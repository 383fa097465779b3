"""Captures (issue 18, item 2): taken while parked, written after the resume, equal to the state at the capture.

Per participant kind, the records a non-stop checkpoint publishes are compared with the records
the participant exported just before its capture, while the episodes were parked: between the
capture and the write the episodes go on (model calls, tool calls, a closed session, an episode
run to its end), and none of it may reach the checkpoint.
"""

from __future__ import annotations

import asyncio
import gc
import time
from pathlib import Path

import pytest

from gymrpc.control import EpisodeKey, Kind, collection, store
from gymrpc.controller import CoordinationError
from gymrpc.envs.counter import CounterEnvironment
from gymrpc.messages import task_spec
from gymrpc.servers.agent.participant import frozen
from gymrpc.servers.agent.state import EpisodeState, Phase
from gymrpc.servers.model.capture import CaptureLedger, Generation
from gymrpc.store import EpisodeCheckpoint
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import checkpoint_records_pb2 as rec_pb
from gymrpc.v1 import common_pb2
from tests.agent.fakes import counter_task
from tests.control.deployment import Deployment
from tests.control.test_agent_participant import GatedModel, Stack, until
from tests.control.test_nonstop import EPISODES, seeded

WAIT = 30.0


def soon() -> float:
    return time.time() + WAIT


def records(folder: Path, kind: Kind, name: str) -> list[rec_pb.CheckpointRecord]:
    return store.read_checkpoint(folder, kind, name)[1]


def test_model_resources_and_agent_records_are_the_capture_whatever_the_episodes_do_next(tmp_path: Path) -> None:
    async def main() -> None:
        deployment: Deployment = await seeded()
        controller = deployment.controller
        folder = tmp_path / "c1"
        scope = frozenset(EPISODES)
        try:
            assert (await controller.prepare("c1", timeout=WAIT)).prepared
            expected = {name: await node.participant.export(scope) for name, node in deployment.nodes.items()}
            captured = await controller.capture("c1", folder, EPISODES, timeout=WAIT)
            assert all(r.persisting for r in captured.replies.values())
            await controller.resume("c1")  # the writes start; the episodes go on beside them
            agent = deployment.nodes["agent/a"].participant
            for i, episode in enumerate(EPISODES):
                await deployment.increment(f"resources/r{i}", episode, "call-1")
                await deployment.generate("model/m0", episode, 1)
                agent.begin(episode)
                agent.end(episode)
            await deployment.close_session("resources/r1", EPISODES[1])
            manifests, _ = await controller.publish(captured)
            for name, node in deployment.nodes.items():
                assert records(folder, node.kind, name) == expected[name], name
                assert manifests[name].record_count == len(expected[name])
            assert {len(r.model_episode.rows) for r in expected["model/m0"]} == {1}
            now = await deployment.nodes["model/m0"].participant.export(scope)
            assert {len(r.model_episode.rows) for r in now} == {2}  # the episodes did go on
        finally:
            await deployment.close()

    asyncio.run(main())


def test_the_agent_records_are_the_boundary_of_the_capture_though_the_episode_finished(tmp_path: Path) -> None:
    async def main() -> None:
        stack = Stack(GatedModel(), tool_delay=0.2)
        folder, key = tmp_path / "c1", EpisodeKey("ep", 0)
        try:
            running = asyncio.ensure_future(stack.run("ep"))
            live = stack.participant._live
            await until(lambda: bool(live) and live[key].state.step >= 1)
            (phase, report), _ = await stack.prepare("c1")
            assert phase.name == "PREPARED", report
            scope = frozenset({key})
            expected = [await p.participant.export(scope) for p in stack.planes]
            for plane in stack.planes:
                assert await plane.commit("c1", soon(), str(folder), scope, background=True) is None
            await stack.resume("c1")
            trajectory = await asyncio.wait_for(running, WAIT)  # the episode runs to its end
            assert len(trajectory.model_calls) > 1
            for plane in stack.planes:
                await plane.persist("c1", soon())
            agent, resources = (records(folder, Kind.AGENT, "agent/c"), records(folder, Kind.RESOURCES, "r/c"))
            assert resources == expected[1]
            assert len(agent) == len(expected[0]) == 1
            written, before = EpisodeCheckpoint(), EpisodeCheckpoint()
            assert agent[0].other.Unpack(written)
            assert expected[0][0].other.Unpack(before)
            written.ClearField("parked"), before.ClearField("parked")  # parked so far: counted at each call
            assert written == before
            assert (written.phase, written.step) == (Phase.READY_FOR_MODEL, 1)
        finally:
            await stack.close()

    asyncio.run(main())


def test_a_frozen_episode_state_keeps_its_boundary_when_the_loop_goes_on() -> None:
    state = EpisodeState("ep", 0, counter_task("count", 0, 3), max_steps=8)
    state.phase, state.step = Phase.READY_FOR_MODEL, 1
    state.messages.append(common_pb2.Message(role=common_pb2.ROLE_USER, content="go"))
    state.usage.output_tokens = 5
    copy = frozen(state)
    state.messages.append(common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, content="ok"))
    state.model_calls.append(agent_pb.ModelCallRecord(weight_version="v1"))
    state.usage.output_tokens += 7
    state.phase, state.step = Phase.READY_FOR_TOOL, 2
    state.pending_tool_calls = [common_pb2.ToolCall(id="c", name="increment_counter")]
    assert (copy.phase, copy.step, len(copy.messages), len(copy.model_calls)) == (Phase.READY_FOR_MODEL, 1, 1, 0)
    assert copy.usage.output_tokens == 5
    assert not copy.pending_tool_calls


def test_a_parked_generation_view_and_the_ledger_counts() -> None:
    gen = Generation("r1", EpisodeKey("ep", 0), streaming=False, state="cut", digest="d" * 64, token_ids=[1, 2])
    view = gen.view()
    gen.token_ids.extend([3, 4])
    assert list(view.to_pb().prefix_token_ids) == [1, 2]
    ledger = CaptureLedger(max_episodes=2)
    row = rec_pb.CaptureRow(request_id="a", tokens=common_pb2.TokenTrace(completion_token_ids=[1, 2, 3]))
    for episode in ("e0", "e1", "e2"):  # e0 is evicted
        ledger.record(EpisodeKey(episode, 0), row)
    assert (len(ledger), ledger.tokens()) == (2, 6)
    frozen_rows = ledger.frozen(frozenset({EpisodeKey("e1", 0)}))
    ledger.record(EpisodeKey("e1", 0), row)
    assert len(frozen_rows[EpisodeKey("e1", 0)]) == 1
    ledger.install(EpisodeKey("e1", 0), [row])
    ledger.drop([EpisodeKey("e2", 0)])
    assert (len(ledger), ledger.tokens()) == (1, 3)


def test_a_counter_session_capture_is_its_export_at_the_capture() -> None:
    environment = CounterEnvironment()
    session, _ = environment.seed(task_spec(counter_task("count", 1, 3)))
    before = session.export()
    later = session.capture()
    session.call_tool("increment_counter", {"count": 2})
    assert later() == before != session.export()


def test_the_collector_is_held_until_the_last_holder_releases_it_and_left_as_found() -> None:
    first, second = object(), object()
    assert gc.isenabled()
    collection.hold(first)
    collection.hold(first)  # a retried commit
    collection.hold(second)
    assert not gc.isenabled()
    collection.release(first)
    assert not gc.isenabled()
    collection.release(second)
    collection.release(second)
    assert gc.isenabled()
    assert not collection.held()


def test_a_resume_lets_the_collector_go_once_its_reply_was_sent() -> None:
    async def main() -> None:
        holder, sent = object(), []
        collection.hold(holder)
        collection.release_after_reply(holder, sent.append)
        assert collection.held()
        assert not gc.isenabled()
        sent.pop()()  # the reply went out
        await collection.released(holder)
        assert not collection.held()
        assert gc.isenabled()
        collection.hold(holder)
        collection.release_after_reply(holder, sent.append)
        collection.hold(holder)  # the next commit came first: the hold goes on
        sent.pop()()  # the first resume's reply went out later: it lets nothing go
        await collection.released(holder)
        assert collection.held()
        assert not gc.isenabled()
        collection.release_after_reply(holder)  # no reply to wait for (a lease ran out): at once
        assert not collection.held()
        assert gc.isenabled()

    asyncio.run(main())


def test_a_non_stop_commit_holds_the_collector_until_its_resume(tmp_path: Path) -> None:
    async def main() -> None:
        deployment: Deployment = await seeded()
        controller = deployment.controller
        try:
            assert (await controller.prepare("c1", timeout=WAIT)).prepared
            captured = await controller.capture("c1", tmp_path / "c1", EPISODES, timeout=WAIT)
            assert collection.held()  # the episodes wait: no full collection now
            await controller.resume("c1")
            for node in deployment.nodes.values():  # let go once the resume's reply is on its way
                await collection.released(node.plane)
            assert not collection.held()
            assert gc.isenabled()
            await controller.publish(captured)
            assert (await controller.prepare("c2", timeout=WAIT)).prepared
            with pytest.raises(CoordinationError):  # an invalid id: every commit fails, and lets go
                await controller.capture("c2", tmp_path / "c2", [EpisodeKey("not/an/id", 0)], timeout=WAIT)
            assert not collection.held()
            await controller.resume("c2")
            assert not collection.held()
            assert (await controller.prepare("c3", timeout=WAIT)).prepared
            await controller.capture("c3", tmp_path / "c3", EPISODES, timeout=WAIT)
            await controller.resume("c3")
            assert (await controller.prepare("c4", timeout=WAIT)).prepared
            captured = await controller.capture("c4", tmp_path / "c4", EPISODES, timeout=WAIT)
            for node in deployment.nodes.values():  # held for this commit, whenever c3's release came
                await collection.released(node.plane)
            assert collection.held()
            await controller.resume("c4")
            await controller.publish(captured)
        finally:
            await deployment.close()

    asyncio.run(main())
