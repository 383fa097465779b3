"""The checkpoint index (`checkpoint.json`): written by the controller last, the authority of a restore.

A replica whose commit failed leaves no folder, which a restore could not tell from a replica that
never existed: only a folder the controller indexed after every member committed is restored, and
only when every manifest it lists is the one committed and it lists every manifest there. Real
control planes over real counter resources replicas, called in-process through `Controller`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gymrpc import cli
from gymrpc.balancing import place
from gymrpc.control import EpisodeKey, Kind, Phase, store
from gymrpc.control.index import INDEX, read_index, write_index
from gymrpc.controller import Controller, CoordinationError
from gymrpc.errors import Aborted, DataLoss, FailedPrecondition, NotFound, Unavailable
from gymrpc.servers.participant import ParticipantServicer
from gymrpc.v1 import participant_service_pb2 as pb
from gymrpc.v1 import registry_service_pb2 as registry_pb
from tests.agent.fakes import DirectStub
from tests.control.test_replica_restore import EPISODES, NAME, Replica, session


class Broken:
    """A participant stub whose calls of `methods` fail as if its replica had died."""

    def __init__(self, stub: DirectStub, methods: set[str]) -> None:
        self.stub, self.methods = stub, methods

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method in self.methods:

            async def dead(request: Any, *, timeout: float | None = None) -> Any:
                raise Unavailable(f"{method}: the replica is gone")

            return dead
        return getattr(self.stub, method)


class ReplicaClient:
    """What `Controller` uses of `gymrpc.Client` with replicas (a `Directory`): each replica listed,
    and `participant(name, endpoint_id)` reaching it (in-process)."""

    def __init__(self, replicas: list[Replica], broken: dict[str, set[str]] | None = None) -> None:
        self.stubs: dict[str, Any] = {}
        for replica in replicas:
            endpoint_id = replica.plane.endpoint_id
            stub = DirectStub(ParticipantServicer(replica.plane))
            self.stubs[endpoint_id] = Broken(stub, broken[endpoint_id]) if broken and endpoint_id in broken else stub

    async def list_endpoints(self, prefix: str = "") -> list[registry_pb.Endpoint]:
        return [registry_pb.Endpoint(name=NAME, endpoint_id=i, address=f"replica-{i}") for i in self.stubs]

    async def resolve_endpoints(self, name: str) -> list[registry_pb.Endpoint]:
        assert name == NAME
        return await self.list_endpoints()

    async def refresh(self, name: str) -> None:
        """Nothing placed here to forget."""

    def participant(self, name: str, endpoint_id: str | None = None) -> Any:
        assert name == NAME
        return self.stubs[endpoint_id or "0"]


def controller_of(client: ReplicaClient) -> Controller:
    return Controller(client)


async def seeded(count: int = 2) -> list[Replica]:
    """`count` replicas; each episode's session on the replica clients route it to."""
    ids = [str(i) for i in range(count)]
    replicas = [Replica(i) for i in ids]
    for i, episode in enumerate(EPISODES):
        await replicas[int(place(session(episode), ids))].seed(episode, i % 4 + 1)
    return replicas


async def close(replicas: list[Replica]) -> None:
    for replica in replicas:
        await replica.close()


async def untouched(replicas: list[Replica]) -> None:
    """Nothing was installed, nothing is open: the processes can still take a good checkpoint."""
    for replica in replicas:
        assert replica.participant.not_fresh() is None
        assert not replica.servicer.host.live()
        assert replica.plane.status().phase is Phase.IDLE


def restored_by(replies: dict[str, pb.RestoreResponse]) -> list[EpisodeKey]:
    return sorted(EpisodeKey.of(e) for reply in replies.values() for e in reply.restored)


