"""Equivalence under crash through real processes, in both recovery modes.

Seed, three state-changing calls, checkpoint, SIGKILL the resources server, restore into
the fresh process the supervisor started, four more calls, verify: every tool output, every
table and the reward must equal an uninterrupted run.

- `session` (mode A): `CheckpointSession` / `RestoreSession` of one self-contained payload;
  a corrupt snapshot is refused with DATA_LOSS.
- `coordinated` (mode B): a `Controller` checkpoint (manifests plus shared table blocks in
  one records file), a server started with `--await-restore`, `Controller.restore` as the
  next attempt; the checkpointed attempt is fenced afterwards.

The same test with a restore that loses NaN (tests/workplace/broken_env.py) must see
differences in both modes, which proves the check can fail.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from gymrpc.client import Client
from gymrpc.control import EpisodeKey, Kind, store
from gymrpc.controller import Controller
from gymrpc.envs.workplace_assistant._data import seed_blocks
from gymrpc.errors import DataLoss, GymrpcError, NotFound
from gymrpc.snapshots import delta_base
from gymrpc.v1 import common_pb2
from gymrpc.v1 import resources_service_pb2 as pb
from tests.workplace.scenario import EpisodeRecord, differences, run_episode

NAME = "resources/workplace"
BROKEN = "tests.workplace.broken_env:NanLosingWorkplaceEnvironment"
MODES = ("session", "coordinated")
Between = Callable[[], Awaitable[common_pb2.EpisodeId]]


def _stack(environment: str, mode: str) -> dict[str, Any]:
    args: dict[str, Any] = {"environment": environment}
    if mode == "coordinated":  # a restarted process admits nothing until it is restored
        args |= {"await_restore": True, "checkpoint_lease_grace": 5}
    return {"servers": [{"name": NAME, "role": "resources", "args": args}]}


async def _wait_restarted(stack: Any, pid: int) -> None:
    await asyncio.to_thread(stack.wait_for, NAME, lambda s: s["state"] == "serving" and s["pid"] not in (None, pid))


def _per_session(stack: Any, resources: Any, episode: common_pb2.EpisodeId) -> Between:
    async def checkpoint_kill_restore() -> common_pb2.EpisodeId:
        request = pb.CheckpointSessionRequest(session_id="crash", episode_id=episode)
        snapshot = (await resources.CheckpointSession(request)).snapshot
        await _wait_restarted(stack, stack.kill(NAME))
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
        return episode

    return checkpoint_kill_restore


def _coordinated(
    stack: Any, resources: Any, controller: Controller, episode: common_pb2.EpisodeId, root: Path
) -> Between:
    async def checkpoint_kill_restore() -> common_pb2.EpisodeId:
        checkpointed = EpisodeKey.of(episode)
        result = await controller.checkpoint(root, episode_ids=[checkpointed])
        assert result.committed
        assert result.continued == [checkpointed]
        records = store.read_checkpoint(result.checkpoint_dir, Kind.RESOURCES, NAME)[1]
        assert [r.resources_session.session_id for r in records if r.HasField("resources_session")] == ["crash"]
        blocks = {r.table_block.sha256: r.table_block.data for r in records if r.HasField("table_block")}
        seed = {digest for digest, _ in seed_blocks().values()}
        changed = set(blocks) - seed
        assert len(changed) == 3  # the three tables BEFORE changed
        bases = {delta_base(blocks[d]) for d in changed} - {None}
        assert bases <= set(blocks) & seed, "a row delta's seed block is stored with it"
        assert len(blocks) == 7 + len(bases)  # four untouched seed blocks, and the bases of the deltas
        await _wait_restarted(stack, stack.kill(NAME))
        restored = await controller.restore("restore-1", result.checkpoint_dir, result.continued)
        assert [EpisodeKey.of(e) for e in restored[NAME].restored] == [checkpointed.next()]
        await controller.resume("restore-1")
        with pytest.raises(GymrpcError) as caught:  # the checkpointed attempt is fenced
            await resources.Verify(pb.VerifyRequest(session_id="crash", episode_id=episode))
        assert caught.value.reason == "STALE_ATTEMPT"
        return checkpointed.next().to_pb()

    return checkpoint_kill_restore


async def _scenario(stack: Any, mode: str, root: Path) -> tuple[EpisodeRecord, EpisodeRecord]:
    async with Client(run_dir=stack.run_dir) as client:
        resources = client.resources(NAME)
        controller = Controller(client)
        if mode == "coordinated":
            await controller.open()  # started with --await-restore, and there is nothing to restore
        baseline = await run_episode(resources, "plain", common_pb2.EpisodeId(rollout_id="plain"))
        episode = common_pb2.EpisodeId(rollout_id="crash")
        if mode == "session":
            between = _per_session(stack, resources, episode)
        else:
            between = _coordinated(stack, resources, controller, episode, root)
        crashed = await run_episode(resources, "crash", episode, between)
        return baseline, crashed


@pytest.mark.parametrize("mode", MODES)
def test_restored_session_equals_an_uninterrupted_run(start_stack: Any, tmp_path: Path, mode: str) -> None:
    baseline, crashed = asyncio.run(_scenario(start_stack(_stack("workplace", mode)), mode, tmp_path))
    assert baseline.reward == 1.0, baseline.details
    assert len(baseline.tables) == 7
    assert differences(baseline, crashed) == []


@pytest.mark.parametrize("mode", MODES)
def test_a_codec_that_loses_nan_fails_the_equivalence_check(start_stack: Any, tmp_path: Path, mode: str) -> None:
    baseline, crashed = asyncio.run(_scenario(start_stack(_stack(BROKEN, mode)), mode, tmp_path))
    assert baseline.reward == 1.0, baseline.details
    problems = differences(baseline, crashed)
    assert "table customer_relationship_manager._crm_data differs" in problems
    assert "reward 1.0 vs 0.0" in problems  # live verification sees the damaged CRM table
    assert crashed.details["replay_match"] is True  # the reference's reward alone would not have
