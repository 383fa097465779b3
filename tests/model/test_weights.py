"""WeightsService on a real scripted model server (`gymrpc up`): updates, idempotency, refusals.

The scripted backend's update is a version bump, checked exactly as a real load is: every
refusal below must leave the old version serving, which each test asserts with GetWeights
and with the version a fresh generation reports.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from gymrpc.client import Client
from gymrpc.errors import Aborted, FailedPrecondition, GymrpcError, InvalidArgument, Unauthenticated
from gymrpc.launch.private import LOCK
from gymrpc.pbtime import timestamp
from gymrpc.testing.safetensors_files import write_safetensors
from gymrpc.v1 import common_pb2
from gymrpc.v1 import model_service_pb2 as model_pb
from gymrpc.v1 import participant_service_pb2 as part_pb
from gymrpc.v1 import weights_service_pb2 as pb
from gymrpc.v1 import weights_service_pb2_grpc as pb_grpc
from gymrpc.weights import describe_folder, get_weights, update_weights, upload_messages
from tests.agent.fakes import counter_tasks

MODEL = "model/policy"
TENSORS = {"embed.weight": ("F32", (16, 4), None), "layer.0.weight": ("F32", (4, 4), None)}


def weights_folder(root: Path, name: str, tensors: dict[str, Any] | None = None) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    write_safetensors(folder / "model.safetensors", tensors or TENSORS)
    return folder


def stack_config(weights: Path, token_delay: float = 0.0) -> dict[str, Any]:
    args = {"backend": "scripted", "policy": "counter", "weights": str(weights), "token_delay": token_delay}
    return {"servers": [{"name": MODEL, "role": "model", "args": args}]}


def generate_request(request_id: str) -> model_pb.GenerateRequest:
    task = counter_tasks()[0]
    return model_pb.GenerateRequest(
        request_id=request_id,
        episode_id=common_pb2.EpisodeId(rollout_id=request_id.replace("/", "-")),
        messages=task.input,
        tools=task.tools,
    )


async def served_version(client: Client, request_id: str) -> str:
    reply = await client.model(MODEL).Generate(generate_request(request_id), timeout=30)
    return reply.weight_version


@pytest.fixture
def stack(start_stack: Any, run_dir: Path) -> Any:
    weights_folder(run_dir, "w0")
    return start_stack(stack_config(run_dir / "w0"))


def test_update_by_path_and_streamed_is_idempotent_per_request_id(stack: Any, run_dir: Path) -> None:
    w1, w2 = weights_folder(run_dir, "w1"), weights_folder(run_dir, "w2")

    async def scenario() -> None:
        async with Client(run_dir=run_dir) as client:
            assert await get_weights(client, MODEL) == "scripted:0"
            first = await update_weights(client, MODEL, weight_version="it:1", path=w1, request_id="u1")
            assert (first.weight_version, first.previous_weight_version) == ("it:1", "scripted:0")
            assert not first.already_applied
            assert first.tensor_count == 2
            assert first.mode == pb.WEIGHT_UPDATE_MODE_KEEP
            again = await update_weights(client, MODEL, weight_version="it:1", path=w1, request_id="u1")
            assert again.already_applied
            assert again.weight_version == "it:1"
            with pytest.raises(InvalidArgument, match="already used"):
                await update_weights(client, MODEL, weight_version="it:9", path=w1, request_id="u1")
            status = await client.weights(MODEL).GetWeights(pb.GetWeightsRequest())
            assert (status.weight_version, status.update_count, status.updatable) == ("it:1", 1, True)
            assert await served_version(client, "v/1") == "it:1"
            streamed = await update_weights(client, MODEL, weight_version="it:2", stream_from=w2, request_id="u2")
            assert (streamed.weight_version, streamed.previous_weight_version) == ("it:2", "it:1")
            retried = await update_weights(client, MODEL, weight_version="it:2", stream_from=w2, request_id="u2")
            assert retried.already_applied
            assert await served_version(client, "v/2") == "it:2"
            assert (await client.weights(MODEL).GetWeights(pb.GetWeightsRequest())).update_count == 2

    asyncio.run(scenario())


def _refusals(root: Path) -> list[tuple[str, dict[str, Any], type[GymrpcError], str]]:
    """(label, update_weights kwargs, error class, reason) of every bad path update."""
    bad: list[tuple[str, dict[str, Any], type[GymrpcError], str]] = []
    bad.append(("missing folder", {"path": root / "nowhere"}, InvalidArgument, "INVALID_REQUEST"))
    (root / "linked").symlink_to(weights_folder(root, "real"))
    bad.append(("symlinked folder", {"path": root / "linked"}, InvalidArgument, "INVALID_REQUEST"))
    escape = root / "escape"
    escape.mkdir()
    (escape / "model.safetensors").symlink_to(root / "real" / "model.safetensors")
    bad.append(("symlinked file", {"path": escape}, InvalidArgument, "INVALID_REQUEST"))
    fifo = root / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "model.safetensors")
    bad.append(("fifo", {"path": fifo}, InvalidArgument, "INVALID_REQUEST"))
    corrupt = root / "corrupt"
    corrupt.mkdir()
    (corrupt / "model.safetensors").write_bytes(b"\xff" * 64)
    bad.append(("corrupt header", {"path": corrupt}, InvalidArgument, "CORRUPT_WEIGHTS"))
    truncated = weights_folder(root, "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:-8])
    bad.append(("truncated data", {"path": truncated}, InvalidArgument, "CORRUPT_WEIGHTS"))
    shape = weights_folder(root, "shape", {**TENSORS, "layer.0.weight": ("F32", (4, 5), None)})
    bad.append(("shape mismatch", {"path": shape}, FailedPrecondition, "WEIGHTS_MISMATCH"))
    dtype = weights_folder(root, "dtype", {**TENSORS, "layer.0.weight": ("F16", (4, 4), None)})
    bad.append(("dtype mismatch", {"path": dtype}, FailedPrecondition, "WEIGHTS_MISMATCH"))
    missing = weights_folder(root, "missing", {"embed.weight": TENSORS["embed.weight"]})
    bad.append(("missing tensor", {"path": missing}, FailedPrecondition, "WEIGHTS_MISMATCH"))
    extra = weights_folder(root, "extra", {**TENSORS, "head.weight": ("F32", (4,), None)})
    bad.append(("extra tensor", {"path": extra}, FailedPrecondition, "WEIGHTS_MISMATCH"))
    bad.append(("streamed shape mismatch", {"stream_from": shape}, FailedPrecondition, "WEIGHTS_MISMATCH"))
    return bad


def test_every_bad_update_is_refused_with_its_reason_and_the_old_weights_keep_serving(
    stack: Any, run_dir: Path
) -> None:
    cases = _refusals(run_dir / "bad")

    async def scenario() -> None:
        async with Client(run_dir=run_dir) as client:
            for k, (label, kwargs, error, reason) in enumerate(cases):
                with pytest.raises(error) as caught:
                    await update_weights(client, MODEL, weight_version=f"bad:{k}", request_id=f"bad{k}", **kwargs)
                assert caught.value.reason == reason, (label, caught.value)
                assert await get_weights(client, MODEL) == "scripted:0", label
            stub = client.stub_at(await client.resolve(MODEL), pb_grpc.WeightsServiceStub)
            md = client._metadata
            relative = pb.UpdateWeightsRequest(request_id="rel", weight_version="x:1", path="w0")
            with pytest.raises(grpc.RpcError) as rpc:
                await stub.UpdateWeights(relative, metadata=md)
            assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "absolute" in rpc.value.details()
            same = pb.UpdateWeightsRequest(request_id="same", weight_version="scripted:0", path=str(run_dir / "w0"))
            with pytest.raises(grpc.RpcError) as rpc:
                await stub.UpdateWeights(same, metadata=md)
            assert "already serving" in rpc.value.details()
            assert await served_version(client, "v/after") == "scripted:0"
            assert (await client.weights(MODEL).GetWeights(pb.GetWeightsRequest())).update_count == 0

    asyncio.run(scenario())


def test_bad_uploads_are_refused_and_leave_nothing_staged(stack: Any, run_dir: Path) -> None:
    good = weights_folder(run_dir, "good")
    files = describe_folder(good)

    def header(request_id: str, **changes: Any) -> pb.UploadWeightsHeader:
        out = pb.UploadWeightsHeader(request_id=request_id, weight_version="up:1", files=files)
        for key, value in changes.items():
            if key == "sha256":
                out.files[0].sha256 = value
            else:
                setattr(out, key, value)
        return out

    async def send(stub: Any, md: Any, messages: list[pb.UploadWeightsRequest]) -> grpc.RpcError:
        async def it() -> Any:
            for m in messages:
                yield m

        with pytest.raises(grpc.RpcError) as rpc:
            await stub.UploadWeights(it(), metadata=md)
        return rpc.value

    async def scenario() -> None:
        async with Client(run_dir=run_dir) as client:
            stub = client.stub_at(await client.resolve(MODEL), pb_grpc.WeightsServiceStub)
            md = client._metadata
            messages = list(upload_messages(header("sha"), good))
            wrong = list(upload_messages(header("sha", sha256="0" * 64), good))
            err = await send(stub, md, wrong)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "sha256" in err.details()
            big = pb.UploadWeightsRequest(chunk=pb.WeightsChunk(file_index=0, offset=0, data=bytes(4 * 2**20 + 1)))
            err = await send(stub, md, [messages[0], big])
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "at most" in err.details()
            err = await send(stub, md, messages[:1])  # the stream ends before the file is complete
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "ended" in err.details()
            err = await send(stub, md, messages[1:])  # no header
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "header" in err.details()
            escaping = header("dots")
            escaping.files[0].name = "../model.safetensors"
            err = await send(stub, md, [pb.UploadWeightsRequest(header=escaping)])
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "bare name" in err.details()
            too_big = header("big")
            too_big.files[0].size_bytes = 2**62
            err = await send(stub, md, [pb.UploadWeightsRequest(header=too_big)])
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "at most" in err.details()
            assert await get_weights(client, MODEL) == "scripted:0"
            ok = await stub.UploadWeights(_aiter(messages), metadata=md)  # the same id after refusals: applied
            assert ok.weight_version == "up:1"

    before = set(_staging_folders())
    asyncio.run(scenario())
    (folder,) = set(_staging_folders()) - before  # made at the first upload
    assert folder.name != f"gymrpc-weights-{stack.server(MODEL)['pid']}", "a name no other user can make first"
    assert folder.stat().st_mode & 0o777 == 0o700
    assert folder.stat().st_uid == os.getuid()
    assert [p.name for p in folder.iterdir()] == [LOCK], "nothing of the uploads stays staged"
    stack.stop()
    assert not folder.exists(), "the server removes its staging folder when it stops"


def _staging_folders() -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob("gymrpc-weights-*"))


def test_a_killed_servers_staged_upload_is_removed_by_the_next(stack: Any, run_dir: Path) -> None:
    """A model server SIGKILLed mid-upload cannot remove what it staged; its successor does at its first."""
    before = set(_staging_folders())

    async def upload(request_id: str, version: str) -> str:
        async with Client(run_dir=run_dir) as client:
            return await update_weights(
                client, MODEL, weight_version=version, stream_from=run_dir / "w0", request_id=request_id
            )

    assert asyncio.run(upload("first", "up:1")).weight_version == "up:1"
    (killed,) = set(_staging_folders()) - before
    half = killed / "upload-halfway"
    half.mkdir()
    (half / "model.safetensors").write_bytes(bytes(1 << 20))  # what the kill left of the next upload
    old = stack.kill(MODEL)
    stack.wait_for(MODEL, lambda s: s["pid"] not in (None, old) and s["state"] == "serving")
    assert asyncio.run(upload("second", "up:2")).weight_version == "up:2"
    assert not killed.exists(), "the next server's first upload swept the dead one's folder"


async def _aiter(items: list[Any]) -> Any:
    for item in items:
        yield item


def test_weight_updates_need_the_control_token(stack: Any, run_dir: Path) -> None:
    w1 = weights_folder(run_dir, "w1")

    async def scenario() -> None:
        async with Client(run_dir=run_dir, token="wrong") as client:
            with pytest.raises(Unauthenticated):
                await update_weights(client, MODEL, weight_version="it:1", path=w1)
            with pytest.raises(Unauthenticated):
                await update_weights(client, MODEL, weight_version="it:1", stream_from=w1)
            with pytest.raises(Unauthenticated):
                await get_weights(client, MODEL)
        async with Client(run_dir=run_dir) as client:
            assert await get_weights(client, MODEL) == "scripted:0"

    asyncio.run(scenario())


def test_an_update_while_a_checkpoint_is_open_is_refused_then_succeeds_after_resume(stack: Any, run_dir: Path) -> None:
    w1 = weights_folder(run_dir, "w1")

    async def scenario() -> None:
        async with Client(run_dir=run_dir) as client:
            participant: Any = client.participant(MODEL)
            deadline = timestamp(time.time() + 30)
            prepared = await participant.Prepare(part_pb.PrepareRequest(checkpoint_id="ck1", deadline=deadline))
            assert prepared.phase == part_pb.PARTICIPANT_PHASE_PREPARED
            with pytest.raises(Aborted) as caught:
                await update_weights(client, MODEL, weight_version="it:1", path=w1, request_id="during")
            assert caught.value.reason == "CHECKPOINT_CONFLICT"
            assert "ck1" in caught.value.message
            assert await get_weights(client, MODEL) == "scripted:0"
            await participant.Resume(part_pb.ResumeRequest(checkpoint_id="ck1"))
            reply = await update_weights(client, MODEL, weight_version="it:1", path=w1, request_id="during")
            assert reply.weight_version == "it:1"
            assert not reply.already_applied

    asyncio.run(scenario())


@pytest.fixture
def slow_stack(start_stack: Any, run_dir: Path) -> Any:
    weights_folder(run_dir, "w0")
    return start_stack(stack_config(run_dir / "w0", token_delay=0.02))


async def _stream_until(client: Client, request_id: str, tokens: int, started: asyncio.Event) -> Any:
    """Stream one generation; set `started` after `tokens` tokens; return (tokens, final response)."""
    ids: list[int] = []
    final = None
    stub: Any = client.model(MODEL)
    request = model_pb.GenerateStreamRequest(request=generate_request(request_id))
    async for event in stub.GenerateStream(request, timeout=60):
        if event.HasField("delta"):
            ids.extend(event.delta.token_ids)
            if len(ids) >= tokens:
                started.set()
        else:
            final = event.final
    return ids, final


@pytest.mark.parametrize("mode", ["keep", "cut", "drain"])
def test_generations_in_flight_finish_and_their_spans_name_the_update(
    slow_stack: Any, run_dir: Path, mode: str
) -> None:
    w1 = weights_folder(run_dir, "w1")
    count = 4

    async def scenario() -> None:
        async with Client(run_dir=run_dir) as client:
            baseline_ids, _ = await _stream_until(client, "base/0", 1, asyncio.Event())
            started = [asyncio.Event() for _ in range(count)]
            streams = [asyncio.ensure_future(_stream_until(client, f"{mode}/{k}", 3, started[k])) for k in range(count)]
            await asyncio.gather(*(e.wait() for e in started))
            reply = await update_weights(client, MODEL, weight_version="it:1", path=w1, mode=mode)
            results = await asyncio.gather(*streams)
            assert reply.weight_version == "it:1"
            for ids, final in results:
                assert ids == baseline_ids  # the scripted reply: nothing lost, nothing repeated
                spans = [(s.weight_version, s.first_token, s.last_token) for s in final.weight_versions]
                assert spans[0][1] == 0
                assert spans[-1][2] == len(ids) - 1
                assert all(a[2] + 1 == b[1] for a, b in itertools.pairwise(spans))
                if mode == "drain":
                    assert spans == [("scripted:0", 0, len(ids) - 1)]
                else:
                    assert [s[0] for s in spans] == ["scripted:0", "it:1"]
                    assert spans[0][2] >= 2
                    assert final.weight_version == "it:1"
            if mode == "keep":
                assert (reply.generations_kept, reply.generations_cut, reply.tokens_recomputed) == (count, 0, 0)
            elif mode == "cut":
                assert (reply.generations_cut, reply.generations_kept) == (count, 0)
            else:
                assert (reply.generations_drained, reply.generations_kept) == (count, 0)
            assert await served_version(client, "v/after") == "it:1"

    asyncio.run(scenario())