def test_the_index_lists_every_replica_that_committed_and_a_restore_reads_exactly_those(tmp_path: Path) -> None:
    async def main() -> None:
        old = await seeded()
        result = await controller_of(ReplicaClient(old)).checkpoint(tmp_path, episode_ids=EPISODES, checkpoint_id="c1")
        await close(old)
        assert result.committed
        assert result.index is not None
        folder = result.checkpoint_dir
        on_disk = json.loads((folder / INDEX).read_text())
        assert on_disk["checkpoint_id"] == "c1"
        listed = [(m["name"], m["endpoint_id"], m["manifest_path"]) for m in on_disk["members"]]
        assert listed == [
            (NAME, "0", "resources/counter/manifest.json"),
            (NAME, "1", "resources/counter#1/manifest.json"),
        ]
        for member in on_disk["members"]:
            manifest = (folder / member["manifest_path"]).read_bytes()
            assert member["manifest_sha256"] == hashlib.sha256(manifest).hexdigest()
        assert read_index(folder) == result.index
        # Written last: its time is not before any manifest's.
        index_time = result.index.create_time.ToNanoseconds()
        assert all(m.create_time.ToNanoseconds() <= index_time for m in result.manifests.values())
        # A retried commit finds an equal index and keeps it; another checkpoint's is a conflict.
        assert write_index(folder, "c1", result.manifests.values()) == result.index
        with pytest.raises(Aborted, match="already indexes another commit"):
            write_index(folder, "c1", list(result.manifests.values())[:1])

        new = [Replica(i) for i in "012"]
        replies = await controller_of(ReplicaClient(new)).restore("r1", folder, EPISODES)
        assert restored_by(replies) == sorted(e.next() for e in EPISODES)
        await close(new)

    asyncio.run(main())


def test_a_commit_that_failed_on_one_replica_leaves_no_index_and_a_restore_refuses_it(tmp_path: Path) -> None:
    async def main() -> None:
        old = await seeded()
        controller = controller_of(ReplicaClient(old, broken={"1": {"Commit"}}))
        assert (await controller.prepare("c1")).prepared
        with pytest.raises(CoordinationError) as caught:
            # Written before the commit replies (not in the background), so replica 0's folder is complete
            # when the failure is raised: the escape hatch below reads it. (`checkpoint` would discard the
            # folder; a commit by hand leaves it to its caller.)
            await controller.commit("c1", tmp_path / "c1", EPISODES)
        await controller.resume("c1")
        assert list(caught.value.failures) == [f"{NAME}#1"]
        await close(old)
        folder = tmp_path / "c1"
        # Replica 0 committed, replica 1 left nothing: alone, the folder looks like one replica's checkpoint.
        assert store.replica_ids(folder, Kind.RESOURCES, NAME) == ["0"]
        assert not (folder / INDEX).exists()

        fresh = [Replica("0"), Replica("1")]
        with pytest.raises(FailedPrecondition, match="the checkpoint is incomplete") as refused:
            await controller_of(ReplicaClient(fresh)).restore("r1", folder, EPISODES)
        assert refused.value.reason == "CHECKPOINT_INCOMPLETE"
        await untouched(fresh)
        with pytest.raises(NotFound, match="does not exist"):
            await controller_of(ReplicaClient(fresh)).restore("r1", tmp_path / "c9", EPISODES)
        await untouched(fresh)

        # The escape hatch: a caller that names the replicas that committed gets exactly those; the
        # episodes only the failed replica held are not in the checkpoint, and asking for them is NOT_FOUND.
        on_zero = [e for e in EPISODES if place(session(e), ["0", "1"]) == "0"]
        with pytest.raises(CoordinationError, match="holds no episode"):
            await controller_of(ReplicaClient(fresh)).restore("r2", folder, EPISODES, sources={NAME: ["0"]})
        await untouched(fresh)
        replies = await controller_of(ReplicaClient(fresh)).restore("r3", folder, on_zero, sources={NAME: ["0"]})
        assert restored_by(replies) == sorted(e.next() for e in on_zero)
        await close(fresh)

    asyncio.run(main())


