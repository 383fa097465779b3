"""The example tasks and the recorded rollouts through the whole stack, as real processes.

`gymrpc up` starts resources (`--environment workplace`), the real model server with the
scripted backend, and the agent (`--max-steps 6`). The script replays each example task's
ground-truth calls then answers; the recorded source replays each recorded rollout's model
outputs. Ground truth must score 1 and each recording its recorded reward, in both verify
modes; the recorded tool outputs must come back byte for byte.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from gymrpc.client import Client
from gymrpc.envs.workplace_assistant import example_rollouts_path, example_tasks_path, rollout_tasks_path
from gymrpc.messages import task_from_row
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _first_user(row: dict[str, Any]) -> str:
    return next(m["content"] for m in row["responses_create_params"]["input"] if m["role"] == "user")


def _write_script(path: Path, rows: list[dict[str, Any]]) -> None:
    """Turn 0: every ground-truth call at once; turn 1: a final answer."""
    lines = []
    for row in rows:
        calls = [{"name": c["name"], "arguments": c["arguments"]} for c in row["ground_truth"]]
        lines.append({"first_user": _first_user(row), "replies": [{"tool_calls": calls}, {"content": "Done."}]})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")


def _config(script: Path) -> dict[str, Any]:
    return {
        "servers": [
            {"name": "resources/workplace", "role": "resources", "args": {"environment": "workplace"}},
            {
                "name": "model/policy",
                "role": "model",
                "args": {
                    "backend": "scripted",
                    "script": str(script),
                    "recorded": "env:workplace_assistant",
                    "default_max_tokens": 4096,
                },
            },
            {
                "name": "agent/simple",
                "role": "agent",
                "args": {"resources": "resources/workplace", "model": "model/policy", "max_steps": 6},
            },
        ]
    }


async def _run(run_dir: Path, jobs: list[tuple[str, dict[str, Any]]]) -> list[agent_pb.Trajectory]:
    async with Client(run_dir=run_dir) as client:
        agent = client.agent("agent/simple")
        replies = await asyncio.gather(
            *(
                agent.Run(
                    agent_pb.RunRequest(
                        task=task_from_row(row, rollout_id), episode_id=common_pb2.EpisodeId(rollout_id=rollout_id)
                    ),
                    timeout=120,
                )
                for rollout_id, row in jobs
            )
        )
        return [reply.trajectory for reply in replies]


def test_ground_truth_and_recorded_rollouts_score_as_expected(start_stack: Any, run_dir: Path) -> None:
    examples, recorded_tasks = _rows(example_tasks_path()), _rows(rollout_tasks_path())
    script = run_dir / "ground_truth_script.jsonl"
    _write_script(script, examples)
    stack = start_stack(_config(script))
    jobs = []
    for mode in ("replay", "live"):
        jobs += [(f"gt-{mode}-{i}", {**row, "verify_mode": mode}) for i, row in enumerate(examples)]
        jobs += [(f"rec-{mode}-{i}", {**row, "verify_mode": mode}) for i, row in enumerate(recorded_tasks)]
    trajectories = asyncio.run(_run(stack.run_dir, jobs))
    by_id = dict(zip([rollout_id for rollout_id, _ in jobs], trajectories, strict=True))

    recordings = _rows(example_rollouts_path())
    for mode in ("replay", "live"):
        for i, row in enumerate(examples):
            trajectory = by_id[f"gt-{mode}-{i}"]
            assert trajectory.reward == 1.0, (i, mode, trajectory.verify_details_json)
            assert [c.call.name for c in trajectory.tool_calls] == [c["name"] for c in row["ground_truth"]]
            assert not any(c.is_error for c in trajectory.tool_calls)
        for i, (task, recording) in enumerate(zip(recorded_tasks, recordings, strict=True)):
            trajectory = by_id[f"rec-{mode}-{i}"]
            assert trajectory.reward == recording["reward"] == task["recorded_reward"], (i, mode)
            expected = [o["output"] for o in recording["response"]["output"] if o["type"] == "function_call_output"]
            assert [c.output for c in trajectory.tool_calls] == expected
    assert [by_id[f"rec-replay-{i}"].reward for i in range(5)] == [0.0, 1.0, 1.0, 1.0, 1.0]
