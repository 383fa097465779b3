"""`python -m gymrpc.servers.agent` as a real process under `gymrpc up`, surviving restarts of what it calls.

Uses the real model server (`--backend scripted --policy counter`) once it exists, else
the FAKE model of `tests.agent.fake_model` run as a process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from gymrpc.client import Client
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2
from tests.agent.fakes import counter_task, counter_tasks

ROOT = Path(__file__).resolve().parents[2]
REAL_MODEL = (ROOT / "servers" / "model" / "__main__.py").exists()


def _config() -> dict[str, Any]:
    model: dict[str, Any] = (
        {"role": "model", "args": {"backend": "scripted", "policy": "counter"}}
        if REAL_MODEL
        else {"role": "tests.agent.fake_model"}
    )
    return {
        "servers": [
            {"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}},
            {"name": "model/policy", **model},
            {
                "name": "agent/simple",
                "role": "agent",
                "args": {"resources": "resources/counter", "model": "model/policy", "max_steps": 8},
            },
        ]
    }


async def _rewards(run_dir: Path, prefix: str) -> list[float]:
    async with Client(run_dir=run_dir) as client:
        agent = client.agent("agent/simple")
        replies = await asyncio.gather(
            *(
                agent.Run(
                    agent_pb.RunRequest(task=task, episode_id=common_pb2.EpisodeId(rollout_id=f"{prefix}-{i}")),
                    timeout=30,
                )
                for i, task in enumerate(counter_tasks())
            )
        )
        return [r.trajectory.reward for r in replies]


def test_agent_process_runs_counter_tasks_and_follows_restarts(start_stack: Any) -> None:
    stack = start_stack(_config())
    assert asyncio.run(_rewards(stack.run_dir, "first")) == [1.0] * 5
    for name in ("resources/counter", "model/policy", "agent/simple"):
        stack.kill(name)
        stack.wait_for(name, lambda s: s["restarts"] >= 1 and s["state"] == "serving")
    assert asyncio.run(_rewards(stack.run_dir, "after-restarts")) == [1.0] * 5


def test_a_retried_run_whose_model_answers_otherwise_starts_over_instead_of_applying_twice(
    start_stack: Any, run_dir: Path
) -> None:
    # The agent is SIGKILLed once its first increment has run; its retried run gets another generation
    # (fresh call ids, as from a sampling model whose generations were lost), so it cannot replay the
    # earlier run's calls: it starts over in a fresh session rather than add 2 twice to the same counter.
    marker = run_dir / "agent.crashed"
    agent = {
        "name": "agent/simple",
        "role": "agent",
        "args": {"resources": "resources/counter", "model": "model/policy", "max_steps": 8},
        "env": {"GYMRPC_CRASH_AT": "during_tool:0", "GYMRPC_CRASH_MARKER": str(marker)},
    }
    start_stack(
        {
            "restart": {"max_restarts": 5, "window_seconds": 60, "backoff_seconds": 0.05},
            "servers": [
                {"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}},
                {"name": "model/policy", "role": "tests.agent.fake_model"},
                agent,
            ],
        }
    )
    task = counter_task("[fake:sampled] add 2 then add 3 then get the count", 0, 5)

    async def run() -> agent_pb.Trajectory:
        async with Client(run_dir=run_dir) as client:
            return await client.run(task, episode_id="sampled", policy_version="", agent="agent/simple", timeout=120)

    t = asyncio.run(run())
    assert marker.exists()
    assert (t.reward, t.restart_count) == (1.0, 1)
    assert [(c.call.name, c.output) for c in t.tool_calls] == [
        ("increment_counter", '{"success": true}'),
        ("increment_counter", '{"success": true}'),
        ("get_counter_value", '{"count": 5}'),
    ]


def test_an_episode_whose_resources_server_restarts_mid_run_starts_over_in_a_fresh_session(
    start_stack: Any, run_dir: Path
) -> None:
    # No durable resume, no coordinated checkpoints: no saved boundary rebuilds the lost session. The
    # model server is frozen (SIGSTOP) so the episode waits in its first model call, after its seed,
    # while the resources server is SIGKILLed and restarted; then the model answers.
    stack = start_stack({"restart": {"max_restarts": 5, "window_seconds": 60, "backoff_seconds": 0.05}, **_config()})
    model = stack.server("model/policy")["pid"]
    task = counter_task("add 2 then add 3 then get the count", 0, 5)

    async def run() -> agent_pb.Trajectory:
        async with Client(run_dir=run_dir) as client:
            request = agent_pb.RunStreamRequest(
                request=agent_pb.RunRequest(task=task, episode_id=common_pb2.EpisodeId(rollout_id="lost"))
            )
            os.kill(model, signal.SIGSTOP)
            try:
                stream = client.agent("agent/simple").RunStream(request, timeout=120)
                first = await anext(aiter(stream))
                assert first.progress.phase == agent_pb.EPISODE_PHASE_READY_FOR_MODEL  # seeded
                killed = stack.kill("resources/counter")
                await asyncio.to_thread(
                    stack.wait_for, "resources/counter", lambda s: s["pid"] != killed and s["state"] == "serving"
                )
            finally:
                os.kill(model, signal.SIGCONT)
            return [event async for event in stream][-1].trajectory

    t = asyncio.run(run())
    assert (t.reward, t.restart_count) == (1.0, 1)
    assert [(c.call.name, c.output) for c in t.tool_calls] == [
        ("increment_counter", '{"success": true}'),
        ("increment_counter", '{"success": true}'),
        ("get_counter_value", '{"count": 5}'),
    ]


def test_cli_refuses_to_start_without_a_registry() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gymrpc.servers.agent", "--max-steps", "3"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        timeout=30,
    )
    assert result.returncode == 2
    assert "pass --registry or set $GYMRPC_REGISTRY" in result.stderr


def test_cli_refuses_bad_limits() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gymrpc.servers.agent", "--registry", "unix:/nonexistent", "--max-steps", "0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        timeout=30,
    )
    assert result.returncode == 2
    assert "max_steps must be in 1..1000" in result.stderr