def damage_manifest(folder: Path) -> None:
    """The same manifest, rewritten (still valid JSON of the same checkpoint)."""
    path = folder / "resources" / "counter#1" / store.MANIFEST
    path.write_text(json.dumps(json.loads(path.read_text())))


def drop_member(folder: Path) -> None:
    """An index that forgot a replica: its sessions would silently not be restored."""
    index = json.loads((folder / INDEX).read_text())
    index["members"] = index["members"][:1]
    (folder / INDEX).write_text(json.dumps(index))


def move_member(folder: Path) -> None:
    """An index pointing a member at a path of its own choosing."""
    index = json.loads((folder / INDEX).read_text())
    index["members"][1]["manifest_path"] = "../c1/resources/counter#1/manifest.json"
    (folder / INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (damage_manifest, r"resources/counter#1/manifest.json is not the manifest that was committed"),
        (lambda f: (f / "resources" / "counter" / store.MANIFEST).unlink(), "cannot be read"),
        (drop_member, "it does not list resources/counter#1/manifest.json"),
        (move_member, "is listed at"),
        (lambda f: (f / INDEX).write_text("{not json"), "is not a gymrpc checkpoint index"),
    ],
    ids=["manifest-rewritten", "manifest-missing", "member-dropped", "member-moved", "index-garbage"],
)
def test_a_tampered_index_or_manifest_is_refused_and_installs_nothing(
    tmp_path: Path, damage: Callable[[Path], None], says: str
) -> None:
    async def main() -> None:
        old = await seeded()
        result = await controller_of(ReplicaClient(old)).checkpoint(tmp_path, episode_ids=EPISODES, checkpoint_id="c1")
        await close(old)
        copy = tmp_path / "copy"
        shutil.copytree(result.checkpoint_dir, copy)
        damage(copy)
        fresh = [Replica("0"), Replica("1")]
        with pytest.raises(DataLoss, match=says):
            await controller_of(ReplicaClient(fresh)).restore("r1", copy, EPISODES)
        await untouched(fresh)
        replies = await controller_of(ReplicaClient(fresh)).restore("r2", result.checkpoint_dir, EPISODES)
        assert restored_by(replies) == sorted(e.next() for e in EPISODES)
        await close(fresh)

    asyncio.run(main())


def test_ctl_inspect_shows_the_index_and_refuses_what_a_restore_would(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gymrpc ctl inspect DIR` reads the folder only: no stack needed."""

    async def main() -> Path:
        old = await seeded()
        result = await controller_of(ReplicaClient(old)).checkpoint(tmp_path, episode_ids=EPISODES, checkpoint_id="c1")
        await close(old)
        return result.checkpoint_dir

    folder = asyncio.run(main())

    def ctl(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = cli.main(["--run-dir", str(tmp_path / "no-stack"), "ctl", "inspect", *argv])
        out, err = capsys.readouterr()
        return code, out, err

    code, out, _ = ctl(str(folder))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith(f"checkpoint c1 in {folder}: 2 members, indexed ")
    assert lines[1].split() == ["MEMBER", "KIND", "RECORDS", "BYTES", "EPISODES", "MANIFEST", "SHA256"]
    assert [line.split()[:2] for line in lines[2:]] == [[NAME, "resources"], [f"{NAME}#1", "resources"]]
    assert sum(int(line.split()[4]) for line in lines[2:]) == len(EPISODES)
    report = json.loads(ctl(str(folder), "--json")[1])
    assert report["restorable"] is True
    assert [m["endpoint_id"] for m in report["index"]["members"]] == ["0", "1"]

    (folder / INDEX).unlink()
    code, _, err = ctl(str(folder))
    assert code == 1
    assert "CHECKPOINT_INCOMPLETE" in err
    report = json.loads(ctl(str(folder), "--json")[1])
    assert (report["restorable"], report["error"]["reason"]) == (False, "CHECKPOINT_INCOMPLETE")
