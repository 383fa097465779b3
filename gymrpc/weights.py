"""Put new weights into a model server while its episodes run: the trainer's side of `WeightsService`.

    reply = await update_weights(client, "model/policy", weight_version="iteration:8", path="/ckpt/it8")
    reply = await update_weights(client, "model/policy", weight_version="iteration:9", stream_from="/ckpt/it9")
    transfer = await WeightTransfer.open(client, "model/policy", master_address=HOST)    # GPU: vLLM's NCCL engine
    reply = await transfer.send(model, weight_version="iteration:10")

`path` makes the server read the folder itself (shared storage, the same host); `stream_from`
sends the folder's `*.safetensors` files over the call in 4 MiB chunks, each file's sha256
in the header, for a server that cannot see the trainer's disk. `WeightTransfer` sends a
CUDA model's tensors through vLLM's weight-transfer engine (NCCL broadcast, or CUDA IPC),
with no files at all. Every replica registered
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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
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
    endpoints: Sequence[str] | None = None,
) -> weights_service_pb2.UpdateWeightsResponse:
    """Load new weights into every replica of the model server `name` (or those of `endpoints`).

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
        endpoints: only these replicas (endpoint ids, `served_by_replica`), for example those a
            restart left serving other weights.

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
    if endpoints is None:
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


async def served_by_replica(client: Client, name: str) -> dict[str, str]:
    """The weight version each replica of the model server `name` serves now, by endpoint id."""
    request = weights_service_pb2.GetWeightsRequest()
    ids = [e.endpoint_id for e in await client.registry.resolve(name)]
    replies = await _each_replica(client, name, lambda stub: stub.GetWeights(request), ids)
    return {endpoint_id: reply.weight_version for endpoint_id, reply in zip(ids, replies, strict=True)}


async def served_versions(client: Client, name: str) -> tuple[str, list[str]]:
    """(current version, versions served since start) of the model server `name`."""
    reply = await client.weights(name).GetWeights(weights_service_pb2.GetWeightsRequest())
    return reply.weight_version, list(reply.recent_versions) or [reply.weight_version]


# -- weights through vLLM's weight-transfer engine (NCCL, CUDA IPC; GPU only) --------------------------

TRANSFER_ENGINES = {
    "nccl": weights_service_pb2.WEIGHT_TRANSFER_ENGINE_NCCL,
    "ipc": weights_service_pb2.WEIGHT_TRANSFER_ENGINE_IPC,
}


def tensor_metadata(tensors: Iterable[tuple[str, Any]]) -> list[weights_service_pb2.TensorMetadata]:
    """`TensorMetadata` (safetensors dtype names) of `(name, torch tensor)` pairs, in their order."""
    from gymrpc.servers.model.weights.transfer import SAFETENSORS_DTYPES

    out = []
    for name, tensor in tensors:
        torch_name = str(tensor.dtype).rpartition(".")[2]
        if torch_name not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot name")
        out.append(
            weights_service_pb2.TensorMetadata(
                name=name, dtype=SAFETENSORS_DTYPES[torch_name], shape=[int(d) for d in tensor.shape]
            )
        )
    return out


def checkpoint_tensors(weights: Any) -> list[tuple[str, Any]]:
    """`(name, tensor)` pairs as the model's safetensors files name them, from a module or a state dict.

    A `torch.nn.Module` gives its parameters once each (a tied LM head under the embedding's
    name, as `save_pretrained` writes it) and its persistent buffers; a mapping is taken as is.
    The model server checks the names, dtypes and shapes against its checkpoint before receiving.
    """
    if isinstance(weights, Mapping):
        return list(weights.items())
    parameters = list(weights.named_parameters())
    every = {name for name, _ in weights.named_parameters(remove_duplicate=False)}
    buffers = [(n, t) for n, t in weights.state_dict().items() if n not in every]
    return [(name, p.detach()) for name, p in parameters] + buffers


async def _each_replica(
    client: Client, name: str, call: Callable[[Any], Awaitable[Any]], endpoints: Sequence[str] | None = None
) -> list[Any]:
    ids = list(endpoints) if endpoints is not None else [e.endpoint_id for e in await client.registry.resolve(name)]

    async def one(endpoint_id: str) -> Any:
        stub: Any = client.stub(name, weights_service_pb2_grpc.WeightsServiceStub, _SERVICE, endpoint_id=endpoint_id)
        return await call(stub)

    return list(await asyncio.gather(*(one(e) for e in ids)))


