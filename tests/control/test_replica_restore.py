"""Checkpoints of replicated participants, restored onto another replica count, in-process.

Each replica is a real `ControlPlane` over a real resources or model participant, called without
sockets: the replicas of a name commit into folders of their own, and a restore reads every
replica's records and installs each one only on the replica `gymrpc.balancing.place` names among
the new replicas, the one clients route the session's calls to.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import pytest

from gymrpc.balancing import place
from gymrpc.control import ControlPlane, EpisodeKey, Kind, Phase, store
from gymrpc.control.plane import Placement
from gymrpc.envs.counter import CounterEnvironment
from gymrpc.errors import DataLoss, InvalidArgument, NotFound, Unavailable
from gymrpc.servers.resources.participant import ResourcesParticipant, gate_servicer
from gymrpc.servers.resources.service import ResourcesServicer
from gymrpc.v1 import checkpoint_records_pb2 as rec_pb
from gymrpc.v1 import common_pb2
from gymrpc.v1 import resources_service_pb2 as res_pb
from tests.agent.fakes import counter_task
from tests.control.test_model import Episode, Model

NAME = "resources/counter"
EPISODES = [EpisodeKey(f"ep-{i}", 0) for i in range(12)]


def soon() -> float:
    return time.time() + 10


def session(episode: EpisodeKey) -> str:
    return f"{episode.rollout_id}-s"


class Replica:
    """One counter resources replica: servicer, participant and control plane."""

    def __init__(self, endpoint_id: str) -> None:
        self.servicer = ResourcesServicer(CounterEnvironment(), workers=1)
        self.participant = ResourcesParticipant(self.servicer)
        gate_servicer(self.servicer, self.participant)
        self.plane = ControlPlane(self.participant, name=NAME, endpoint_id=endpoint_id)
        self.plane.start()

    async def seed(self, episode: EpisodeKey, increments: int) -> None:
        request = res_pb.SeedSessionRequest(
            session_id=session(episode), episode_id=episode.to_pb(), task=counter_task("t", 0, increments)
        )
        await self.servicer.SeedSession(request, None)
        for i in range(increments):
            await self.call(episode, "increment_counter", {"count": 1}, f"c{i}")

    async def call(self, episode: EpisodeKey, tool: str, arguments: dict[str, Any], call_id: str) -> str:
        call = common_pb2.ToolCall(id=call_id, name=tool, arguments_json=json.dumps(arguments))
        request = res_pb.CallToolRequest(session_id=session(episode), episode_id=episode.to_pb(), call=call)
        return (await self.servicer.CallTool(request, None)).output

    async def close(self) -> None:
        await self.plane.close()
        self.servicer.host.shutdown()


async def checkpoint(
    planes: list[ControlPlane], root: Path, checkpoint_id: str = "c1", scope: list[EpisodeKey] = EPISODES
) -> None:
    for plane in planes:
        assert (await plane.prepare(checkpoint_id, soon()))[0] is Phase.PREPARED
    await asyncio.gather(*(p.commit(checkpoint_id, soon(), str(root), frozenset(scope)) for p in planes))


async def committed_replicas(root: Path) -> list[Replica]:
    """Two replicas; each episode's session on the one its id is placed on (as clients route it),
    with `index + 1` increments; checkpointed into `root`."""
    old = [Replica("0"), Replica("1")]
    for i, episode in enumerate(EPISODES):
        await old[int(place(session(episode), ["0", "1"]))].seed(episode, i % 4 + 1)
    await checkpoint([r.plane for r in old], root)
    return old


def test_replicas_commit_into_folders_of_their_own(tmp_path: Path) -> None:
    async def main() -> None:
        old = await committed_replicas(tmp_path)
        assert store.replica_ids(tmp_path, Kind.RESOURCES, NAME) == ["0", "1"]
        assert (tmp_path / "resources" / "counter" / store.MANIFEST).is_file()  # replica 0: the layout of one
        seen = []
        for endpoint_id in ("0", "1"):
            manifest, records = store.read_checkpoint(tmp_path, Kind.RESOURCES, NAME, endpoint_id)
            assert (manifest.name, manifest.endpoint_id) == (NAME, endpoint_id)
            assert all(place(r.resources_session.session_id, ["0", "1"]) == endpoint_id for r in records)
            seen += [EpisodeKey.of(r.episode_id) for r in records]
        assert sorted(seen) == sorted(EPISODES)
        # A manifest read as another replica's is damage, not a checkpoint of that replica.
        (tmp_path / "resources" / "counter#2").symlink_to(tmp_path / "resources" / "counter#1")
        with pytest.raises(DataLoss, match="belongs to replica '1'"):
            store.read_checkpoint(tmp_path, Kind.RESOURCES, NAME, "2")
        for replica in old:
            await replica.close()

    asyncio.run(main())


@pytest.mark.parametrize("count", [1, 3])
def test_a_restore_onto_another_replica_count_installs_each_session_once_where_it_is_placed(
    tmp_path: Path, count: int
) -> None:
    async def main() -> None:
        for replica in await committed_replicas(tmp_path):
            await replica.close()
        ids = [str(i) for i in range(count)]
        new = [Replica(i) for i in ids]
        replies = await asyncio.gather(
            *(
                r.plane.restore(
                    "r1", soon(), str(tmp_path), EPISODES, Placement(sources=("0", "1"), replicas=tuple(ids), target=i)
                )
                for i, r in zip(ids, new, strict=True)
            )
        )
        for endpoint_id, (source, restored) in zip(ids, replies, strict=True):
            assert source == "c1"
            assert restored == sorted(e.next() for e in EPISODES if place(session(e), ids) == endpoint_id)
        assert sorted(e for _, restored in replies for e in restored) == sorted(e.next() for e in EPISODES)
        for replica in new:
            await replica.plane.resume("r1")
        for i, episode in enumerate(EPISODES):
            replica = new[int(place(session(episode), ids))]
            output = await replica.call(episode.next(), "get_counter_value", {}, "read")
            assert json.loads(output)["count"] == i % 4 + 1, episode
            assert set(replica.servicer.host.live()) >= {session(episode)}
        for replica in new:
            await replica.close()

    asyncio.run(main())


def test_a_restore_refuses_a_stale_address_a_foreign_replica_set_and_mixed_checkpoints(tmp_path: Path) -> None:
    async def main() -> None:
        for replica in await committed_replicas(tmp_path / "one"):
            await replica.close()
        fresh = Replica("1")
        both = Placement(sources=("0", "1"), replicas=("0", "1"))
        for placement, error, text in [
            (Placement(sources=("0", "1"), replicas=("0", "1"), target="0"), Unavailable, "stale"),
            (Placement(sources=("0", "1"), replicas=("0", "2")), InvalidArgument, "leave out this replica"),
            (Placement(sources=("0", "../x")), InvalidArgument, "invalid endpoint id"),
            (Placement(sources=("0", "1", "5")), NotFound, "counter#5 holds no manifest"),
        ]:
            with pytest.raises(error, match=text):
                await fresh.plane.restore("r1", soon(), str(tmp_path / "one"), EPISODES, placement)
        # Replica folders of two different checkpoints are not one checkpoint.
        other = Replica("1")
        await other.seed(EPISODES[0], 1)
        await checkpoint([other.plane], tmp_path / "one" / "mixed", "c2")
        (tmp_path / "one" / "mixed" / "resources" / "counter").symlink_to(tmp_path / "one" / "resources" / "counter")
        with pytest.raises(DataLoss, match="holds checkpoint 'c2'"):
            await fresh.plane.restore("r1", soon(), str(tmp_path / "one" / "mixed"), EPISODES, both)
        assert fresh.participant.not_fresh() is None  # nothing was installed
        _, restored = await fresh.plane.restore("r1", soon(), str(tmp_path / "one"), EPISODES, both)
        assert restored == sorted(e.next() for e in EPISODES if place(session(e), ["0", "1"]) == "1")
        for replica in (fresh, other):
            await replica.close()

    asyncio.run(main())


def test_model_replicas_merge_their_ledgers_and_place_each_episode_where_generate_goes(tmp_path: Path) -> None:
    """Each model replica exports a record per episode of the scope (most of them empty); a restore
    merges them, and every delivered row lands once, on the replica of the episode's rollout id."""

    async def main() -> None:
        old = [Model(), Model()]
        for i, model in enumerate(old):
            assert model.plane is not None
            model.plane = ControlPlane(model.participant, name="model/policy", endpoint_id=str(i))  # type: ignore[arg-type]
        scope = [EpisodeKey(f"m-{i}", 0) for i in range(6)]
        rows = {}
        for key in scope:
            model, episode = old[int(place(key.rollout_id, ["0", "1"]))], Episode()
            for step in range(2):
                episode.apply(await model.generate(episode.messages, key.rollout_id, 0, step))
            rows[key] = 2
        await checkpoint([m.plane for m in old if m.plane is not None], tmp_path, scope=scope)
        for model in old:
            _, records = store.read_checkpoint(tmp_path, Kind.MODEL, "model/policy", model.plane.endpoint_id)  # type: ignore[union-attr]
            assert sorted(EpisodeKey.of(r.episode_id) for r in records) == sorted(scope)  # the whole commit scope
            await model.close()

        ids = ["0", "1", "2"]
        new = [Model() for _ in ids]
        for i, model in zip(ids, new, strict=True):
            model.plane = ControlPlane(model.participant, name="model/policy", endpoint_id=i)  # type: ignore[arg-type]
        placement = {i: Placement(sources=("0", "1"), replicas=tuple(ids), target=i) for i in ids}
        replies = [
            await m.plane.restore("r1", soon(), str(tmp_path), scope, placement[i])  # type: ignore[union-attr]
            for i, m in zip(ids, new, strict=True)
        ]
        for i, model, (_, restored) in zip(ids, new, replies, strict=True):
            mine = [k for k in scope if place(k.rollout_id, ids) == i]
            assert restored == sorted(k.next() for k in mine)
            assert model.participant is not None
            assert len(model.participant.ledger) == sum(rows[k] for k in mine)  # every row once, nothing lost
            await model.close()

    asyncio.run(main())


