"""Coordinated checkpoints of Workplace sessions in-process: shared blocks, all-or-nothing restore, retire, verify.

The resources participant stores a table environment's sessions as one manifest record each
plus every distinct table block once (`table_block` records of the same records file). The
servicer, participant and control plane run in this process without sockets, so each test
can look at the host's sessions directly; tests/workplace/test_crash.py does the same
through real processes and a SIGKILL.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from gymrpc.balancing import place
from gymrpc.control import ControlPlane, EpisodeKey, Kind, Phase, store
from gymrpc.control.plane import Placement
from gymrpc.envkit import Environment
from gymrpc.envs.workplace_assistant import WorkplaceEnvironment
from gymrpc.envs.workplace_assistant._data import TABLE_NAMES, seed_blocks
from gymrpc.errors import DataLoss, GymrpcError, NotFound
from gymrpc.servers.resources.participant import ResourcesParticipant, gate_servicer
from gymrpc.servers.resources.service import SNAPSHOT_PROTOCOL_VERSION, ResourcesServicer
from gymrpc.snapshots import frame_differences
from gymrpc.v1 import checkpoint_records_pb2 as rec_pb
from gymrpc.v1 import common_pb2
from gymrpc.v1 import resources_service_pb2 as pb
from tests.workplace.broken_env import FailingVerifyWorkplaceEnvironment
from tests.workplace.scenario import AFTER, BEFORE, Call, call_tools, task

NAME = "resources/workplace"
CALENDAR = "calendar._calendar_events"
CRM = "customer_relationship_manager._crm_data"


def soon() -> float:
    return time.time() + 30


def ep(rollout: str, attempt: int = 0) -> common_pb2.EpisodeId:
    return common_pb2.EpisodeId(rollout_id=rollout, attempt=attempt)


class _Direct:
    """The servicer as `scenario.call_tools` calls a stub: `await resources.Method(request)`."""

    def __init__(self, servicer: ResourcesServicer) -> None:
        self._servicer = servicer

    def __getattr__(self, method: str) -> Any:
        return lambda request: getattr(self._servicer, method)(request, None)


class Server:
    """A Workplace resources servicer with its participant and control plane; session id = rollout id."""

    def __init__(self, environment: Environment | None = None, endpoint_id: str = "0") -> None:
        self.servicer = ResourcesServicer(environment or WorkplaceEnvironment(), workers=2)
        self.participant = ResourcesParticipant(self.servicer)
        gate_servicer(self.servicer, self.participant)
        self.plane = ControlPlane(self.participant, name=NAME, endpoint_id=endpoint_id)
        self.plane.start()

    async def seed(self, rollout: str, task_id: str = "crash-scenario") -> None:
        request = pb.SeedSessionRequest(session_id=rollout, episode_id=ep(rollout), task=task(task_id=task_id))
        await self.servicer.SeedSession(request, None)

    async def call(self, rollout: str, calls: list[Call], attempt: int = 0, first: int = 0) -> list[str]:
        return await call_tools(_Direct(self.servicer), rollout, ep(rollout, attempt), calls, first)

    async def verify(self, rollout: str, attempt: int = 0) -> pb.VerifyResponse:
        return await self.servicer.Verify(pb.VerifyRequest(session_id=rollout, episode_id=ep(rollout, attempt)), None)

    def tables(self, rollout: str) -> Any:
        return self.servicer.host.live()[rollout].session.tables

    async def checkpoint(self, root: Path, checkpoint_id: str = "c1", scope: Any = None) -> Any:
        phase, report = await self.plane.prepare(checkpoint_id, soon())
        assert phase is Phase.PREPARED, report
        manifest = await self.plane.commit(checkpoint_id, soon(), str(root), scope)
        await self.plane.resume(checkpoint_id)
        return manifest

    async def restore(self, root: Path, rollouts: Sequence[str]) -> list[EpisodeKey]:
        _, restored = await self.plane.restore("x1", soon(), str(root), [EpisodeKey(r, 0) for r in rollouts])
        await self.plane.resume("x1")
        return restored

    async def close(self) -> None:
        await self.plane.close()
        self.servicer.host.shutdown()


def records(root: Path) -> list[rec_pb.CheckpointRecord]:
    return store.read_checkpoint(root, Kind.RESOURCES, NAME)[1]


def sessions_in(root: Path) -> list[str]:
    return [r.resources_session.session_id for r in records(root) if r.HasField("resources_session")]


def blocks_in(root: Path) -> list[str]:
    return [r.table_block.sha256 for r in records(root) if r.HasField("table_block")]


def reseal(records: list[rec_pb.CheckpointRecord], root: Path) -> None:
    """Write `records` as a committed checkpoint whose records file and manifest agree (only the blocks lie)."""
    store.write_checkpoint(root, Kind.RESOURCES, NAME, "c9", records, store.WriteStop())


def test_untouched_sessions_share_their_blocks(tmp_path: Path) -> None:
    sessions = 100

    async def main() -> None:
        server = Server()
        ids = [f"r{i:03}" for i in range(sessions)]
        for rollout in ids:
            await server.seed(rollout)
        one = server.servicer.host.live()["r000"].session
        full = len(one.export())  # one session's self-contained payload: every table's block
        own = len(one.export_tables().manifest.to_json())  # its manifest: block names plus task and ground truth
        manifest = await server.checkpoint(tmp_path / "one")
        assert sorted(sessions_in(tmp_path / "one")) == ids
        assert sorted(blocks_in(tmp_path / "one")) == sorted(d for d, _ in seed_blocks().values())  # each once
        assert manifest.record_count == sessions + len(TABLE_NAMES)
        assert manifest.size_bytes < sessions * full / 25, (manifest.size_bytes, full)
        assert (manifest.size_bytes - full) / sessions < own + 200  # an untouched session: its manifest, little more

        await server.call("r007", BEFORE[:1])  # one table of one session changes: one block more
        again = await server.checkpoint(tmp_path / "two", "c2")
        assert len(blocks_in(tmp_path / "two")) == len(TABLE_NAMES) + 1
        assert again.size_bytes - manifest.size_bytes < 20_000

        fresh = Server()
        assert await fresh.restore(tmp_path / "two", ids) == [EpisodeKey(r, 1) for r in ids]
        for rollout in ("r006", "r007"):
            for name in TABLE_NAMES:
                assert frame_differences(server.tables(rollout).get(name), fresh.tables(rollout).get(name)) == []
        await fresh.call("r008", BEFORE[:1], attempt=1)  # sessions that shared a block stay independent
        assert len(fresh.tables("r008").get(CALENDAR)) == len(fresh.tables("r009").get(CALENDAR)) + 1
        for each in (server, fresh):
            await each.close()

    asyncio.run(main())


def test_a_restore_of_some_sessions_keeps_blocks_filed_under_other_episodes(tmp_path: Path) -> None:
    async def main() -> None:
        server = Server()
        for rollout in ("a", "b"):
            await server.seed(rollout)
        expected = await server.call("b", BEFORE)
        await server.checkpoint(tmp_path)
        filed = {r.episode_id.rollout_id for r in records(tmp_path) if r.HasField("table_block")}
        assert "a" in filed  # the seed blocks b shares are filed under a, which this restore leaves out
        fresh = Server()
        assert await fresh.restore(tmp_path, ["b"]) == [EpisodeKey("b", 1)]
        assert set(fresh.servicer.host.live()) == {"b"}
        assert await fresh.call("b", BEFORE, attempt=1) == expected  # cached replies, not run twice
        assert await fresh.verify("b", attempt=1) == await server.verify("b")  # every table's fingerprint
        for each in (server, fresh):
            await each.close()

    asyncio.run(main())


def test_a_restore_onto_two_replicas_gives_both_the_shared_blocks(tmp_path: Path) -> None:
    """Each session lands on the replica its calls are routed to; the blocks it names go everywhere."""

    async def main() -> None:
        server = Server()
        ids = [f"s{i}" for i in range(8)]
        for rollout in ids:
            await server.seed(rollout)
            await server.call(rollout, BEFORE[:1])
        await server.checkpoint(tmp_path)
        replicas = {i: Server(endpoint_id=i) for i in ("0", "1")}
        for i, replica in replicas.items():
            placement = Placement(sources=("0",), replicas=("0", "1"), target=i)
            await replica.plane.restore("x1", soon(), str(tmp_path), [EpisodeKey(r, 0) for r in ids], placement)
            await replica.plane.resume("x1")
        for i, replica in replicas.items():
            live = set(replica.servicer.host.live())
            assert live == {r for r in ids if place(r, ["0", "1"]) == i}
            assert live  # both replicas got sessions, and so needed the blocks filed under the other's episodes
            for rollout in live:
                assert (
                    frame_differences(server.tables(rollout).get(CALENDAR), replica.tables(rollout).get(CALENDAR)) == []
                )
        for each in (server, *replicas.values()):
            await each.close()

    asyncio.run(main())


@pytest.mark.parametrize("damage", ["corrupt_block", "missing_block", "flipped_byte"])
def test_a_damaged_block_installs_no_session(tmp_path: Path, damage: str) -> None:
    async def main() -> None:
        server = Server()
        for rollout in ("good", "bad"):
            await server.seed(rollout)
        await server.call("bad", BEFORE[1:2])  # its CRM table gets a block no other session has
        await server.checkpoint(tmp_path / "ok")
        kept = records(tmp_path / "ok")
        seed = {d for d, _ in seed_blocks().values()}
        (own,) = [i for i, r in enumerate(kept) if r.HasField("table_block") and r.table_block.sha256 not in seed]
        damaged = tmp_path / "damaged"
        if damage == "corrupt_block":
            data = kept[own].table_block.data
            kept[own].table_block.data = data[:-1] + bytes([data[-1] ^ 1])
            reseal(kept, damaged)
        elif damage == "missing_block":
            del kept[own]
            reseal(kept, damaged)
        else:  # damage the file itself: the manifest's sha256 no longer matches
            reseal(kept, damaged)
            (path,) = (damaged / "resources" / "workplace").glob("records-*.bin")
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 1
            path.write_bytes(bytes(data))

        fresh = Server()
        with pytest.raises(DataLoss) as caught:
            await fresh.restore(damaged, ["good", "bad"])
        assert caught.value.reason == "CORRUPT_SNAPSHOT"
        why = {"corrupt_block": "does not match its sha256", "missing_block": "is missing"}.get(damage, "sha256 check")
        assert why in caught.value.message
        if damage != "flipped_byte":
            assert caught.value.metadata["sessions"] == "bad"
            assert "nothing was installed" in caught.value.message
        assert fresh.servicer.host.live() == {}  # the good session was not installed either
        assert fresh.plane.fence.phase is Phase.IDLE
        assert fresh.participant.admission.is_open
        assert await fresh.restore(tmp_path / "ok", ["good", "bad"]) == [EpisodeKey("bad", 1), EpisodeKey("good", 1)]
        for each in (server, fresh):
            await each.close()

    asyncio.run(main())


def test_a_retired_session_is_freed_and_never_recreated(tmp_path: Path) -> None:
    async def main() -> None:
        server = Server()
        for rollout in ("gone", "kept"):
            await server.seed(rollout)
        await server.call("gone", BEFORE)
        tables = server.tables("gone")
        await server.plane.retire("op1", soon(), [EpisodeKey("gone", 0)])
        assert set(server.servicer.host.live()) == {"kept"}
        assert list(tables) == []  # its frames and blocks were dropped
        with pytest.raises(GymrpcError) as caught:
            await server.call("gone", AFTER[:1], first=3)
        assert caught.value.reason == "STALE_ATTEMPT"
        with pytest.raises(GymrpcError) as caught:  # nor can a seed of the retired attempt bring it back
            await server.seed("gone")
        assert caught.value.reason == "STALE_ATTEMPT"
        assert set(server.servicer.host.live()) == {"kept"}
        await server.checkpoint(tmp_path)
        assert sessions_in(tmp_path) == ["kept"]
        assert sorted(blocks_in(tmp_path)) == sorted(d for d, _ in seed_blocks().values())  # none of its blocks
        await server.close()

    asyncio.run(main())


def test_a_session_whose_verify_failed_is_left_out_and_the_commit_succeeds(tmp_path: Path) -> None:
    async def main() -> None:
        server = Server(FailingVerifyWorkplaceEnvironment())
        await server.seed("r", task_id="ok-1")
        await server.seed("q", task_id="fail-1")
        for rollout in ("r", "q"):
            await server.call(rollout, BEFORE)
        with pytest.raises(RuntimeError, match="reward function crashed"):
            await server.verify("q")
        assert server.participant.readiness().counts["verify_failed"] == 1
        scope = frozenset({EpisodeKey("r", 0), EpisodeKey("q", 0)})  # even when the commit names it
        manifest = await server.checkpoint(tmp_path, scope=scope)
        assert sessions_in(tmp_path) == ["r"]
        assert {EpisodeKey.of(e) for e in manifest.episode_ids} == {EpisodeKey("r", 0)}
        expected = await server.call("r", AFTER, first=3)
        verified = await server.verify("r")

        fresh = Server(FailingVerifyWorkplaceEnvironment())
        with pytest.raises(NotFound):  # the left-out session is not in the checkpoint: restore is strict
            await fresh.restore(tmp_path, ["r", "q"])
        assert await fresh.restore(tmp_path, ["r"]) == [EpisodeKey("r", 1)]
        assert set(fresh.servicer.host.live()) == {"r"}
        assert await fresh.call("r", AFTER, attempt=1, first=3) == expected
        assert await fresh.verify("r", attempt=1) == verified  # reward and every table's fingerprint
        for each in (server, fresh):
            await each.close()

    asyncio.run(main())


def test_records_with_a_self_contained_snapshot_still_restore(tmp_path: Path) -> None:
    """Checkpoints written before table blocks hold one `Session.export` payload per session."""

    async def main() -> None:
        server = Server()
        await server.seed("old")
        await server.call("old", BEFORE)
        payload = server.servicer.host.live()["old"].session.export()
        fmt = WorkplaceEnvironment.snapshot_format
        assert fmt is not None
        snapshot = common_pb2.SessionSnapshot(
            protocol_version=SNAPSHOT_PROTOCOL_VERSION,
            format_name=fmt.name,
            format_version=fmt.version,
            payload=payload,
            sha256=__import__("hashlib").sha256(payload).hexdigest(),
        )
        body = rec_pb.ResourcesSessionRecord(session_id="old", snapshot=snapshot)
        reseal([rec_pb.CheckpointRecord(episode_id=ep("old"), resources_session=body)], tmp_path)
        fresh = Server()
        assert await fresh.restore(tmp_path, ["old"]) == [EpisodeKey("old", 1)]
        for name in TABLE_NAMES:
            assert frame_differences(server.tables("old").get(name), fresh.tables("old").get(name)) == []
        assert json.loads((await fresh.call("old", AFTER[:1], attempt=1, first=3))[0])
        for each in (server, fresh):
            await each.close()

    asyncio.run(main())
