"""Equivalence under crash, per-session snapshot path, through real processes.

Seed, three state-changing calls, `CheckpointSession`, SIGKILL the resources server,
`RestoreSession` into the fresh process the supervisor started, four more calls, verify:
every tool output, every table and the reward must equal an uninterrupted run. The same
test with a restore that loses NaN (tests/workplace/broken_env.py) must see differences,
which proves the check can fail. A corrupt snapshot is refused with DATA_LOSS.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gymrpc.client import Client
from gymrpc.errors import DataLoss, NotFound
from gymrpc.v1 import common_pb2
from gymrpc.v1 import resources_service_pb2 as pb
from tests.workplace.scenario import EpisodeRecord, differences, run_episode

NAME = "resources/workplace"
BROKEN = "tests.workplace.broken_env:NanLosingWorkplaceEnvironment"


def _stack(environment: str) -> dict[str, Any]:
    return {"servers": [{"name": NAME, "role": "resources", "args": {"environment": environment}}]}


async def _scenario(stack: Any) -> tuple[EpisodeRecord, EpisodeRecord]:
    async with Client(run_dir=stack.run_dir) as client:
        resources = client.resources(NAME)
        baseline = await run_episode(resources, "plain", common_pb2.EpisodeId(rollout_id="plain"))
        episode = common_pb2.EpisodeId(rollout_id="crash")

        async def checkpoint_kill_restore() -> None:
            request = pb.CheckpointSessionRequest(session_id="crash", episode_id=episode)
            snapshot = (await resources.CheckpointSession(request)).snapshot
            pid = stack.kill(NAME)
            await asyncio.to_thread(
                stack.wait_for, NAME, lambda s: s["state"] == "serving" and s["pid"] not in (None, pid)
            )
            with pytest.raises(NotFound):  # the fresh process has never seen the session
                await resources.CheckpointSession(request)
            corrupt = common_pb2.SessionSnapshot()
            corrupt.CopyFrom(snapshot)
            corrupt.payload = snapshot.payload[:-1] + bytes([snapshot.payload[-1] ^ 1])
            with pytest.raises(DataLoss):
                await resources.RestoreSession(
                    pb.RestoreSessionRequest(session_id="crash", episode_id=episode, snapshot=corrupt)
                )
            with pytest.raises(NotFound):  # and the refused restore installed nothing
                await resources.CheckpointSession(request)
            await resources.RestoreSession(
                pb.RestoreSessionRequest(session_id="crash", episode_id=episode, snapshot=snapshot)
            )

        crashed = await run_episode(resources, "crash", episode, checkpoint_kill_restore)
        return baseline, crashed


def test_restored_session_equals_an_uninterrupted_run(start_stack: Any) -> None:
    baseline, crashed = asyncio.run(_scenario(start_stack(_stack("workplace"))))
    assert baseline.reward == 1.0, baseline.details
    assert len(baseline.tables) == 7
    assert differences(baseline, crashed) == []


def test_a_codec_that_loses_nan_fails_the_equivalence_check(start_stack: Any) -> None:
    baseline, crashed = asyncio.run(_scenario(start_stack(_stack(BROKEN))))
    assert baseline.reward == 1.0, baseline.details
    problems = differences(baseline, crashed)
    assert "table customer_relationship_manager._crm_data differs" in problems
    assert "reward 1.0 vs 0.0" in problems  # live verification sees the damaged CRM table
    assert crashed.details["replay_match"] is True  # the reference's reward alone would not have
