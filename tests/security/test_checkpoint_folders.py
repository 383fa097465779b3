"""Two servers of one kind whose names share the instance (`resources/x`, `tools/x`) checkpoint side by side.

Real resources server processes under both names hold a session each; a coordinated checkpoint
commits both (it used to fail with CHECKPOINT_CONFLICT: both wrote `resources/x`), in
`resources/x` and `resources/tools%2Fx`, and restores into fresh processes. A checkpoint in the
old layout (`tools/x` kept under `resources/x`, its index listing that path) still restores.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from gymrpc.control import EpisodeKey, store
from gymrpc.control.index import INDEX
from gymrpc.control.types import Kind
from gymrpc.controller import Controller
from gymrpc.v1 import resources_service_pb2 as res_pb
from tests.agent.fakes import counter_task
from tests.control.deployment import DirectClient
from tests.security.helpers import ServerProcess

NAMES = ("resources/x", "tools/x")
EPISODES = {"resources/x": EpisodeKey("ep-r", 0), "tools/x": EpisodeKey("ep-t", 0)}


@dataclass
class Address:
    """What `DirectClient` needs of a node."""

    address: str


def start(names: tuple[str, ...], folder: Path) -> dict[str, ServerProcess]:
    return {
        name: ServerProcess(
            "gymrpc.servers.resources", name, ["--environment", "counter"], folder / name.replace("/", "_")
        )
        for name in names
    }


async def seeded(servers: dict[str, ServerProcess]) -> tuple[DirectClient, Controller]:
    client = DirectClient({n: Address(s.address) for n, s in servers.items()})  # type: ignore[misc]
    for name in servers:
        episode = EPISODES[name]
        request = res_pb.SeedSessionRequest(
            session_id=episode.rollout_id, episode_id=episode.to_pb(), task=counter_task("count", 0, 3)
        )
        await client.resources(name).SeedSession(request, timeout=30)
    controller = Controller(client, names=sorted(servers))  # type: ignore[arg-type]
    await controller.discover()
    return client, controller


async def restored(servers: dict[str, ServerProcess], folder: Path) -> dict[str, list[EpisodeKey]]:
    client = DirectClient({n: Address(s.address) for n, s in servers.items()})  # type: ignore[misc]
    controller = Controller(client, names=sorted(servers))  # type: ignore[arg-type]
    try:
        await controller.discover()
        episodes = [EPISODES[n] for n in servers]
        replies = await controller.restore("r1", folder, episodes)
        await controller.resume("r1")
        return {n: sorted(EpisodeKey.of(e) for e in r.restored) for n, r in replies.items()}
    finally:
        await client.close()


def stop(servers: dict[str, ServerProcess]) -> None:
    for server in servers.values():
        server.stop()


def test_names_sharing_an_instance_checkpoint_and_restore_side_by_side(tmp_path: Path) -> None:
    servers = start(NAMES, tmp_path / "run1")
    try:

        async def checkpoint() -> Path:
            client, controller = await seeded(servers)
            try:
                result = await controller.checkpoint(tmp_path / "ckpt", episode_ids=list(EPISODES.values()))
                assert result.committed
                return result.checkpoint_dir
            finally:
                await client.close()

        folder = asyncio.run(checkpoint())
    finally:
        stop(servers)
    assert (folder / "resources" / "x" / store.MANIFEST).is_file()
    assert (folder / "resources" / "tools%2Fx" / store.MANIFEST).is_file()
    fresh = start(NAMES, tmp_path / "run2")
    try:
        replies = asyncio.run(restored(fresh, folder))
        assert replies == {n: [EPISODES[n].next()] for n in NAMES}
    finally:
        stop(fresh)


def test_a_checkpoint_in_the_old_layout_still_restores(tmp_path: Path) -> None:
    servers = start(("tools/x",), tmp_path / "run1")
    try:

        async def checkpoint() -> Path:
            client, controller = await seeded(servers)
            try:
                result = await controller.checkpoint(tmp_path / "ckpt", episode_ids=[EPISODES["tools/x"]])
                return result.checkpoint_dir
            finally:
                await client.close()

        folder = asyncio.run(checkpoint())
    finally:
        stop(servers)
    # Rewrite it as the old layout wrote it: `tools/x` under `resources/x`, and the index saying so.
    (folder / "resources" / "tools%2Fx").rename(folder / "resources" / "x")
    index = json.loads((folder / INDEX).read_text())
    [member] = index["members"]
    assert member["manifest_path"] == "resources/tools%2Fx/manifest.json"
    member["manifest_path"] = "resources/x/manifest.json"
    (folder / INDEX).write_text(json.dumps(index))
    assert store.replica_ids(folder, Kind.RESOURCES, "tools/x") == ["0"]
    assert store.replica_ids(folder, Kind.RESOURCES, "resources/x") == []  # that folder is not its
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    fresh = start(("tools/x",), tmp_path / "run2")
    try:
        assert asyncio.run(restored(fresh, copy)) == {"tools/x": [EPISODES["tools/x"].next()]}
    finally:
        stop(fresh)
