"""Errors stay small, typed and honest.

- A 10,000-character id is INVALID_ARGUMENT with a short message (not RESOURCE_EXHAUSTED because
  the echoed id overflowed gRPC's metadata limit); ErrorInfo metadata keeps a bounded prefix of it.
- Bytes that do not decode as the method's message (invalid UTF-8 in a string field, a corrupt wire
  format) are INVALID_ARGUMENT `MALFORMED_MESSAGE`, not a bare UNKNOWN, and the server goes on.
- A commit into a folder that cannot exist (under a regular file) is FAILED_PRECONDITION
  `STORAGE_FAILURE` naming the path, not UNAVAILABLE "retry"; nothing is written or changed.
- Every reason string in the code base is a value of `gymrpc.v1.ErrorReason`.
"""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gymrpc.errors import MAX_METADATA_CHARS
from gymrpc.v1 import common_pb2, error_details_pb2
from gymrpc.v1 import participant_service_pb2 as pb
from gymrpc.v1 import participant_service_pb2_grpc as pb_grpc
from gymrpc.v1 import resources_service_pb2 as res_pb
from gymrpc.v1 import resources_service_pb2_grpc as res_grpc
from tests.control.deployment import Deployment
from tests.control.test_bad_input import E0, NAMES, Raw, restore_request, soon, state, tree
from tests.security.helpers import (
    CONTROL,
    ROOT,
    ServerProcess,
    channel,
    comparable,
    error_info,
    healthy,
    participant_status,
    refused,
)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
LONG_ID = "x" * 10_000


@pytest.fixture
def resources_server(tmp_path: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(
        "gymrpc.servers.resources", "resources/r", ["--environment", "counter"], tmp_path / "resources"
    )
    yield server
    server.stop()


def test_a_huge_id_is_invalid_argument_with_a_bounded_message(resources_server: ServerProcess, tmp_path: Path) -> None:
    async def main() -> None:
        async with channel(resources_server.address) as ch:
            stub = res_grpc.ResourcesServiceStub(ch)
            request = res_pb.CloseSessionRequest(session_id=LONG_ID, episode_id=common_pb2.EpisodeId(rollout_id="e1"))
            error = await refused(stub.CloseSession(request, timeout=30), INVALID, "INVALID_REQUEST", says="session_id")
            assert len(error.details() or "") < 300
            info = error_info(error)
            assert info.metadata["field"] == "session_id"
            assert LONG_ID.startswith(info.metadata["value"])
            assert len(info.metadata["value"]) == MAX_METADATA_CHARS
            before = comparable(await participant_status(resources_server.address))
            error = await refused(
                pb_grpc.ParticipantServiceStub(ch).Restore(
                    restore_request(tmp_path, LONG_ID), timeout=30, metadata=CONTROL
                ),
                INVALID,
                "INVALID_REQUEST",
                says="checkpoint_id",
            )
            assert len(error.details() or "") < 300
            assert comparable(await participant_status(resources_server.address)) == before

    asyncio.run(main())


def test_undecodable_requests_are_invalid_argument_malformed_message(resources_server: ServerProcess) -> None:
    async def main() -> None:
        async with channel(resources_server.address) as ch:
            for method in ("SeedSession", "CallTool", "CloseSession"):
                raw = ch.unary_unary(f"/gymrpc.v1.ResourcesService/{method}")
                for data in (b"\x0a\x03\xff\xfe\xfd", b"\xff\xff\xff\xff", b"\x0a\x80", b"\x12\x05ab"):
                    await refused(raw(data, timeout=30), INVALID, "MALFORMED_MESSAGE", says="does not decode")
            assert await healthy(resources_server.address)
            assert resources_server.alive()

    asyncio.run(main())


def test_a_commit_into_an_impossible_folder_is_a_failed_precondition_naming_it(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    folder = blocker / "ckpt"

    async def main() -> None:
        deployment = await Deployment.start(NAMES)
        raw = Raw(deployment)
        try:
            await deployment.seed("resources/r", E0)
            assert (await deployment.controller.prepare("c1", timeout=10)).prepared
            files, before = tree(tmp_path), await state(deployment)
            for name in NAMES:
                request = pb.CommitRequest(checkpoint_id="c1", deadline=soon(), checkpoint_dir=str(folder))
                details = await raw.refused(
                    name, "Commit", request, grpc.StatusCode.FAILED_PRECONDITION, "STORAGE_FAILURE", says=str(blocker)
                )
                assert "retry the commit" not in details
            assert tree(tmp_path) == files
            assert await state(deployment) == before
            # Nothing is stuck: the checkpoint aborts, and the next one commits into a good folder.
            await deployment.controller.resume("c1")
            assert (await deployment.controller.prepare("c2", timeout=10)).prepared
            await deployment.controller.commit("c2", tmp_path / "good", [E0])
            await deployment.controller.resume("c2")
        finally:
            await raw.close()
            await deployment.close()

    asyncio.run(main())


def _reasons_in_code() -> dict[str, list[str]]:
    """Every `reason="X"` keyword and `default_reason = "X"` in gymrpc/, servers/, envs/ -> where."""
    found: dict[str, list[str]] = {}
    for folder in ("gymrpc", "servers", "envs"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "gymrpc/v1" in path.as_posix():
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                value = None
                if isinstance(node, ast.keyword) and node.arg == "reason":
                    value = node.value
                elif isinstance(node, ast.Assign | ast.AnnAssign):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    if any(isinstance(t, ast.Name) and t.id == "default_reason" for t in targets):
                        value = node.value
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    found.setdefault(value.value, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_reason_in_the_code_is_an_error_reason_value() -> None:
    values = {n.removeprefix("ERROR_REASON_") for n in error_details_pb2.ErrorReason.DESCRIPTOR.values_by_name} - {
        "UNSPECIFIED"
    }
    found = _reasons_in_code()
    assert len(found) > 20, "the scan found too few reasons to be looking at the right code"
    missing = {reason: where for reason, where in found.items() if reason not in values}
    assert not missing, f"reasons sent that are not ErrorReason values: {missing}"