async def transfer_update(
    client: Client,
    name: str,
    tensors: Sequence[weights_service_pb2.TensorMetadata],
    *,
    weight_version: str,
    engine: str = "nccl",
    mode: str = "keep",
    request_id: str | None = None,
    validate_only: bool = False,
    ipc_handles_pickled: bytes = b"",
    endpoints: Sequence[str] | None = None,
    timeout: float | None = None,
) -> weights_service_pb2.UpdateWeightsResponse:
    """`UpdateWeights` with `transfer` set, on every replica: the RPC half of a transfer.

    The tensors themselves travel through the group `WeightTransfer.open` made, sent while this
    call runs (`WeightTransfer.send` does both). With `validate_only` the servers check
    everything and receive nothing.
    """
    if engine not in TRANSFER_ENGINES:
        raise ValueError(f"engine must be one of {sorted(TRANSFER_ENGINES)}, got {engine!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    request = weights_service_pb2.UpdateWeightsRequest(
        request_id=request_id or f"weights-{uuid.uuid4().hex}",
        weight_version=weight_version,
        mode=MODES[mode],
        transfer=weights_service_pb2.TransferredWeights(
            engine=TRANSFER_ENGINES[engine],
            tensors=tensors,
            ipc_handles_pickled=ipc_handles_pickled,
            validate_only=validate_only,
        ),
    )
    deadline = UPDATE_TIMEOUT if timeout is None else timeout
    replies = await _each_replica(client, name, lambda stub: stub.UpdateWeights(request, timeout=deadline), endpoints)
    return merge(replies)


async def init_transfer(
    client: Client,
    name: str,
    *,
    engine: str = "nccl",
    master_address: str = "",
    master_port: int = 0,
    world_size: int = 0,
    rank_offsets: Mapping[str, int] | None = None,
    packed: bool = False,
    packed_buffer_size_bytes: int = 0,
    packed_num_buffers: int = 0,
    request_id: str | None = None,
    timeout: float = 300.0,
) -> list[weights_service_pb2.InitWeightTransferResponse]:
    """`InitWeightTransfer` on every replica (`rank_offsets`: endpoint id -> its first rank; NCCL only).

    For NCCL each call returns only once the trainer joined the rendezvous as rank 0: run it
    while the trainer opens its endpoint (`WeightTransfer.open` does).
    """
    if engine not in TRANSFER_ENGINES:
        raise ValueError(f"engine must be one of {sorted(TRANSFER_ENGINES)}, got {engine!r}")
    request_id = request_id or f"transfer-{uuid.uuid4().hex}"
    offsets = dict(rank_offsets) if rank_offsets is not None else None
    endpoints = list(offsets) if offsets is not None else None

    async def call(stub: Any, endpoint_id: str) -> Any:
        request = weights_service_pb2.InitWeightTransferRequest(
            request_id=request_id,
            engine=TRANSFER_ENGINES[engine],
            master_address=master_address,
            master_port=master_port,
            world_size=world_size,
            rank_offset=(offsets or {}).get(endpoint_id, 1),
            packed=packed,
            packed_buffer_size_bytes=packed_buffer_size_bytes,
            packed_num_buffers=packed_num_buffers,
        )
        return await stub.InitWeightTransfer(request, timeout=timeout)

    ids = endpoints if endpoints is not None else [e.endpoint_id for e in await client.registry.resolve(name)]

    async def one(endpoint_id: str) -> Any:
        stub: Any = client.stub(name, weights_service_pb2_grpc.WeightsServiceStub, _SERVICE, endpoint_id=endpoint_id)
        return await call(stub, endpoint_id)

    return list(await asyncio.gather(*(one(e) for e in ids)))


