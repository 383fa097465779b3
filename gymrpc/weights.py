"""Put new weights into a model server while its episodes run: the trainer's side of `WeightsService`.

    reply = await update_weights(client, "model/policy", weight_version="iteration:8", path="/ckpt/it8")
    reply = await update_weights(client, "model/policy", weight_version="iteration:9", stream_from="/ckpt/it9")

`path` makes the server read the folder itself (shared storage, the same host); `stream_from`
sends the folder's `*.safetensors` files over the call in 4 MiB chunks, each file's sha256
in the header, for a server that cannot see the trainer's disk. Every replica registered
under the name is updated (concurrently), and the reply sums what they did. The request
id makes the update idempotent: a retry after UNAVAILABLE (a restart, a lost reply) sends the
same id, and a server that already applied it answers with its first reply
(`already_applied`). Control calls: the client's stack token goes with them.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import stat
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from gymrpc.client import Client, _is_retryable
from gymrpc.errors import from_rpc_error
from gymrpc.v1 import weights_service_pb2, weights_service_pb2_grpc

CHUNK_BYTES = 4 * 1024 * 1024
"""Bytes per `WeightsChunk` (the server's limit)."""
UPDATE_TIMEOUT = 600.0
"""Default overall deadline of one update, retries and uploading included."""
MODES = {
    "keep": weights_service_pb2.WEIGHT_UPDATE_MODE_KEEP,
    "cut": weights_service_pb2.WEIGHT_UPDATE_MODE_CUT,
    "drain": weights_service_pb2.WEIGHT_UPDATE_MODE_DRAIN,
}
_SERVICE = weights_service_pb2.DESCRIPTOR.services_by_name["WeightsService"]


async def update_weights(
    client: Client,
    name: str,
    *,
    weight_version: str,
    path: str | os.PathLike[str] | None = None,
    stream_from: str | os.PathLike[str] | None = None,
    mode: str = "keep",
    request_id: str | None = None,
    timeout: float | None = None,
) -> weights_service_pb2.UpdateWeightsResponse:
    """Load new weights into every replica of the model server `name`.

    Args:
        client: a `gymrpc.Client` of the stack (it carries the control token).
        name: the model server's stable name (for example `model/policy`).
        weight_version: the new weights' name; every token they produce reports it.
        path: a safetensors folder the server reads (made absolute here).
        stream_from: a safetensors folder on this host, streamed to the server.
        mode: `keep` (continue running generations, nothing recomputed), `cut` (cut and
            continue them from their tokens so far) or `drain` (finish them first).
        request_id: the update's idempotency key (default: a fresh one; pass your own to
            retry an update across restarts of your own process).
        timeout: overall deadline in seconds (default `UPDATE_TIMEOUT`).

    Raises the `gymrpc.errors` class of the server's refusal: `InvalidArgument`
    (CORRUPT_WEIGHTS, INVALID_REQUEST), `FailedPrecondition` (WEIGHTS_MISMATCH), `Aborted`
    (CHECKPOINT_CONFLICT), `Unimplemented` (a backend that cannot load weights). A refused
    update leaves the old weights serving.
    """
    if (path is None) == (stream_from is None):
        raise ValueError("pass exactly one of path= (the server reads it) or stream_from= (streamed)")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    request_id = request_id or f"weights-{uuid.uuid4().hex}"
    timeout = UPDATE_TIMEOUT if timeout is None else timeout
    endpoints = [e.endpoint_id for e in await client.registry.resolve(name)]
    if path is not None:
        request = weights_service_pb2.UpdateWeightsRequest(
            request_id=request_id, weight_version=weight_version, path=_absolute(path), mode=MODES[mode]
        )

        async def one(endpoint_id: str) -> weights_service_pb2.UpdateWeightsResponse:
            stub: Any = client.stub(
                name, weights_service_pb2_grpc.WeightsServiceStub, _SERVICE, endpoint_id=endpoint_id
            )
            return await stub.UpdateWeights(request, timeout=timeout)

    else:
        folder = Path(stream_from)  # type: ignore[arg-type]
        files = await asyncio.to_thread(describe_folder, folder)
        header = weights_service_pb2.UploadWeightsHeader(
            request_id=request_id, weight_version=weight_version, mode=MODES[mode], files=files
        )

        async def one(endpoint_id: str) -> weights_service_pb2.UpdateWeightsResponse:
            return await _upload(client, name, endpoint_id, header, folder, timeout)

    replies = await asyncio.gather(*(one(e) for e in endpoints))
    return merge(replies)


async def get_weights(client: Client, name: str) -> str:
    """The weight version the model server `name` serves now (one replica's, if several)."""
    reply = await client.weights(name).GetWeights(weights_service_pb2.GetWeightsRequest())
    return reply.weight_version


def _absolute(path: str | os.PathLike[str]) -> str:
    """`path` made absolute against this process's cwd (the server cannot know it)."""
    return os.path.abspath(path)


def describe_folder(folder: Path) -> list[weights_service_pb2.WeightsFile]:
    """Each regular `*.safetensors` file of `folder` with its size and sha256, in name order."""
    out = []
    for entry in sorted(folder.iterdir()):
        if not entry.name.endswith(".safetensors"):
            continue
        info = entry.lstat()
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{entry} is not a regular file; weights are streamed from regular files only")
        digest = hashlib.sha256()
        with entry.open("rb") as f:
            while block := f.read(CHUNK_BYTES):
                digest.update(block)
        out.append(weights_service_pb2.WeightsFile(name=entry.name, size_bytes=info.st_size, sha256=digest.hexdigest()))
    if not out:
        raise ValueError(f"{folder} holds no .safetensors files")
    return out


def upload_messages(
    header: weights_service_pb2.UploadWeightsHeader, folder: Path, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[weights_service_pb2.UploadWeightsRequest]:
    """The messages of one upload: the header, then every file's bytes in order."""
    yield weights_service_pb2.UploadWeightsRequest(header=header)
    for index, file in enumerate(header.files):
        with (folder / file.name).open("rb") as f:
            offset = 0
            while block := f.read(chunk_bytes):
                chunk = weights_service_pb2.WeightsChunk(file_index=index, offset=offset, data=block)
                yield weights_service_pb2.UploadWeightsRequest(chunk=chunk)
                offset += len(block)


async def _messages(
    header: weights_service_pb2.UploadWeightsHeader, folder: Path
) -> AsyncIterator[weights_service_pb2.UploadWeightsRequest]:
    messages = upload_messages(header, folder)
    while (message := await asyncio.to_thread(next, messages, None)) is not None:
        yield message


async def _upload(
    client: Client,
    name: str,
    endpoint_id: str,
    header: weights_service_pb2.UploadWeightsHeader,
    folder: Path,
    timeout: float,
) -> weights_service_pb2.UpdateWeightsResponse:
    """Stream to one replica; after UNAVAILABLE, stream again (the request id de-duplicates)."""
    attempts = client._attempts(name, _SERVICE.methods_by_name["UploadWeights"].full_name, timeout, None, endpoint_id)
    try:
        address, left = await anext(attempts)
        while True:
            stub = client.stub_at(address, weights_service_pb2_grpc.WeightsServiceStub)
            try:
                return await stub.UploadWeights(_messages(header, folder), timeout=left, metadata=client._metadata)
            except grpc.RpcError as exc:
                err = from_rpc_error(exc)
                if not _is_retryable(err):
                    raise err from exc
                if err.retry_delay:
                    await asyncio.sleep(min(err.retry_delay, left))
                address, left = await attempts.asend(err)
    finally:
        await attempts.aclose()


def merge(replies: list[weights_service_pb2.UpdateWeightsResponse]) -> weights_service_pb2.UpdateWeightsResponse:
    """One reply for all replicas: counts summed, the longest pause and load, applied by all."""
    if len(replies) == 1:
        return replies[0]
    out = weights_service_pb2.UpdateWeightsResponse()
    out.CopyFrom(max(replies, key=lambda r: r.pause_duration.ToNanoseconds()))
    out.generations_kept = sum(r.generations_kept for r in replies)
    out.generations_cut = sum(r.generations_cut for r in replies)
    out.generations_drained = sum(r.generations_drained for r in replies)
    out.tokens_recomputed = sum(r.tokens_recomputed for r in replies)
    out.already_applied = all(r.already_applied for r in replies)
    out.load_duration.CopyFrom(max((r.load_duration for r in replies), key=lambda d: d.ToNanoseconds()))
    return out


_NUMBER = re.compile(r"(\d+)$")


def version_number(version: str) -> int | None:
    """The number a version name ends in (`iteration:107` -> 107), or None."""
    match = _NUMBER.search(version)
    return int(match.group(1)) if match else None


def policy_lag(oldest: str, current: str, history: Sequence[str] = ()) -> int | None:
    """How many versions `oldest` is behind `current`; None when it cannot be told.

    Versions named with a trailing number (`iteration:107`, the trainer's step) are compared
    by it, which holds across model server restarts. Otherwise the model server's own record
    of versions served (`GetWeightsResponse.recent_versions`) counts the updates between them.
    """
    if not oldest or oldest == current:
        return 0
    a, b = version_number(oldest), version_number(current)
    if a is not None and b is not None:
        return max(0, b - a)
    seen = list(history)
    if oldest in seen and current in seen:
        return max(0, seen.index(current) - seen.index(oldest))
    return None


async def served_versions(client: Client, name: str) -> tuple[str, list[str]]:
    """(current version, versions served since start) of the model server `name`."""
    reply = await client.weights(name).GetWeights(weights_service_pb2.GetWeightsRequest())
    return reply.weight_version, list(reply.recent_versions) or [reply.weight_version]
