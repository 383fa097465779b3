"""Real episodes (agent, resources, scripted model) on replicated names, with a replica killed mid-run."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gymrpc.client import Client
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2
from tests.resume.helpers import POLICY, expected_count, record, task

TOKEN_DELAY = 0.02
"""Seconds per generated token: about half a second per model call, room to kill something meanwhile."""


def stack(
    store: Path | None,
    *,
    agents: int = 1,
    resources: int = 1,
    placement: dict[str, Any] | None = None,
    restart: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`resources` counter replicas, the scripted model, `agents` agent replicas sharing the resume folder."""
    extra = placement or {}
    agent_args: dict[str, Any] = {"resources": "resources/counter", "model": "model/policy", "max_steps": 8}
    if store is not None:
        agent_args["resume_dir"] = str(store)
    return {
        "lease_ttl": 3,
        "restart": restart or {"max_restarts": 5, "window_seconds": 60, "backoff_seconds": 0.05},
        "servers": [
            {"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}}
            | {"replicas": resources}
            | extra,
            {
                "name": "model/policy",
                "role": "model",
                "args": {"backend": "scripted", "policy": "counter", "token_delay": TOKEN_DELAY},
            }
            | extra,
            {"name": "agent/simple", "role": "agent", "args": agent_args, "replicas": agents} | extra,
        ],
    }


def episodes(count: int, prefix: str = "ep") -> dict[str, common_pb2.Task]:
    return {f"{prefix}-{i}": task(i) for i in range(count)}


async def run_and_kill(
    client: Client,
    tasks: dict[str, common_pb2.Task],
    store: Path,
    kill: Callable[[Client], None],
    timeout: float = 120.0,
) -> dict[str, agent_pb.Trajectory]:
    """Start every episode, call `kill` once each has saved a boundary, and return every trajectory."""
    running = {
        e: asyncio.ensure_future(client.run(t, episode_id=e, policy_version=POLICY, timeout=timeout))
        for e, t in tasks.items()
    }
    deadline = time.monotonic() + 60
    while not all(_in_progress(store, e) for e in tasks):
        assert time.monotonic() < deadline, "the episodes never checkpointed"
        assert not any(r.done() for r in running.values()), "an episode ended before the kill"
        await asyncio.sleep(0.02)
    kill(client)
    results = await asyncio.gather(*running.values())
    return dict(zip(running, results, strict=True))


def check_results(results: dict[str, agent_pb.Trajectory], tasks: dict[str, common_pb2.Task]) -> None:
    """Every episode ended as an uninterrupted one does: solved, with the expected tool calls."""
    for episode, t in tasks.items():
        got = results[episode]
        assert got.reward == 1.0, episode
        assert json.loads(got.verify_details_json)["count"] == expected_count(t), episode
        assert [c.call.name for c in got.tool_calls][-1] == "get_counter_value", episode
        assert got.restart_count == 0, episode


def _in_progress(store: Path, episode: str) -> bool:
    try:
        r = record(store, episode)
    except FileNotFoundError:
        return False
    return r is not None and r.phase in (agent_pb.EPISODE_PHASE_READY_FOR_TOOL, agent_pb.EPISODE_PHASE_READY_FOR_MODEL)