class WeightTransfer:
    """A trainer's weight-transfer group with every replica of a vLLM model server (GPU only).

        transfer = await WeightTransfer.open(client, "model/policy", master_address="10.0.0.5", master_port=29555)
        reply = await transfer.send(model, weight_version="iteration:8", mode="keep")
        await transfer.close()

    Built on vLLM's own trainer-side sender (`vllm.distributed.weight_transfer.factory.
    WeightTransferTrainerFactory.trainer_init`, `NCCLTrainerWeightTransferEngine` /
    `IPCTrainerWeightTransferEngine`, `send_weights`), with gymrpc's `WeightsService` as its
    control plane (vLLM's `VLLMWeightSyncClient` protocol): vLLM's engine opens the trainer's NCCL
    endpoint (rank 0) while `InitWeightTransfer` has the workers join, and broadcasts while
    `UpdateWeights(transfer=...)` has them receive inside the update's pause. The model server
    runs `--backend vllm --weight-transfer nccl` (or `ipc`) on CUDA GPUs; the trainer needs a CUDA
    device (its tensors are copied there to be sent) and vLLM installed.

    Before each send the tensor list is validated by every replica (`validate_only`), so a
    refused update (a mismatch, a checkpoint open) fails before any tensor moves. If the update
    call fails once the broadcast has started, the group is aborted (NCCL's `ncclCommAbort`) so
    the trainer never hangs; open a new one.
    """

    def __init__(self, client: Client, name: str, engine: str, endpoints: list[str], device: Any) -> None:
        self.client = client
        self.name = name
        self.engine = engine
        self.endpoints = endpoints
        self.device = device
        self._source = _SendSource(device)
        self._sender: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._offsets: dict[str, int] = {}
        self._world_size = 0
        self._init: dict[str, Any] = {}
        self._update: dict[str, Any] | None = None
        self._replies: list[weights_service_pb2.UpdateWeightsResponse] = []

    @classmethod
    async def open(
        cls,
        client: Client,
        name: str,
        *,
        engine: str = "nccl",
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        packed: bool = True,
        device: Any = None,
        timeout: float = 300.0,
    ) -> WeightTransfer:
        """Rendezvous with every replica's inference workers; `master_port` 0 picks a free port."""
        import torch

        if engine not in TRANSFER_ENGINES:
            raise ValueError(f"engine must be one of {sorted(TRANSFER_ENGINES)}, got {engine!r}")
        if not torch.cuda.is_available():
            raise RuntimeError("a weight transfer sends from a CUDA device and this trainer has none")
        endpoints = [e.endpoint_id for e in await client.registry.resolve(name)]
        states = await _each_replica(
            client, name, lambda stub: stub.GetWeights(weights_service_pb2.GetWeightsRequest()), endpoints
        )
        index = torch.cuda.current_device() if device is None else torch.device(device).index or 0
        transfer = cls(client, name, engine, endpoints, torch.device("cuda", index))
        transfer._loop = asyncio.get_running_loop()
        offset = 1
        for endpoint_id, state in zip(endpoints, states, strict=True):
            transfer._offsets[endpoint_id] = offset
            offset += max(1, state.transfer_workers)
        transfer._world_size = offset
        if any(s.transfer_unavailable for s in states):
            # The servers say why (UNIMPLEMENTED with its reason, checked before any other field);
            # nothing is opened on this side.
            await init_transfer(client, name, engine=engine, rank_offsets=transfer._offsets, timeout=timeout)
            raise RuntimeError(f"{name} cannot open a weight transfer: {[s.transfer_unavailable for s in states]}")
        if master_port == 0:
            master_port = _free_port(master_address)
        transfer._init = {"master_address": master_address, "master_port": master_port, "timeout": timeout}
        transfer._sender = await asyncio.to_thread(transfer._trainer_init, packed)
        return transfer

    def _trainer_init(self, packed: bool) -> Any:
        """vLLM's trainer-side engine; calls `init_weight_transfer_engine` below while it opens rank 0."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        if self.engine == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            info: Any = NCCLTrainerInitInfo(
                master_address=self._init["master_address"],
                master_port=self._init["master_port"],
                world_size=self._world_size,
                packed=packed,
                rank=0,
            )
        else:
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            info = IPCTrainerInitInfo(packed=False, rank=0)  # one update per call (see InitWeightTransfer)
        with _on_device(self.device):
            return WeightTransferTrainerFactory.trainer_init(info, client=_SyncClient(self), source=self._source)

    async def send(
        self,
        weights: Any,
        *,
        weight_version: str,
        mode: str = "keep",
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> weights_service_pb2.UpdateWeightsResponse:
        """Send `weights` (a module or a state dict, on any device) as `weight_version` to every replica."""
        if self._sender is None:
            raise RuntimeError("this weight transfer is closed; open a new one")
        pairs = checkpoint_tensors(weights)
        metadata = tensor_metadata(pairs)
        common = {"weight_version": weight_version, "engine": self.engine, "mode": mode, "endpoints": self.endpoints}
        await transfer_update(self.client, self.name, metadata, validate_only=True, timeout=timeout, **common)
        self._source.pairs = pairs
        self._update = {**common, "request_id": request_id or f"weights-{uuid.uuid4().hex}", "timeout": timeout}
        self._replies = []
        try:
            await asyncio.to_thread(self._send_weights)
        finally:
            self._source.pairs = []
            self._update = None
        return merge(self._replies)

    def _send_weights(self) -> None:
        with _on_device(self.device):
            self._sender.send_weights()

    def _abort(self) -> None:
        """Unblock a broadcast whose receivers will never come (NCCL), and drop the group."""
        group = getattr(self._sender, "model_update_group", None)
        if group is not None:
            group.destroy()
            self._sender.model_update_group = None
        self._sender = None

    async def close(self) -> None:
        """Tear the trainer's side of the group down (the servers keep theirs until the next open)."""
        if self._sender is not None:
            sender, self._sender = self._sender, None
            await asyncio.to_thread(sender.shutdown)


