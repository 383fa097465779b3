"""A coordinated checkpoint of replicated participants, restored onto other replica counts.

The scenario both the local launcher (`test_replica_stack.py`) and the Ray launcher
(`tests/ray/test_ray_cluster.py`) run: real agents, counter resources and the scripted model
(slowed so that episodes are mid-generation or between calls at the checkpoint), every server
started with `await_restore`. Episodes run on the first stack's replicas, a `stop` checkpoint
parks them, every process is SIGKILLed, a second stack with other replica counts is restored
from the checkpoint, and the episodes, re-dispatched as attempt 1, end as uninterrupted ones.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gymrpc.balancing import place
from gymrpc.client import Client
from gymrpc.control import EpisodeKey, Kind, store
from gymrpc.controller import Controller
from gymrpc.servers.agent.state import session_id_for
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2
from tests.agent.fakes import counter_tasks
from tests.control.test_process import outcome

COMMON = {"checkpoint_lease_grace": 10, "await_restore": True}
EPISODES = 6


def config(agents: int, resources: int, models: int, placement: dict[str, Any] | None = None) -> dict[str, Any]:
    """agent/simple, resources/counter and model/policy with these replica counts (`placement` on each)."""
    extra = placement or {}
    return {
        "restart": {"max_restarts": 0},
        "servers": [
            {"name": "resources/counter", "role": "resources", "args": {"environment": "counter", **COMMON}}
            | {"replicas": resources}
            | extra,
            {
                "name": "model/policy",
                "role": "model",
                "args": {"backend": "scripted", "policy": "counter", "token_delay": 0.05, **COMMON},
            }
            | {"replicas": models}
            | extra,
            {
                "name": "agent/simple",
                "role": "agent",
                "args": {"resources": "resources/counter", "model": "model/policy", "call_timeout": 60, **COMMON},
            }
            | {"replicas": agents}
            | extra,
        ],
    }


def tasks(prefix: str) -> dict[str, common_pb2.Task]:
    return {f"{prefix}-{i}": counter_tasks()[i % 5] for i in range(EPISODES)}


async def run(client: Client, rollout_id: str, task: common_pb2.Task, attempt: int = 0) -> agent_pb.Trajectory:
    episode = common_pb2.EpisodeId(rollout_id=rollout_id, attempt=attempt)
    return await client.run(task, episode_id=episode, policy_version="", timeout=90)


async def checkpoint_mid_run(client: Client, root: Path) -> tuple[list[Any], Path, list[EpisodeKey]]:
    """Reference outcomes of uninterrupted episodes, then a `stop` checkpoint of as many mid-run."""
    controller = Controller(client)
    members = await controller.discover()
    await controller.open()  # nothing to restore: open admission
    started = time.monotonic()
    reference = [outcome(t) for t in await asyncio.gather(*(run(client, e, t) for e, t in tasks("ref").items()))]
    took = time.monotonic() - started
    planned = tasks("ep")
    running = [asyncio.ensure_future(run(client, e, t)) for e, t in planned.items()]
    await asyncio.sleep(took * 0.4)  # past the first model call, before the end
    assert not any(r.done() for r in running), f"the episodes took {took:.2f}s"
    scope = [EpisodeKey(e, 0) for e in planned]
    result = await controller.checkpoint(root, episode_ids=scope, checkpoint_id="ckpt-1", stop=True)
    assert result.committed
    assert result.continued == scope
    assert sorted(result.manifests) == sorted(m.label for m in members)
    for task in running:  # their calls die with the stack
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)
    return reference, result.checkpoint_dir, scope


def records_by_replica(folder: Path, kind: Kind, name: str) -> dict[str, list[Any]]:
    """Endpoint id -> the records its replica committed."""
    return {i: store.read_checkpoint(folder, kind, name, i)[1] for i in store.replica_ids(folder, kind, name)}


def check_committed(folder: Path, replicas: dict[str, int]) -> dict[str, list[EpisodeKey]]:
    """Every replica wrote its own folder; returns the episodes of each role's records."""
    out = {}
    for name, kind in (("agent/simple", Kind.AGENT), ("resources/counter", Kind.RESOURCES)):
        by_replica = records_by_replica(folder, kind, name)
        assert sorted(by_replica) == [str(i) for i in range(replicas[name])], name
        episodes = [EpisodeKey.of(r.episode_id) for rs in by_replica.values() for r in rs]
        assert len(episodes) == len(set(episodes)), f"{name}: an episode committed by two replicas"
        out[name] = sorted(episodes)
    return out


