"""Scale: 1,000 concurrent counter episodes through `Client.run`; the agent is SIGKILLed in the middle.

Every episode must finish with reward 1 and none may start over (`restart_count` 0); the
episodes in flight at the kill resume from their last boundary. Prints the `resume_count`
histogram the way the reference's PR reports it (`{0: …, 1: …}`).
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from pathlib import Path
from typing import Any

import pytest

from gymrpc.client import Client
from gymrpc.v1 import agent_service_pb2 as agent_pb
from tests.resume.helpers import POLICY, agent, expected_count, stack, task

EPISODES = 1000
KILL_AFTER = 0.3
"""Fraction of episodes finished when the agent is killed."""


@pytest.mark.slow
def test_a_thousand_concurrent_episodes_survive_an_agent_kill(start_stack: Any, run_dir: Path) -> None:
    s = start_stack(stack(agent("agent/simple", run_dir / "store")))

    async def scenario() -> tuple[list[agent_pb.Trajectory], int, float]:
        finished, middle = 0, asyncio.Event()

        async def one(i: int) -> agent_pb.Trajectory:
            nonlocal finished
            trajectory = await client.run(task(i), episode_id=f"scale-{i}", policy_version=POLICY, timeout=900)
            finished += 1
            if finished >= EPISODES * KILL_AFTER:
                middle.set()
            return trajectory

        async with Client(run_dir=run_dir) as client:
            started = time.monotonic()
            calls = [asyncio.ensure_future(one(i)) for i in range(EPISODES)]
            await middle.wait()
            at_kill = finished
            s.kill("agent/simple")
            results = await asyncio.gather(*calls)
            return results, at_kill, time.monotonic() - started

    results, at_kill, elapsed = asyncio.run(scenario())
    resumes = dict(sorted(collections.Counter(t.resume_count for t in results).items()))
    restarts = dict(sorted(collections.Counter(t.restart_count for t in results).items()))
    print(
        f"\n{EPISODES} episodes in {elapsed:.1f}s; agent SIGKILLed after {at_kill} had finished; "
        f"resume_count histogram {resumes}; restart_count histogram {restarts}"
    )
    assert s.server("agent/simple")["restarts"] == 1
    assert all(t.reward == 1.0 for t in results)
    for i, t in enumerate(results):
        assert json.loads(t.verify_details_json)["count"] == expected_count(task(i))
    assert restarts == {0: EPISODES}, "an episode was started over"
    assert resumes.get(1, 0) > 0, "no episode was in flight at the kill"
    assert set(resumes) <= {0, 1}