class _SendSource:
    """vLLM's `WeightSource` (its `metadata()` and iteration) over the pairs of the current send.

    Each tensor is copied to the CUDA device as it is sent, so a trainer on the CPU (the reference
    trainer) needs one GPU only for sending.
    """

    def __init__(self, device: Any) -> None:
        self.device = device
        self.pairs: list[tuple[str, Any]] = []

    def metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.pairs]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for name, tensor in self.pairs:
            yield name, tensor.detach().to(self.device).contiguous()


class _SyncClient:
    """vLLM's `VLLMWeightSyncClient` (four synchronous methods, called from vLLM's threads) over `WeightsService`.

    `start_weight_update` and `finish_weight_update` do nothing here: the model server runs vLLM's
    start/update/finish inside one `UpdateWeights` call, within the pause of the update's mode.
    """

    def __init__(self, transfer: WeightTransfer) -> None:
        self.transfer = transfer

    def _run(self, coro: Awaitable[Any]) -> Any:
        loop = self.transfer._loop
        assert loop is not None
        return asyncio.run_coroutine_threadsafe(coro, loop).result()  # type: ignore[arg-type]

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        t = self.transfer
        self._run(
            init_transfer(
                t.client,
                t.name,
                engine=t.engine,
                master_address=str(init_info.get("master_address", "")),
                master_port=int(init_info.get("master_port", 0)),
                world_size=int(init_info.get("world_size", 0)),
                rank_offsets=t._offsets,
                packed=bool(init_info.get("packed", False)),
                packed_buffer_size_bytes=int(init_info.get("packed_buffer_size_bytes", 0)),
                packed_num_buffers=int(init_info.get("packed_num_buffers", 0)),
                timeout=t._init["timeout"],
            )
        )

    def start_weight_update(self) -> None:
        return None

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        import pickle

        t = self.transfer
        update = t._update
        assert update is not None
        assert isinstance(update_info, dict)
        handles = b""
        if t.engine == "ipc":
            handles = pickle.dumps(update_info["ipc_handles"])  # opened by vLLM's workers only
        try:
            reply = self._run(
                transfer_update(
                    t.client, t.name, tensor_metadata(t._source.pairs), ipc_handles_pickled=handles, **update
                )
            )
        except BaseException:
            t._abort()  # the broadcast on the other thread must not wait for receivers that never come
            raise
        t._replies.append(reply)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        return None


def _on_device(device: Any) -> Any:
    """The CUDA device vLLM's trainer engine uses (it reads the current device index) for this thread."""
    import torch

    return torch.cuda.device(device)


def _free_port(host: str) -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
