"""Bad control input gets a clear gRPC error with an `ErrorInfo` reason, and changes nothing (docs/design.md §5, §7).

Over real gRPC to in-process participants (`tests/control/deployment.py`): unknown and conflicting
checkpoint ids, ids that break the pattern or the length or try path traversal, checkpoint folders
that are not absolute or not normalised, a folder that is not a checkpoint, corrupt and truncated
records files, a manifest of another participant or kind, a manifest that is not one, operations in
the wrong phase, missing and past deadlines. Each case compares every file under the checkpoint
root and every participant's status before and after; the restore cases also check that nothing
was installed and that the same fresh processes still take the good checkpoint afterwards.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from gymrpc.control import EpisodeKey
from gymrpc.controller import CoordinationError
from gymrpc.errors import DOMAIN
from gymrpc.pbtime import timestamp
from gymrpc.v1 import common_pb2
from gymrpc.v1 import participant_service_pb2 as pb
from gymrpc.v1 import participant_service_pb2_grpc as pb_grpc
from tests.control.deployment import TOKEN, Deployment

NAMES = ("agent/a", "model/m", "resources/r")
E0, E1 = EpisodeKey("e0", 0), EpisodeKey("e1", 0)


def soon(seconds: float = 10.0) -> Any:
    return timestamp(time.time() + seconds)


def tree(root: Path) -> dict[str, str]:
    """Every file under `root` with its sha256: what 'changes nothing' compares on disk."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


async def state(deployment: Deployment) -> dict[str, Any]:
    """What 'changes nothing' compares in the participants: phase, open id, marks, counts, admission."""
    out = {}
    for name, status in (await deployment.statuses()).items():
        node = deployment.nodes[name]
        out[name] = (
            status.phase,
            status.checkpoint_id,
            dict(status.retired),
            dict(status.report.counts),
            status.report.ready,
            node.participant.admission.is_open,
            node.participant.not_fresh(),
        )
    return out


def error_info(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    trailers: Any = error.trailing_metadata() or ()
    for key, value in trailers:
        if key == rpc_status.GRPC_DETAILS_METADATA_KEY:  # type: ignore[attr-defined]
            for detail in status_pb2.Status.FromString(value).details:
                if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    detail.Unpack(info)
                    return info
    raise AssertionError(f"{error.code().name} {error.details()!r} carries no ErrorInfo")


class Raw:
    """Plain generated stubs with the token, so the test sees the wire status itself."""

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.channels: dict[str, grpc.aio.Channel] = {}

    def stub(self, name: str) -> pb_grpc.ParticipantServiceStub:
        if name not in self.channels:
            self.channels[name] = grpc.aio.insecure_channel(self.deployment.nodes[name].address)
        return pb_grpc.ParticipantServiceStub(self.channels[name])

    async def refused(
        self, name: str, method: str, request: Any, code: grpc.StatusCode, reason: str, *, says: str = ""
    ) -> str:
        """Call, expect `code` and `reason` in an ErrorInfo of our domain; return the message."""
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await getattr(self.stub(name), method)(
                request, timeout=10, metadata=(("authorization", f"Bearer {TOKEN}"),)
            )
        error = caught.value
        info = error_info(error)
        assert (error.code(), info.reason, info.domain) == (code, reason, DOMAIN), (name, method, error.details())
        details = error.details() or ""
        assert says in details, details
        return details

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close(None)


async def committed(root: Path) -> Path:
    """A checkpoint of two live episodes (sessions, ledger rows, agent state) under `root/c1`."""
    source = await Deployment.start(NAMES)
    try:
        for key in (E0, E1):
            await source.seed("resources/r", key)
            await source.generate("model/m", key, 0)
            await source.increment("resources/r", key, "call-0")
            source.nodes["agent/a"].participant.track(key)
        result = await source.controller.checkpoint(root, episode_ids=[E0, E1], checkpoint_id="c1")
        assert result.committed
        return result.checkpoint_dir
    finally:
        await source.close()


def restore_request(folder: Path | str, restore_id: str = "x1", episodes: Any = (E0, E1)) -> pb.RestoreRequest:
    return pb.RestoreRequest(
        checkpoint_id=restore_id,
        deadline=soon(),
        checkpoint_dir=str(folder),
        episode_ids=[e.to_pb() if isinstance(e, EpisodeKey) else e for e in episodes],
    )


def run(coro: Awaitable[None]) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


Case = Callable[[Raw, Path], Awaitable[None]]

INVALID, FAILED, ABORTED = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ABORTED,
)
BAD_IDS = ["", "../etc", "a/b", ".", "..", "-lead", "x" * 129, "sp ace", "nul\x00", "ünï"]
BAD_DIRS = ["relative/dir", "/a/../b", "/a//b", "/a/./b", "", "/" + "x" * 5000, "/tab\there"]


