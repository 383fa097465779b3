"""Coordinated checkpoints with the real agent: every server SIGKILLed mid-turn, restored, re-dispatched.

The stack is counter + blackjack resources, the scripted model (slowed by `token_delay` so
episodes are mid-generation when the checkpoint is taken) and one agent per environment,
all started with `await_restore`: the first controller call opens them, and the processes
the supervisor restarts after the kill admit nothing until they are restored.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from gymrpc.client import Client
from gymrpc.control import EpisodeKey, Kind, store
from gymrpc.controller import Controller
from gymrpc.errors import GymrpcError
from gymrpc.store import EpisodeCheckpoint
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2
from gymrpc.v1 import model_service_pb2 as model_pb
from gymrpc.v1 import resources_service_pb2 as res_pb
from tests.agent.fakes import blackjack_tasks, counter_tasks
from tests.control.test_process import outcome

COMMON = {"checkpoint_lease_grace": 5, "await_restore": True}
SERVERS = (
    "resources/counter",
    "resources/blackjack",
    "model/policy",
    "agent/counter",
    "agent/blackjack",
)


def config() -> dict[str, Any]:
    def agent(env: str) -> dict[str, Any]:
        return {
            "name": f"agent/{env}",
            "role": "agent",
            "args": {"resources": f"resources/{env}", "model": "model/policy", "call_timeout": 60, **COMMON},
        }

    return {
        "restart": {"max_restarts": 5, "window_seconds": 60, "backoff_seconds": 0.05},
        "servers": [
            {"name": "resources/counter", "role": "resources", "args": {"environment": "counter", **COMMON}},
            {"name": "resources/blackjack", "role": "resources", "args": {"environment": "blackjack", **COMMON}},
            {
                "name": "model/policy",
                "role": "model",
                "args": {
                    "policy": "counter",
                    "recorded": "env:blackjack",
                    "fallback": "<action>stand</action>",
                    "token_delay": 0.05,
                    **COMMON,
                },
            },
            agent("counter"),
            agent("blackjack"),
        ],
    }


def episodes(prefix: str) -> list[tuple[str, str, common_pb2.Task]]:
    """(agent, rollout id, task): three counter episodes and two blackjack hands."""
    counter = [("agent/counter", f"{prefix}-c{i}", t) for i, t in enumerate(counter_tasks()[:3])]
    jack = [("agent/blackjack", f"{prefix}-b{i}", t) for i, t in enumerate(blackjack_tasks(seed=11)[:2])]
    return [*counter, *jack]


async def run(client: Client, agent: str, rollout_id: str, task: common_pb2.Task, attempt: int = 0) -> Any:
    request = agent_pb.RunRequest(task=task, episode_id=common_pb2.EpisodeId(rollout_id=rollout_id, attempt=attempt))
    return (await client.agent(agent).Run(request, timeout=60)).trajectory


async def timed_run(client: Client, agent: str, rollout_id: str, task: common_pb2.Task) -> tuple[Any, float]:
    started = time.monotonic()
    trajectory = await run(client, agent, rollout_id, task)
    return trajectory, time.monotonic() - started


def restart_all(stack: Any) -> None:
    before = {n: stack.server(n)["restarts"] for n in SERVERS}
    for name in SERVERS:
        stack.kill(name)
    for name in SERVERS:
        stack.wait_for(name, lambda s, n=name: s["restarts"] > before[n] and s["state"] == "serving")


def agent_records(folder: Path) -> dict[EpisodeKey, EpisodeCheckpoint]:
    out = {}
    for name in ("agent/counter", "agent/blackjack"):
        for record in store.read_checkpoint(folder, Kind.AGENT, name)[1]:
            body = EpisodeCheckpoint()
            assert record.other.Unpack(body)
            out[EpisodeKey.of(record.episode_id)] = body
    return out


def bodies(folder: Path, kind: Kind, name: str) -> list[Any]:
    return [getattr(r, str(r.WhichOneof("body"))) for r in store.read_checkpoint(folder, kind, name)[1]]


def test_real_agents_checkpoint_mid_turn_sigkill_restore_and_continue(start_stack: Any, tmp_path: Path) -> None:
    stack = start_stack(config())
    root = tmp_path / "checkpoints"
    planned = episodes("ep")
    scope = [EpisodeKey(rid, 0) for _, rid, _ in planned]

    async def before_crash() -> tuple[list[Any], Path]:
        async with Client(run_dir=stack.run_dir) as client:
            controller = Controller(client)
            assert {m.kind for m in await controller.discover()} == {Kind.RESOURCES, Kind.MODEL, Kind.AGENT}
            status = await controller.status()
            assert all(s.details.get("awaiting_restore") == "true" for s in status.values())
            await controller.open()  # nothing to restore: open admission
            timed = await asyncio.gather(*(timed_run(client, *e) for e in episodes("ref")))
            reference = [outcome(t) for t, _ in timed]
            shortest = min(took for _, took in timed)
            running = [asyncio.ensure_future(run(client, *e)) for e in planned]
            await asyncio.sleep(shortest * 0.6)  # past the first turn, most of them inside a slow Generate
            assert not any(t.done() for t in running), f"the shortest episode took {shortest:.2f}s"
            result = await controller.checkpoint(root, episode_ids=scope, checkpoint_id="ckpt-1", stop=True)
            assert result.committed
            assert result.continued == scope
            assert not result.restarted
            for task in running:  # the collector's calls die with the stack
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            return reference, result.checkpoint_dir

    reference, folder = asyncio.run(before_crash())
    boundary = agent_records(folder)
    assert set(boundary) == set(scope)  # every episode was parked and exported by its agent
    model_records = store.read_checkpoint(folder, Kind.MODEL, "model/policy")[1]
    assert sum(len(r.model_episode.cuts) for r in model_records) > 0  # some were cut mid-generation
    restart_all(stack)

    async def after_crash() -> None:
        async with Client(run_dir=stack.run_dir) as client:
            controller = Controller(client)
            await controller.discover()
            # Nothing is admitted before the restore: the restarted processes await it.
            early = asyncio.ensure_future(run(client, *planned[0]))
            await asyncio.sleep(0.3)
            assert not early.done()
            replies = await controller.restore("restore-1", folder, scope)
            assert {EpisodeKey.of(e) for e in replies["agent/counter"].restored} == {
                e.next() for e in scope if "-c" in e.rollout_id
            }
            await controller.resume("restore-1")
            with pytest.raises(GymrpcError) as caught:  # the early call was of attempt 0: fenced once admitted
                await early
            assert caught.value.reason == "STALE_ATTEMPT"

            again = await controller.checkpoint(root, episode_ids=[e.next() for e in scope], checkpoint_id="ckpt-2")
            assert again.committed
            for member in controller.members:
                assert bodies(folder, member.kind, member.name) == bodies(
                    again.checkpoint_dir, member.kind, member.name
                ), member.name

            # Attempt 0 is refused everywhere.
            agent, rollout_id, task = planned[0]
            with pytest.raises(GymrpcError) as caught:
                await run(client, agent, rollout_id, task, attempt=0)
            assert caught.value.reason == "STALE_ATTEMPT"
            old = common_pb2.EpisodeId(rollout_id=rollout_id)
            session = boundary[scope[0]].session_id
            with pytest.raises(GymrpcError) as caught:
                await client.resources("resources/counter").Verify(
                    res_pb.VerifyRequest(session_id=session, episode_id=old), timeout=5
                )
            assert caught.value.reason == "STALE_ATTEMPT"
            generate = model_pb.GenerateRequest(request_id="stale", episode_id=old, messages=task.input)
            with pytest.raises(GymrpcError) as caught:
                await client.model("model/policy").Generate(generate, timeout=5)
            assert caught.value.reason == "STALE_ATTEMPT"

            # Re-dispatch as attempt 1: each continues from its boundary.
            started = time.monotonic()
            trajectories = await asyncio.gather(*(run(client, *e, attempt=1) for e in planned))
            assert time.monotonic() - started < 30
            assert [outcome(t) for t in trajectories] == reference
            new_model_calls = 0
            for (_, rollout_id, _), trajectory in zip(planned, trajectories, strict=True):
                record = boundary[EpisodeKey(rollout_id, 0)]
                assert trajectory.resume_count == 1
                assert trajectory.episode_id.attempt == 1
                # What happened before the boundary was not run again: the same records, latencies included.
                assert list(trajectory.model_calls[: record.step]) == list(record.model_calls)
                assert list(trajectory.tool_calls[: len(record.tool_calls)]) == list(record.tool_calls)
                new_model_calls += len(trajectory.model_calls) - record.step
            status = await controller.status()
            rows = sum(len(r.model_episode.rows) for r in model_records)
            # The model delivered each call exactly once across both processes: nothing repeated.
            assert status["model/policy"].report.counts["ledger_rows"] == rows + new_model_calls
            assert status["model/policy"].report.counts["restored_cuts"] == 0
            assert status["agent/counter"].report.counts["continued"] == 3
            assert status["agent/blackjack"].report.counts["continued"] == 2
            assert any(t.timing.parked.ToNanoseconds() > 0 for t in trajectories) or all(
                r.phase == agent_pb.EPISODE_PHASE_READY_FOR_MODEL for r in boundary.values()
            )

    asyncio.run(after_crash())
