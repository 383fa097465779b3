"""The openai-SDK ReAct example on the five recorded Workplace tasks, and SIGKILLed during a mutating tool call.

The model server's scripted backend replays each recorded rollout's model outputs (matched
by conversation), so the example agent must ask exactly what NeMo Gym's agent asked: each
task then scores its recorded reward and every tool output comes back byte for byte. A kit
agent killed right after a state-changing tool ran (during_tool: its result never seen)
finishes with the same trajectory and the same tables (`live` verify mode fingerprints them)
as an uninterrupted run: the delete or add ran once.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import yaml

from gymrpc.client import Client
from gymrpc.envs.workplace_assistant import example_rollouts_path, rollout_tasks_path
from gymrpc.messages import task_from_row
from gymrpc.v1 import agent_service_pb2 as agent_pb
from tests.frontdoor.test_agentkit import REACT, episode_stats, outcome
from tests.resume.helpers import crash_env

EXAMPLE = Path(__file__).resolve().parents[2] / "gymrpc/agentkit/examples/workplace.yaml"


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _kit(name: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": name,
        "role": "agent",
        "args": {"entrypoint": REACT, "resources": "resources/workplace", "model": "model/policy"},
    }
    if env:
        spec["env"] = env
    return spec


def test_the_example_agent_scores_the_recorded_rewards_and_survives_a_kill_during_a_tool(
    start_stack: Any, run_dir: Path
) -> None:
    config = yaml.safe_load(EXAMPLE.read_text())  # the shipped example stack, plus a crashing twin
    model = next(s for s in config["servers"] if s["name"] == "model/policy")
    model["args"]["replay_dir"] = str(run_dir / "replay")
    config["servers"].append(_kit("agent/killed", crash_env("during_tool:1", run_dir / "killed.crashed")))
    stack = start_stack(config)
    tasks, recordings = _rows(rollout_tasks_path()), _rows(example_rollouts_path())
    live = [{**row, "verify_mode": "live"} for row in tasks]

    async def scenario() -> tuple[list[agent_pb.Trajectory], list[agent_pb.Trajectory], dict[str, int]]:
        async with Client(run_dir=run_dir) as client:

            def run(row: dict[str, Any], rollout_id: str, agent: str) -> Any:
                task = task_from_row(row, rollout_id)
                return client.run(task, episode_id=rollout_id, policy_version="p", agent=agent, timeout=180)

            recorded = await asyncio.gather(*(run(row, f"rec-{i}", "agent/react") for i, row in enumerate(tasks)))
            # Task 4 searches then deletes an email: killed right after the delete ran.
            pair = await asyncio.gather(
                run(live[4], "plain-4", "agent/react"), run(live[4], "killed-4", "agent/killed")
            )
            return list(recorded), list(pair), await episode_stats(client, "killed-4")

    recorded, (plain, killed), stats = asyncio.run(scenario())
    assert [t.reward for t in recorded] == [r["reward"] for r in recordings] == [0.0, 1.0, 1.0, 1.0, 1.0]
    for trajectory, recording in zip(recorded, recordings, strict=True):
        expected = [o["output"] for o in recording["response"]["output"] if o["type"] == "function_call_output"]
        assert [c.output for c in trajectory.tool_calls] == expected
    assert (run_dir / "killed.crashed").exists()
    assert stack.server("agent/killed")["restarts"] == 1
    assert [c.call.name for c in plain.tool_calls] == ["email_search_emails", "email_delete_email"]
    assert plain.reward == 1.0
    assert outcome(killed) == outcome(plain)  # the same messages, tool results, tokens and table fingerprints
    assert stats["replayed"] >= 2  # both tool-calling turns came from the record
    assert stats["generated"] == len(killed.model_calls)
