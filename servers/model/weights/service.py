"""`gymrpc.v1.WeightsService`: check, stage and apply new weights, once per request id.

Order of an update, each step refusing with nothing changed: the request's fields; no
checkpoint open; the folder (`open_folder`: a directory of regular safetensors files within
the bounds) and its tensors against the loaded model's; staging (the backend reads every
tensor); then, holding the switch's lock and checking the checkpoint again, the swap. A reply
is remembered by request id (bounded), so a retried update returns it and loads nothing;
the same id with other arguments is refused. A failed update is not remembered.

An update through a weight-transfer engine (`transfer` set, `weights.transfer`) takes the same
steps with the tensor list in place of the folder: the backend can use the engine and its group
is open, the list matches the loaded model's tensors; nothing is staged (the tensors are not
here yet), and inside the pause the backend receives and loads them while the trainer sends.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import duration_pb2, timestamp_pb2

from gymrpc.control import ControlPlane
from gymrpc.control.types import Phase
from gymrpc.errors import Aborted, InvalidArgument, Unimplemented
from gymrpc.launch.private import PrivateFolder
from gymrpc.servers.bootstrap import ServiceBinding
from gymrpc.servers.model.weights import transfer, upload
from gymrpc.servers.model.weights.folder import DEFAULT_MAX_TOTAL_BYTES, check_matches, open_folder
from gymrpc.servers.model.weights.switch import Applied, Mode, WeightSwitch
from gymrpc.servers.model.weights.transfer import TransferPlan
from gymrpc.v1 import weights_service_pb2 as pb
from gymrpc.v1 import weights_service_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["WeightsService"]
MAX_ID = 256
MAX_VERSION = 256
REMEMBERED = 1024
"""Replies kept for retries (the newest)."""
MODES = {
    pb.WEIGHT_UPDATE_MODE_UNSPECIFIED: Mode.KEEP,
    pb.WEIGHT_UPDATE_MODE_KEEP: Mode.KEEP,
    pb.WEIGHT_UPDATE_MODE_CUT: Mode.CUT,
    pb.WEIGHT_UPDATE_MODE_DRAIN: Mode.DRAIN,
}
MODE_PB = {
    Mode.KEEP: pb.WEIGHT_UPDATE_MODE_KEEP,
    Mode.CUT: pb.WEIGHT_UPDATE_MODE_CUT,
    Mode.DRAIN: pb.WEIGHT_UPDATE_MODE_DRAIN,
}


STAGING_PREFIX = "gymrpc-weights-"


def _private_staging(parent: Path | None) -> PrivateFolder:
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    return PrivateFolder(STAGING_PREFIX, parent)


def _bad(message: str, field: str) -> InvalidArgument:
    return InvalidArgument(message, metadata={"field": field})


def check_request_id(request_id: str) -> None:
    if not request_id or len(request_id) > MAX_ID or not request_id.isprintable():
        raise _bad(f"request_id must be 1 to {MAX_ID} printable characters (reuse it to retry)", "request_id")


def check_update(request_id: str, version: str, mode: int) -> Mode:
    check_request_id(request_id)
    if not version or len(version) > MAX_VERSION or not version.isprintable() or version != version.strip():
        raise _bad(
            f"weight_version must be 1 to {MAX_VERSION} printable characters, no surrounding spaces", "weight_version"
        )
    if mode not in MODES:
        raise _bad(f"mode {mode} is not a WeightUpdateMode", "mode")
    return MODES[mode]


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


class WeightsServicer(pb_grpc.WeightsServiceServicer):
    def __init__(
        self,
        switch: WeightSwitch,
        *,
        plane: ControlPlane | None = None,
        staging_dir: Path | None = None,
        max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
        roots: tuple[Path, ...] = (),
    ) -> None:
        self.switch = switch
        self.plane = plane
        self.staging_dir = staging_dir
        self.max_total_bytes = max_total_bytes
        self.roots = tuple(Path(os.path.realpath(r)) for r in roots)
        """When set, `UpdateWeights.path` must lie inside one of these folders."""
        self._replies: OrderedDict[str, tuple[str, Any]] = OrderedDict()
        self._running: dict[str, tuple[str, asyncio.Future[Any]]] = {}
        self._staging: PrivateFolder | None = None
        self._staging_lock = asyncio.Lock()

    async def _staging_root(self) -> Path:
        """This process's staging folder, made at its first upload: a random 0700 name, not one another user
        of a shared $TMPDIR could make first, removed by `close`, and by the next server's if this one is
        killed mid-upload (else the gigabytes it staged stay on the node)."""
        async with self._staging_lock:
            if self._staging is None:
                self._staging = await asyncio.to_thread(_private_staging, self.staging_dir)
            return self._staging.path

    def close(self) -> None:
        if self._staging is not None:
            self._staging.remove()
            self._staging = None

    # -- RPCs -------------------------------------------------------------------------------

    async def UpdateWeights(
        self, request: pb.UpdateWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        mode = check_update(request.request_id, request.weight_version, request.mode)
        if request.HasField("transfer"):
            if request.path:
                raise _bad("set path or transfer, not both", "path")
            plan = transfer.check_transfer(request.transfer)
            if request.transfer.validate_only:
                return await self._validate_transfer(plan, request.weight_version)

            async def by_transfer() -> pb.UpdateWeightsResponse:
                return await self.apply(await self.stage_transfer(plan, request.weight_version), mode)

            return await self._once(request.request_id, _fingerprint(request), by_transfer)
        fingerprint = _fingerprint(request)

        async def work() -> pb.UpdateWeightsResponse:
            folder = self._check_path(request.path)
            return await self._update(folder, request.weight_version, mode)

        return await self._once(request.request_id, fingerprint, work)

    async def InitWeightTransfer(
        self, request: pb.InitWeightTransferRequest, context: grpc.aio.ServicerContext
    ) -> pb.InitWeightTransferResponse:
        check_request_id(request.request_id)
        engine = transfer.engine_name(request.engine, "engine")
        if (why := self.switch.transfer_unsupported(engine)) is not None:
            raise why  # before the other fields: what is missing matters more than how they were filled
        init = transfer.check_init(request)
        transfer.check_workers(init, self.switch.transfer_engine()[1])

        async def work() -> pb.InitWeightTransferResponse:
            async with self.switch.lock:  # no update runs while the group is (re)opened
                workers = await self.switch.init_transfer(init)
            log.info("weight transfer open", extra={"engine": init.engine, "workers": workers})
            return pb.InitWeightTransferResponse(engine=request.engine, workers=workers)

        return await self._once(f"init-transfer/{request.request_id}", _fingerprint(request), work)

    async def UploadWeights(
        self, request_iterator: AsyncIterator[pb.UploadWeightsRequest], context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("part") != "header":
            raise _bad("the first message of UploadWeights must be a header", "header")
        header = first.header
        mode = check_update(header.request_id, header.weight_version, header.mode)
        fingerprint = _fingerprint(header)

        async def work() -> pb.UpdateWeightsResponse:
            self._check_no_checkpoint()  # before receiving gigabytes that could not be applied
            folder = await upload.receive(header, request_iterator, await self._staging_root(), self.max_total_bytes)
            try:
                return await self._update(folder, header.weight_version, mode)
            finally:
                await asyncio.to_thread(shutil.rmtree, folder, True)

        return await self._once(header.request_id, fingerprint, work)

    async def GetWeights(
        self, request: pb.GetWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetWeightsResponse:
        reply = pb.GetWeightsResponse(
            weight_version=self.switch.weight_version,
            update_count=self.switch.updates,
            backend=self.switch.name,
            updatable=self.switch.weights_unsupported() is None,
            recent_versions=self.switch.versions(),
        )
        engine, workers = self.switch.transfer_engine()
        why = self.switch.transfer_unsupported(None)
        if why is None and engine:
            reply.transfer_engine = transfer.ENGINE_PB[engine]
            reply.transfer_workers = workers
        elif why is not None:
            reply.transfer_unavailable = why.message
        if self.switch.updated_at is not None:
            stamp = timestamp_pb2.Timestamp()
            stamp.FromNanoseconds(int(self.switch.updated_at * 1e9))
            reply.update_time.CopyFrom(stamp)
        return reply

    # -- once per request id ----------------------------------------------------------------

    async def _once(self, request_id: str, fingerprint: str, work: Callable[[], Awaitable[Any]]) -> Any:
        """`work()`'s reply, or the reply of the call that ran (or runs) it under `request_id`."""
        known = self._replies.get(request_id)
        if known is None and request_id in self._running:
            known_fp, future = self._running[request_id]
            self._check_same(request_id, known_fp, fingerprint)
            first = await asyncio.shield(future)
            reply = type(first)()
            reply.CopyFrom(first)
            reply.already_applied = True
            return reply
        if known is not None:
            self._check_same(request_id, known[0], fingerprint)
            reply = type(known[1])()
            reply.CopyFrom(known[1])
            reply.already_applied = True
            return reply
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._running[request_id] = (fingerprint, future)
        try:
            reply = await work()
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: there may be no concurrent retry
            raise
        finally:
            del self._running[request_id]
        future.set_result(reply)
        self._replies[request_id] = (fingerprint, reply)
        while len(self._replies) > REMEMBERED:
            self._replies.popitem(last=False)
        return reply

    @staticmethod
    def _check_same(request_id: str, known: str, fingerprint: str) -> None:
        if known != fingerprint:
            raise InvalidArgument(
                f"request_id {request_id.removeprefix('init-transfer/')!r} was already used for another weight "
                "update; use a new id",
                metadata={"field": "request_id"},
            )

    # -- the update -------------------------------------------------------------------------

    def _check_path(self, path: str) -> str:
        if not path:
            raise _bad("path is empty; name the safetensors folder (or stream it with UploadWeights)", "path")
        if len(path) > 4096 or "\0" in path:
            raise _bad("path is longer than 4096 characters or holds a NUL", "path")
        if self.roots:
            real = Path(os.path.realpath(path))
            if not any(real == root or root in real.parents for root in self.roots):
                raise _bad(f"path {path!r} is outside the folders this server loads weights from", "path")
        return path

    def _check_no_checkpoint(self) -> None:
        plane = self.plane
        if plane is None:
            return
        # A process awaiting a restore takes updates: its trainer loads the checkpoint's weights first.
        if plane.fence.phase is not Phase.IDLE:
            active = plane.fence.active
            raise Aborted(
                f"checkpoint {active} is open on this model server; a weight update would change what it "
                "captures. Nothing was loaded: update after it resumes",
                reason="CHECKPOINT_CONFLICT",
                metadata={"checkpoint_id": plane.fence.active or ""},
            )

    async def _update(self, path: str | Path, version: str, mode: Mode) -> pb.UpdateWeightsResponse:
        return await self.apply(await self.stage(path, version), mode)

    async def stage(self, path: str | Path, version: str) -> Staged:
        """Check everything and read the new weights in; nothing serving changes."""
        self._check_no_checkpoint()
        if (why := self.switch.weights_unsupported()) is not None:
            raise Unimplemented(why)
        if version == self.switch.weight_version:
            raise _bad(
                f"weight_version {version!r} is already serving; name new weights with a new version", "weight_version"
            )
        started = time.monotonic()
        folder = await asyncio.to_thread(open_folder, path, max_total_bytes=self.max_total_bytes)
        specs = self.switch.weight_specs()
        if specs is not None:
            check_matches(folder.specs(), specs)
        staged = await self.switch.stage(folder)
        return Staged(folder, staged, version, time.monotonic() - started, len(folder.tensors), folder.size_bytes)

    def _check_transfer(self, plan: TransferPlan, version: str) -> None:
        """Everything an update through a transfer engine needs, short of receiving it."""
        self._check_no_checkpoint()
        if (why := self.switch.transfer_unsupported(plan.engine)) is not None:
            raise why
        if version == self.switch.weight_version:
            raise _bad(
                f"weight_version {version!r} is already serving; name new weights with a new version", "weight_version"
            )
        opened = self.switch.transfer_open()
        if opened != plan.engine:
            raise transfer.not_initialized(plan.engine, opened)
        specs = self.switch.weight_specs()
        if specs is not None:
            check_matches(plan.specs(), specs)

    async def stage_transfer(self, plan: TransferPlan, version: str) -> Staged:
        """Check a transfer's tensors; nothing is read (they arrive inside the pause)."""
        started = time.monotonic()
        self._check_transfer(plan, version)
        return Staged(plan, plan, version, time.monotonic() - started, len(plan.tensors), plan.size_bytes)

    async def _validate_transfer(self, plan: TransferPlan, version: str) -> pb.UpdateWeightsResponse:
        started = time.monotonic()
        self._check_transfer(plan, version)
        current = self.switch.weight_version
        reply = pb.UpdateWeightsResponse(
            weight_version=current,
            previous_weight_version=current,
            tensor_count=len(plan.tensors),
            size_bytes=plan.size_bytes,
        )
        reply.stage_duration.CopyFrom(_duration(time.monotonic() - started))
        return reply

    async def apply(self, staged: Staged, mode: Mode) -> pb.UpdateWeightsResponse:
        """Swap staged weights in under `mode`, unless a checkpoint opened meanwhile."""
        version, stage_s = staged.version, staged.stage_s
        async with self.switch.lock:
            self._check_no_checkpoint()  # one may have opened while we staged
            applied = await self.switch.apply(staged.backend_staged, version, mode)
        log.info(
            "weights updated",
            extra={
                "weight_version": version,
                "previous": applied.previous,
                "mode": mode.value,
                "pause_s": round(applied.pause_s, 4),
                "kept": applied.kept,
                "cut": applied.cut,
                "drained": applied.drained,
            },
        )
        reply = _reply(applied, staged.tensor_count, staged.size_bytes)
        reply.stage_duration.CopyFrom(_duration(stage_s))
        return reply


