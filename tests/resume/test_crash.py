"""SIGKILL the agent at every kind of boundary: one `Client.run` call still returns the uninterrupted result.

One stack holds an uninterrupted agent and one agent per crash point, each with its own
resume folder and fault injection (`gymrpc.servers.agent.faults`): the agent kills itself right
after the durable save at that boundary (or while `Verify` is served, once a tool call ran
while the boundary before it was still being saved, or once a tool call's reply arrived),
once. The supervisor restarts it on a new port under the same name; the trainer's pending
`Client.run` follows the name, the restarted agent resumes from the record, and the result
matches the baseline.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from gymrpc.client import Client
from gymrpc.v1 import agent_service_pb2 as agent_pb
from tests.resume.helpers import POLICY, agent, crash_env, expected_count, record, stack, task

CRASHES = {
    "agent/seed": "after_seed",
    "agent/model": "after_model:0",  # two increments pending
    "agent/tool": "after_tool:0",  # mid-turn: one increment applied, one pending
    "agent/unsaved": "unsaved_tool:0",  # the same increment applied, the boundary before it maybe not saved
    "agent/read": "after_tool:2",  # after the read, before the final answer
    "agent/lost-reply": "during_tool:1",  # the second increment applied, its reply lost with the process
    "agent/verify": "during_verify",
}


def _outcome(t: agent_pb.Trajectory) -> dict[str, Any]:
    """What must not depend on a crash: reward, every message and tool result, the final environment state."""
    return {
        "reward": t.reward,
        "details": json.loads(t.verify_details_json),
        "messages": [m.SerializeToString(deterministic=True) for m in t.messages],
        "tool_outputs": [(c.call.name, c.call.arguments_json, c.output, c.is_error) for c in t.tool_calls],
        "steps": t.steps,
        "stop_reason": t.stop_reason,
        "completions": [list(c.tokens.completion_token_ids) for c in t.model_calls],
    }


def test_agent_killed_at_each_boundary_resumes_to_the_same_result(start_stack: Any, run_dir: Path) -> None:
    folders = {name: run_dir / name.replace("/", "-") for name in ("agent/plain", *CRASHES)}
    servers = [agent("agent/plain", folders["agent/plain"])]
    servers += [
        agent(name, folders[name], env=crash_env(at, run_dir / f"{name.replace('/', '-')}.crashed"))
        for name, at in CRASHES.items()
    ]
    s = start_stack(stack(*servers))
    t = task(1)  # add 4 then add 5 then get the count: 6 -> 15

    async def scenario() -> dict[str, agent_pb.Trajectory]:
        async with Client(run_dir=run_dir) as client:
            names = list(folders)
            results = await asyncio.gather(
                *(
                    client.run(t, episode_id=f"ep-{i}", policy_version=POLICY, agent=name, timeout=120)
                    for i, name in enumerate(names)
                )
            )
            return dict(zip(names, results, strict=True))

    results = asyncio.run(scenario())
    baseline = results["agent/plain"]
    assert baseline.reward == 1.0
    assert json.loads(baseline.verify_details_json)["count"] == expected_count(t)
    assert (baseline.resume_count, baseline.restart_count) == (0, 0)
    assert s.server("agent/plain")["restarts"] == 0
    for name, at in CRASHES.items():
        got = results[name]
        assert (run_dir / f"{name.replace('/', '-')}.crashed").exists(), f"{name} never crashed at {at}"
        assert s.server(name)["restarts"] == 1, name
        assert "SIGKILL" in (s.server(name)["last_exit"] or ""), name
        assert _outcome(got) == _outcome(baseline), f"{name} ({at}) differs from the uninterrupted run"
        assert (got.resume_count, got.restart_count) == (1, 0), name
        # the record on disk is the completed one, with the same trajectory
        stored = record(folders[name], got.episode_id.rollout_id)
        assert stored is not None
        assert stored.phase == agent_pb.EPISODE_PHASE_COMPLETED
        assert stored.final_result == got