def test_bad_restores_are_refused_and_install_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        folder = await committed(tmp_path / "ckpt")
        fresh = await Deployment.start(NAMES)
        raw = Raw(fresh)
        try:

            async def unchanged(call: Awaitable[Any]) -> None:
                """`call` is a coroutine not started yet: it runs between the two snapshots."""
                files, before = tree(tmp_path), await state(fresh)
                await call
                assert tree(tmp_path) == files, "a refused restore changed files"
                assert await state(fresh) == before, "a refused restore changed a participant"
                assert not fresh.nodes["resources/r"].servicer.host.live()
                assert not fresh.nodes["model/m"].participant.ledger.episodes()
                assert not fresh.nodes["agent/a"].participant.steps

            for name in NAMES:
                for bad in BAD_IDS:
                    await unchanged(
                        raw.refused(
                            name,
                            "Restore",
                            restore_request(folder, bad),
                            INVALID,
                            "INVALID_REQUEST",
                            says="checkpoint_id",
                        )
                    )
                for bad in BAD_DIRS:
                    await unchanged(
                        raw.refused(
                            name, "Restore", restore_request(bad), INVALID, "INVALID_REQUEST", says="checkpoint_dir"
                        )
                    )
                for bad in BAD_IDS:
                    episodes = [common_pb2.EpisodeId(rollout_id=bad)]
                    await unchanged(
                        raw.refused(
                            name,
                            "Restore",
                            restore_request(folder, episodes=episodes),
                            INVALID,
                            "INVALID_REQUEST",
                            says="rollout_id",
                        )
                    )
                no_deadline = restore_request(folder)
                no_deadline.ClearField("deadline")
                await unchanged(raw.refused(name, "Restore", no_deadline, INVALID, "INVALID_REQUEST", says="deadline"))
                past = restore_request(folder)
                past.deadline.CopyFrom(timestamp(time.time() - 1))
                await unchanged(
                    raw.refused(name, "Restore", past, grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED")
                )

                # Folders that are not a checkpoint: missing, empty, another checkpoint's parent.
                empty = tmp_path / "empty"
                empty.mkdir(exist_ok=True)
                for where in (tmp_path / "missing", empty, folder.parent):
                    await unchanged(
                        raw.refused(
                            name,
                            "Restore",
                            restore_request(where),
                            grpc.StatusCode.NOT_FOUND,
                            "NOT_FOUND",
                            says="not a committed checkpoint",
                        )
                    )

            # Damaged copies of the good checkpoint.
            def damaged(label: str, damage: Callable[[Path], object]) -> Path:
                copy = tmp_path / label
                shutil.copytree(folder, copy)
                damage(copy)
                return copy

            def records(copy: Path, part: str) -> Path:
                return next((copy / part).glob("records-*.bin"))

            flipped = damaged("flipped", lambda c: _flip(records(c, "resources/r")))
            truncated = damaged("truncated", lambda c: _truncate(records(c, "model/m")))
            missing = damaged("missing", lambda c: records(c, "agent/a").unlink())
            foreign = damaged(
                "foreign", lambda c: shutil.copy(c / "resources/r/manifest.json", c / "model/m/manifest.json")
            )
            garbage = damaged("garbage", lambda c: (c / "agent/a/manifest.json").write_text("{not json"))
            for copy, name, code, says in [
                (flipped, "resources/r", grpc.StatusCode.DATA_LOSS, "sha256"),
                (truncated, "model/m", grpc.StatusCode.DATA_LOSS, "sha256"),
                (missing, "agent/a", grpc.StatusCode.DATA_LOSS, "missing"),
                (foreign, "model/m", grpc.StatusCode.DATA_LOSS, "belongs to PARTICIPANT_KIND_RESOURCES"),
                (garbage, "agent/a", grpc.StatusCode.DATA_LOSS, "not a gymrpc checkpoint manifest"),
            ]:
                await unchanged(
                    raw.refused(name, "Restore", restore_request(copy), code, "CORRUPT_SNAPSHOT", says=says)
                )

            # The refusals left these processes fresh: they take the good checkpoint.
            replies = await fresh.controller.restore("x2", folder, [E0, E1])
            assert {EpisodeKey.of(e) for e in replies["resources/r"].restored} == {E0.next(), E1.next()}
            await fresh.controller.resume("x2")

            # Through the controller, a damaged copy fails all or nothing and writes nothing.
            other = await Deployment.start(NAMES)
            try:
                files = tree(tmp_path)
                with pytest.raises(CoordinationError, match="sha256"):
                    await other.controller.restore("x3", flipped, [E0, E1])
                assert tree(tmp_path) == files
                assert all(s.phase == pb.PARTICIPANT_PHASE_IDLE for s in (await other.statuses()).values())
                assert all(n.participant.admission.is_open for n in other.nodes.values())
                assert not other.nodes["resources/r"].servicer.host.live()
                # Its cleanup fenced the next attempts: a retry into the same processes is refused,
                # not installed as attempts every call of which would then get STALE_ATTEMPT.
                files, before = tree(tmp_path), await state(other)
                raw_other = Raw(other)
                for name in NAMES:
                    await raw_other.refused(
                        name,
                        "Restore",
                        restore_request(folder, "x4"),
                        FAILED,
                        "FAILED_PRECONDITION",
                        says="restore only into freshly started processes",
                    )
                assert (tree(tmp_path), await state(other)) == (files, before)
                await raw_other.close()
            finally:
                await other.close()
        finally:
            await raw.close()
            await fresh.close()

    run(main())


Refusal = tuple[str, Any, grpc.StatusCode, str]
"""One refused call: method, request, status code, reason."""


def _idle_cases(root: str) -> list[Refusal]:
    """Idle: nothing to commit or renew; malformed ids and requests are refused."""
    cases: list[Refusal] = [
        ("Commit", pb.CommitRequest(checkpoint_id="c9", deadline=soon(), checkpoint_dir=root), FAILED, "INVALID_PHASE"),
        ("Renew", pb.RenewRequest(checkpoint_id="c9", deadline=soon()), FAILED, "INVALID_PHASE"),
        ("Retire", pb.RetireRequest(checkpoint_id="op", deadline=soon()), INVALID, "INVALID_REQUEST"),
        ("Prepare", pb.PrepareRequest(checkpoint_id="c9"), INVALID, "INVALID_REQUEST"),
    ]
    for bad in BAD_IDS:
        cases += [
            ("Prepare", pb.PrepareRequest(checkpoint_id=bad, deadline=soon()), INVALID, "INVALID_REQUEST"),
            ("Resume", pb.ResumeRequest(checkpoint_id=bad), INVALID, "INVALID_REQUEST"),
            ("Forget", pb.ForgetRequest(checkpoint_id="op", rollout_ids=[bad]), INVALID, "INVALID_REQUEST"),
            (
                "Retire",
                pb.RetireRequest(
                    checkpoint_id="op", deadline=soon(), episode_ids=[common_pb2.EpisodeId(rollout_id=bad)]
                ),
                INVALID,
                "INVALID_REQUEST",
            ),
        ]
    return cases


def _prepared_cases(root: str) -> list[Refusal]:
    """Prepared as c1: another id conflicts, retire/forget/restore are in the wrong phase, dirs are checked."""
    conflict, phase = (ABORTED, "CHECKPOINT_CONFLICT"), (FAILED, "INVALID_PHASE")
    return [
        ("Prepare", pb.PrepareRequest(checkpoint_id="c2", deadline=soon()), *conflict),
        ("Commit", pb.CommitRequest(checkpoint_id="c2", deadline=soon(), checkpoint_dir=root), *conflict),
        ("Resume", pb.ResumeRequest(checkpoint_id="c2"), *conflict),
        ("Restore", restore_request(root, "c1"), *phase),
        ("Retire", pb.RetireRequest(checkpoint_id="op", deadline=soon(), episode_ids=[E0.to_pb()]), *phase),
        ("Forget", pb.ForgetRequest(checkpoint_id="op", rollout_ids=["e0"]), *phase),
    ] + [
        (
            "Commit",
            pb.CommitRequest(checkpoint_id="c1", deadline=soon(), checkpoint_dir=bad),
            INVALID,
            "INVALID_REQUEST",
        )
        for bad in BAD_DIRS
    ]


def _resumed_cases(root: str) -> list[Refusal]:
    """Committed and resumed c1: the id is stale for good."""
    stale = (FAILED, "STALE_CHECKPOINT")
    return [
        ("Prepare", pb.PrepareRequest(checkpoint_id="c1", deadline=soon()), *stale),
        ("Commit", pb.CommitRequest(checkpoint_id="c1", deadline=soon(), checkpoint_dir=root), *stale),
        ("Restore", restore_request(root, "c1"), *stale),
    ]


def test_ids_phases_and_fencing_are_refused_and_change_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        deployment = await Deployment.start(NAMES)
        raw = Raw(deployment)
        await deployment.seed("resources/r", E0)
        root = str(tmp_path / "ckpt")
        try:

            async def each_unchanged(cases: Callable[[str], list[Refusal]]) -> None:
                for name in NAMES:  # fresh deadlines for each participant
                    for method, request, code, reason in cases(root):
                        files, before = tree(tmp_path), await state(deployment)
                        await raw.refused(name, method, request, code, reason)
                        assert tree(tmp_path) == files, f"{method} changed files"
                        assert await state(deployment) == before, f"{method} changed {name}"

            await each_unchanged(_idle_cases)
            assert (await deployment.controller.prepare("c1", timeout=10)).prepared
            await each_unchanged(_prepared_cases)
            manifests = await deployment.controller.commit("c1", root, [E0])
            # The same commit again (a retry) answers with the manifest and where it lies in the folder.
            again = await raw.stub("resources/r").Commit(
                pb.CommitRequest(
                    checkpoint_id="c1",
                    deadline=soon(),
                    checkpoint_dir=root,
                    episode_ids=[E0.to_pb()],
                    explicit_scope=True,
                ),
                timeout=10,
                metadata=(("authorization", f"Bearer {TOKEN}"),),
            )
            assert again.manifest == manifests["resources/r"]
            assert again.manifest_path == "resources/r/manifest.json"
            assert (Path(root) / again.manifest_path).is_file()
            await deployment.controller.resume("c1")
            await each_unchanged(_resumed_cases)
            # A second commit into the same folder under another id conflicts with the manifest there.
            assert (await deployment.controller.prepare("c2", timeout=10)).prepared
            files = tree(tmp_path)
            await raw.refused(
                "resources/r",
                "Commit",
                pb.CommitRequest(checkpoint_id="c2", deadline=soon(), checkpoint_dir=root),
                ABORTED,
                "CHECKPOINT_CONFLICT",
            )
            assert tree(tmp_path) == files
            await deployment.controller.resume("c2")
        finally:
            await raw.close()
            await deployment.close()

    run(main())


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 3])