@dataclass(frozen=True)
class Staged:
    """New weights checked and read in (or, for a transfer, checked), not yet serving."""

    folder: Any
    """The `WeightsFolder`, or the `TransferPlan` of a transfer."""
    backend_staged: Any
    version: str
    stage_s: float
    tensor_count: int = 0
    size_bytes: int = 0


def _fingerprint(message: Any) -> str:
    return hashlib.sha256(message.SerializeToString(deterministic=True)).hexdigest()


def _reply(applied: Applied, tensors: int, size: int) -> pb.UpdateWeightsResponse:
    return pb.UpdateWeightsResponse(
        weight_version=applied.version,
        previous_weight_version=applied.previous,
        pause_duration=_duration(applied.pause_s),
        generations_kept=applied.kept,
        generations_cut=applied.cut,
        generations_drained=applied.drained,
        tokens_recomputed=applied.recomputed,
        mode=MODE_PB[applied.mode],
        tensor_count=tensors,
        size_bytes=size,
        load_duration=_duration(applied.load_s),
    )


def weights_binding(servicer: WeightsServicer) -> ServiceBinding:
    """The WeightsService binding; every method needs the control token."""
    return ServiceBinding(
        SERVICE,
        servicer,
        pb_grpc.add_WeightsServiceServicer_to_server,
        control_methods=[m.name for m in SERVICE.methods],
    )
