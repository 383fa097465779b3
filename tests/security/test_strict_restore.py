"""A restore is all or nothing: an episode the checkpoint does not hold, or an attempt out of range,
refuses the whole Restore and leaves every participant as it was.

Real model and resources server processes take raw Restores (the controller's own check is not in
the way); an in-process deployment takes them through `Controller.restore`. Afterwards each
participant is idle, open, unfenced, holds nothing, and the same processes take the good restore.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from gymrpc.control import EpisodeKey
from gymrpc.errors import InvalidArgument, NotFound
from gymrpc.v1 import common_pb2
from gymrpc.v1 import participant_service_pb2 as pb
from gymrpc.v1 import participant_service_pb2_grpc as pb_grpc
from tests.control.deployment import Deployment
from tests.control.test_bad_input import E0, E1, NAMES, committed, restore_request, state, tree
from tests.security.helpers import CONTROL, ServerProcess, channel, comparable, participant_status, refused

GHOST = common_pb2.EpisodeId(rollout_id="ghost", attempt=0)


def test_raw_restores_of_episodes_the_checkpoint_does_not_hold_are_not_found(tmp_path: Path) -> None:
    folder = asyncio.run(committed(tmp_path / "ckpt"))
    servers = [
        ServerProcess("gymrpc.servers.resources", "resources/r", ["--environment", "counter"], tmp_path / "r"),
        ServerProcess("gymrpc.servers.model", "model/m", ["--policy", "counter"], tmp_path / "m"),
    ]

    async def main() -> None:
        for server in servers:
            async with channel(server.address) as ch:
                stub = pb_grpc.ParticipantServiceStub(ch)
                before, files = comparable(await participant_status(server.address)), tree(tmp_path / "ckpt")
                for episodes in (
                    [E0.to_pb(), GHOST],
                    [GHOST],
                    [E1.to_pb(), common_pb2.EpisodeId(rollout_id="e0", attempt=7)],
                ):
                    await refused(
                        stub.Restore(restore_request(folder, episodes=episodes), timeout=30, metadata=CONTROL),
                        grpc.StatusCode.NOT_FOUND,
                        "NOT_FOUND",
                        says="holds no episode",
                    )
                    assert comparable(await participant_status(server.address)) == before
                    assert tree(tmp_path / "ckpt") == files
                reply = await stub.Restore(restore_request(folder, "good"), timeout=30, metadata=CONTROL)
                assert reply.phase == pb.PARTICIPANT_PHASE_RESTORED

    try:
        asyncio.run(main())
    finally:
        for server in servers:
            server.stop()


def test_controller_restores_are_refused_whole_and_change_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        folder = await committed(tmp_path / "ckpt")
        fresh = await Deployment.start(NAMES)
        try:
            before, files = await state(fresh), tree(tmp_path)
            for episodes, error, says in [
                ([E0, E1, EpisodeKey("ghost", 0)], NotFound, "holds no episode ghost/a0"),
                ([E0, EpisodeKey("e1", 2**32 - 1)], InvalidArgument, "episode_ids[1].attempt"),
            ]:
                with pytest.raises(error, match=says.replace("[", r"\[").replace("]", r"\]")):
                    await fresh.controller.restore("bad", folder, episodes)
                assert await state(fresh) == before
                assert tree(tmp_path) == files
                assert all(not s.retired for s in (await fresh.statuses()).values())
            replies = await fresh.controller.restore("good", folder, [E0, E1])
            assert {EpisodeKey.of(e) for e in replies["agent/a"].restored} == {E0.next(), E1.next()}
            await fresh.controller.resume("good")
        finally:
            await fresh.close()

    asyncio.run(main())