def _malformed_scopes(root: str) -> list[tuple[pb.CommitRequest, str]]:
    """Commits of c1 whose scope is malformed, each with what its error must say."""

    def commit(**scope: Any) -> pb.CommitRequest:
        return pb.CommitRequest(checkpoint_id="c1", deadline=soon(), checkpoint_dir=root, explicit_scope=True, **scope)

    return [
        (commit(episode_ids=[E0.to_pb()], scope_rollout_ids=["e0"], scope_attempts=[0]), "set twice"),
        (commit(scope_rollout_ids=["e0", "e1"], scope_attempts=[0]), "scope_attempts has 1"),
        (commit(scope_attempts=[0]), "scope_rollout_ids has 0 entries"),
        (commit(scope_rollout_ids=["e0", "../e1"], scope_attempts=[0, 0]), "scope_rollout_ids[1] '../e1'"),
        (commit(scope_rollout_ids=["e0", "e1\ne2"], scope_attempts=[0, 0]), "scope_rollout_ids[1]"),
        (commit(scope_rollout_ids=["e0", "e1"], scope_attempts=[0, 2**32 - 1]), "scope_attempts[1] 4294967295"),
    ]


def test_a_malformed_packed_scope_is_refused_with_a_reason_and_changes_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        deployment = await Deployment.start(NAMES)
        raw = Raw(deployment)
        root = str(tmp_path / "ckpt")
        try:
            assert (await deployment.controller.prepare("c1", timeout=10)).prepared
            for name in NAMES:
                for request, says in _malformed_scopes(root):
                    files, before = tree(tmp_path), await state(deployment)
                    await raw.refused(name, "Commit", request, INVALID, "INVALID_REQUEST", says=says)
                    assert tree(tmp_path) == files, f"{says}: files changed"
                    assert await state(deployment) == before, f"{says}: {name} changed"
            manifests = await deployment.controller.commit("c1", root, [E0])  # still prepared: commits
            assert sorted(manifests) == sorted(NAMES)
            await deployment.controller.resume("c1")
        finally:
            await raw.close()
            await deployment.close()

    run(main())