def test_placement_keys_are_the_affinity_keys_clients_route_by() -> None:
    """A resources session by its session id (not its rollout id), everything else by rollout id."""

    async def main() -> None:
        replica, model = Replica("0"), Model()
        record = rec_pb.CheckpointRecord(episode_id=EPISODES[0].to_pb())
        record.resources_session.session_id = "elsewhere"
        assert replica.participant.placement_key(record) == "elsewhere"
        assert replica.participant.placement_key(rec_pb.CheckpointRecord(episode_id=EPISODES[0].to_pb())) is None
        assert model.participant is not None
        assert model.participant.placement_key(record) == EPISODES[0].rollout_id
        await replica.close()
        await model.close()

    asyncio.run(main())


def test_placement_is_the_documented_hash_whatever_the_order_and_spreads() -> None:
    """Controllers and clients in other languages compute `place` from `RestoreRequest.endpoint_ids`' comment."""

    def documented(key: str, ids: list[str]) -> str:
        digest = {
            i: int.from_bytes(hashlib.blake2b(f"{key}\0{i}".encode(), digest_size=8).digest(), "big") for i in ids
        }
        return max(ids, key=digest.__getitem__)

    counts = dict.fromkeys("012", 0)
    for i in range(300):
        key = f"session-{i}"
        chosen = place(key, ["0", "1", "2"])
        assert chosen == place(key, ["2", "0", "1"]) == documented(key, ["0", "1", "2"])
        counts[chosen] += 1
    assert min(counts.values()) > 60, counts