async def restore_and_continue(
    client: Client,
    folder: Path,
    scope: list[EpisodeKey],
    replicas: dict[str, int],
    committed: dict[str, list[EpisodeKey]],
) -> list[Any]:
    """Restore onto `replicas`, check each record landed once where clients route it, and finish the episodes."""
    controller = Controller(client)
    members = await controller.discover()
    assert {m.name: m.replicas for m in members} == replicas
    replies = await controller.restore("restore-1", folder, scope)
    await controller.resume("restore-1")

    def installed(name: str) -> dict[str, list[EpisodeKey]]:
        """Endpoint id -> the attempts that replica installed."""
        return {
            str(m.endpoint_id): [EpisodeKey.of(e) for e in replies[m.label].restored] for m in members if m.name == name
        }

    def check(name: str, key: Callable[[EpisodeKey], str], expected: list[EpisodeKey]) -> None:
        ids = [str(i) for i in range(replicas[name])]
        got = installed(name)
        assert sorted(e for es in got.values() for e in es) == sorted(e.next() for e in expected), name
        for endpoint_id, episodes in got.items():
            assert all(place(key(e), ids) == endpoint_id for e in episodes), (name, endpoint_id, episodes)
        assert sum(1 for episodes in got.values() if episodes) >= min(len(ids), 2), got  # really spread

    check("agent/simple", lambda e: e.rollout_id, committed["agent/simple"])
    check("resources/counter", lambda e: session_id_for(e.rollout_id, 0), committed["resources/counter"])
    check("model/policy", lambda e: e.rollout_id, scope)

    planned = tasks("ep")
    trajectories = await asyncio.gather(*(run(client, e.rollout_id, planned[e.rollout_id], 1) for e in scope))
    for trajectory in trajectories:
        assert (trajectory.episode_id.attempt, trajectory.resume_count, trajectory.failovers) == (1, 1, 0)
    status = await controller.status()
    continued = sum(s.report.counts["continued"] for label, s in status.items() if label.startswith("agent/"))
    assert continued == len(committed["agent/simple"])
    return [outcome(t) for t in trajectories]


def kill_everything(stack: Any) -> None:
    """SIGKILL the launcher and every server at once: a power cut, not a shutdown."""
    from tests.resume.helpers import kill_all

    kill_all(stack)


def run_scenario(
    start: Callable[[dict[str, Any]], Any], run_dir: Path, before: dict[str, int], after: dict[str, int]
) -> None:
    """The whole scenario; `start(config)` starts a stack (local or Ray) and returns it."""
    root = run_dir / "checkpoints"
    first = start(config(before["agent/simple"], before["resources/counter"], before["model/policy"]))

    async def phase_one() -> tuple[list[Any], Path, list[EpisodeKey]]:
        async with Client(run_dir=run_dir) as client:
            return await checkpoint_mid_run(client, root)

    reference, folder, scope = asyncio.run(phase_one())
    committed = check_committed(folder, before)
    assert committed["agent/simple"] == scope  # every episode was parked and exported by its agent
    kill_everything(first)
    start(config(after["agent/simple"], after["resources/counter"], after["model/policy"]))

    async def phase_two() -> list[Any]:
        async with Client(run_dir=run_dir) as client:
            return await restore_and_continue(client, folder, scope, after, committed)

    assert asyncio.run(phase_two()) == reference
