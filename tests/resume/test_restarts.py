"""Process-level restarts around durable resume: the resources server, then the whole stack, SIGKILLed.

- Resources killed mid-episode: the restarted server has lost the session; the agent restores
  it from the last checkpoint's snapshot and the same `Run` goes on to the right result.
- Resources killed, then the agent SIGKILLs itself after the recovered episode's next save: the
  agent that finishes the episode reports the recovery the dead one made (`session_recoveries`
  is kept in the episode's durable record).
- Whole stack killed (launcher and every server at once), started again on the same resume
  folder: finished episodes come back from the cache without a single model call, unfinished
  ones resume from their last boundary.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from gymrpc.client import Client
from gymrpc.errors import Unavailable
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2
from tests.resume.helpers import POLICY, agent, crash_env, expected_count, kill_all, record, stack, task

TOKEN_DELAY = 0.02
"""Seconds per generated token: about half a second per model call, room to kill something meanwhile."""


def test_resources_killed_mid_episode_session_is_restored_from_the_snapshot(start_stack: Any, run_dir: Path) -> None:
    s = start_stack(stack(agent("agent/simple", run_dir / "store"), token_delay=TOKEN_DELAY))
    t = task(1)
    request = agent_pb.RunStreamRequest(
        request=agent_pb.RunRequest(
            task=t, policy_version=POLICY, episode_id=common_pb2.EpisodeId(rollout_id="res-kill")
        )
    )

    async def scenario() -> list[agent_pb.RunStreamResponse]:
        events = []
        async with Client(run_dir=run_dir) as client:
            stub: Any = client.agent("agent/simple")
            async for event in stub.RunStream(request, timeout=60):
                events.append(event)
                p = event.progress
                if event.HasField("progress") and p.phase == agent_pb.EPISODE_PHASE_READY_FOR_MODEL and p.step == 1:
                    s.kill("resources/counter")  # both increments applied; the agent is asking the model
        return events

    events = asyncio.run(scenario())
    trajectory = events[-1].trajectory
    assert s.server("resources/counter")["restarts"] == 1
    assert trajectory.reward == 1.0
    assert json.loads(trajectory.verify_details_json)["count"] == expected_count(t)
    assert [c.call.name for c in trajectory.tool_calls] == ["increment_counter"] * 2 + ["get_counter_value"]
    assert json.loads(trajectory.tool_calls[-1].output) == {"count": expected_count(t)}
    assert (trajectory.resume_count, trajectory.restart_count) == (0, 0)
    log = (run_dir / "logs" / "agent__simple.log").read_text()
    assert "the resources session was lost; continuing from the last checkpoint" in log


def test_session_recoveries_survive_a_crash_of_the_agent_that_made_them(start_stack: Any, run_dir: Path) -> None:
    store, marker = run_dir / "store", run_dir / "agent.crashed"
    # After the recovered episode saves its third tool call (the read), the agent SIGKILLs itself.
    s = start_stack(stack(agent("agent/simple", store, env=crash_env("after_tool:2", marker)), token_delay=TOKEN_DELAY))
    t = task(1)
    episode = common_pb2.EpisodeId(rollout_id="recovered-then-crashed")
    request = agent_pb.RunStreamRequest(request=agent_pb.RunRequest(task=t, policy_version=POLICY, episode_id=episode))

    async def scenario() -> agent_pb.Trajectory:
        async with Client(run_dir=run_dir) as client:
            stub: Any = client.agent("agent/simple")
            try:
                async for event in stub.RunStream(request, timeout=60):
                    p = event.progress
                    if event.HasField("progress") and p.phase == agent_pb.EPISODE_PHASE_READY_FOR_MODEL and p.step == 1:
                        s.kill("resources/counter")  # both increments applied; the read will find no session
            except Unavailable:
                pass  # the agent killed itself; its record holds the recovery it made
            assert marker.exists(), "the agent never reached its crash point"
            at_crash = record(store, episode.rollout_id)
            assert at_crash is not None
            assert at_crash.session_recoveries == 1
            return await client.run(t, episode_id=episode, policy_version=POLICY, timeout=60)  # the restarted agent

    trajectory = asyncio.run(scenario())
    assert s.server("agent/simple")["restarts"] == 1
    assert trajectory.reward == 1.0
    assert json.loads(trajectory.verify_details_json)["count"] == expected_count(t)
    assert (trajectory.resume_count, trajectory.session_recoveries) == (1, 1)


def test_whole_stack_killed_finished_come_from_cache_unfinished_resume(start_stack: Any, run_dir: Path) -> None:
    store = run_dir / "store"
    logs = [run_dir / "model-1.log", run_dir / "model-2.log"]
    config = [agent("agent/simple", store)]
    first = start_stack(stack(*config, model_log=logs[0], token_delay=TOKEN_DELAY))
    done = {f"done-{i}": task(i) for i in range(3)}
    unfinished = {f"open-{i}": task(i + 3) for i in range(3)}

    async def before_the_crash() -> dict[str, agent_pb.Trajectory]:
        async with Client(run_dir=run_dir) as client:
            finished = await asyncio.gather(
                *(client.run(t, episode_id=e, policy_version=POLICY, timeout=60) for e, t in done.items())
            )
            running = [
                asyncio.ensure_future(client.run(t, episode_id=e, policy_version=POLICY, timeout=60))
                for e, t in unfinished.items()
            ]
            deadline = time.monotonic() + 30
            while not all(_in_progress(store, e) for e in unfinished):  # each has saved a boundary
                assert time.monotonic() < deadline, "the unfinished episodes never checkpointed"
                await asyncio.sleep(0.02)
            kill_all(first)
            for call in running:
                call.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            return dict(zip(done, finished, strict=True))

    finished = asyncio.run(before_the_crash())
    assert all(t.reward == 1.0 for t in finished.values())
    records_at_crash = {e: record(store, e) for e in unfinished}

    start_stack(stack(*config, model_log=logs[1], token_delay=TOKEN_DELAY))

    async def after_the_restart() -> dict[str, agent_pb.Trajectory]:
        episodes = {**done, **unfinished}
        async with Client(run_dir=run_dir) as client:
            results = await asyncio.gather(
                *(client.run(t, episode_id=e, policy_version=POLICY, timeout=60) for e, t in episodes.items())
            )
        return dict(zip(episodes, results, strict=True))

    results = asyncio.run(after_the_restart())
    for episode, trajectory in finished.items():
        assert results[episode] == trajectory, f"{episode} was not returned from the cache unchanged"
    generated = logs[1].read_text().split()
    assert not [r for r in generated if r.startswith("done-")], "a finished episode called the model again"
    for episode, t in unfinished.items():
        got, at_crash = results[episode], records_at_crash[episode]
        assert at_crash is not None
        assert got.reward == 1.0, episode
        assert json.loads(got.verify_details_json)["count"] == expected_count(t)
        assert (got.resume_count, got.restart_count) == (1, 0), episode
        # the boundaries saved before the crash were not generated again
        regenerated = {int(r.rpartition("step")[2]) for r in generated if r.startswith(f"{episode}/")}
        assert min(regenerated, default=got.steps) >= at_crash.step, (episode, regenerated, at_crash.step)
        assert list(got.messages)[: len(at_crash.messages)] == list(at_crash.messages)


def _in_progress(store: Path, episode: str) -> bool:
    try:
        r = record(store, episode)
    except FileNotFoundError:
        return False
    return r is not None and r.phase in (agent_pb.EPISODE_PHASE_READY_FOR_TOOL, agent_pb.EPISODE_PHASE_READY_FOR_MODEL)
