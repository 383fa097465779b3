"""Weights through the inference engine's own weight-transfer engine: NCCL broadcast or CUDA IPC.

The third way new weights reach a model server, beside a folder it reads and files streamed
over gRPC. The trainer opens a group once (`InitWeightTransfer`: vLLM's
`init_weight_transfer_engine`, whose NCCL rendezvous the trainer joins as rank 0), then each
update names its tensors (`UpdateWeights.transfer`: name, dtype, shape of each, in the order the
trainer sends them). Those are checked here exactly as a folder's headers are, against the
loaded model's checkpoint, before anything is received; the backend then receives and loads
them inside the update's pause (vLLM's `start_weight_update`, `update_weights`,
`finish_weight_update`) while the trainer sends.

Only the metadata crosses gRPC. IPC handles are carried as the trainer pickled them and are
never unpickled in this process: vLLM's workers open them, and only when they were started with
`VLLM_ALLOW_INSECURE_SERIALIZATION=1`.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from gymrpc.errors import FailedPrecondition, InvalidArgument, Unimplemented
from gymrpc.servers.model.weights.folder import DTYPE_BYTES, TensorSpec
from gymrpc.v1 import weights_service_pb2 as pb

NCCL, IPC = "nccl", "ipc"
ENGINES = {pb.WEIGHT_TRANSFER_ENGINE_NCCL: NCCL, pb.WEIGHT_TRANSFER_ENGINE_IPC: IPC}
ENGINE_PB = {name: value for value, name in ENGINES.items()}
MAX_TENSORS = 1_000_000
MAX_NAME = 1024
MAX_RANK = 1 << 20
MAX_IPC_BYTES = 64 * 1024 * 1024
TORCH_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "I64": "int64",
    "U64": "uint64",
    "F64": "float64",
}
"""Safetensors dtype names (the protocol's, and the checkpoint header's) -> torch's (vLLM's `dtype_names`)."""
SAFETENSORS_DTYPES = {torch: st for st, torch in TORCH_DTYPES.items()}
assert set(TORCH_DTYPES) == set(DTYPE_BYTES)


@dataclass(frozen=True)
class TransferInit:
    """A checked `InitWeightTransferRequest`."""

    engine: str
    master_address: str = ""
    master_port: int = 0
    world_size: int = 0
    rank_offset: int = 0
    packed: bool = False
    packed_buffer_size_bytes: int = 0
    packed_num_buffers: int = 0

    def vllm_init_info(self) -> dict[str, Any]:
        """The `init_info` dict of vLLM's `WeightTransferInitRequest` for this engine."""
        if self.engine == IPC:
            return {"packed": self.packed}
        info: dict[str, Any] = {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "rank_offset": self.rank_offset,
            "world_size": self.world_size,
            "packed": self.packed,
        }
        if self.packed_buffer_size_bytes:
            info["packed_buffer_size_bytes"] = self.packed_buffer_size_bytes
        if self.packed_num_buffers:
            info["packed_num_buffers"] = self.packed_num_buffers
        return info


@dataclass(frozen=True)
class TransferPlan:
    """A checked `TransferredWeights`: what the backend receives inside the pause."""

    engine: str
    tensors: tuple[tuple[str, TensorSpec], ...]
    ipc_handles_pickled: bytes = b""

    def specs(self) -> dict[str, TensorSpec]:
        return dict(self.tensors)

    @property
    def size_bytes(self) -> int:
        total = 0
        for _, spec in self.tensors:
            count = 1
            for d in spec.shape:
                count *= d
            total += count * DTYPE_BYTES[spec.dtype]
        return total

    def vllm_update_info(self) -> dict[str, Any]:
        """The `update_info` dict of vLLM's `WeightTransferUpdateRequest` (torch dtype names)."""
        info: dict[str, Any] = {
            "names": [name for name, _ in self.tensors],
            "dtype_names": [TORCH_DTYPES[spec.dtype] for _, spec in self.tensors],
            "shapes": [list(spec.shape) for _, spec in self.tensors],
        }
        if self.engine == IPC:
            info["ipc_handles_pickled"] = base64.b64encode(self.ipc_handles_pickled).decode("ascii")
        return info


def _bad(message: str, field: str) -> InvalidArgument:
    return InvalidArgument(message, metadata={"field": field})


def engine_name(value: int, field: str) -> str:
    if value not in ENGINES:
        raise _bad(f"{field} must be WEIGHT_TRANSFER_ENGINE_NCCL or WEIGHT_TRANSFER_ENGINE_IPC, got {value}", field)
    return ENGINES[value]


def check_init(request: pb.InitWeightTransferRequest) -> TransferInit:
    """The request's fields, or INVALID_ARGUMENT naming the first bad one."""
    engine = engine_name(request.engine, "engine")
    if engine == IPC:
        if request.packed:
            raise _bad(
                "packed IPC sends several chunks per update, each waiting for the previous to be read; gymrpc "
                "carries one update per UpdateWeights call: open IPC with packed=false",
                "packed",
            )
        return TransferInit(IPC)
    address = request.master_address
    if not address or len(address) > 255 or not address.isprintable() or address != address.strip():
        raise _bad(
            "master_address must name the trainer's rendezvous host (1 to 255 printable characters)", "master_address"
        )
    if not 0 < request.master_port < 65536:
        raise _bad(f"master_port must be 1 to 65535, got {request.master_port}", "master_port")
    if request.rank_offset < 1:
        raise _bad("rank_offset must be at least 1: the trainer is rank 0 of the group", "rank_offset")
    if not request.rank_offset < request.world_size <= MAX_RANK:
        raise _bad(
            f"world_size {request.world_size} must exceed rank_offset {request.rank_offset} (this server's workers "
            f"join from there) and be at most {MAX_RANK}",
            "world_size",
        )
    return TransferInit(
        NCCL,
        address,
        request.master_port,
        request.world_size,
        request.rank_offset,
        request.packed,
        request.packed_buffer_size_bytes,
        request.packed_num_buffers,
    )


def check_workers(init: TransferInit, workers: int) -> None:
    """This server's `workers` ranks must fit in the group from `rank_offset` on."""
    if init.engine == NCCL and init.rank_offset + workers > init.world_size:
        raise _bad(
            f"this model server has {workers} inference workers, ranks {init.rank_offset} to "
            f"{init.rank_offset + workers - 1}, which do not fit in world_size {init.world_size}",
            "world_size",
        )


def check_transfer(transfer: pb.TransferredWeights) -> TransferPlan:
    """The tensor list's form (names, dtypes, shapes, no duplicates), or INVALID_ARGUMENT naming the first bad one."""
    engine = engine_name(transfer.engine, "transfer.engine")
    if not transfer.tensors:
        raise _bad("transfer.tensors is empty: name every tensor the trainer sends", "transfer.tensors")
    if len(transfer.tensors) > MAX_TENSORS:
        raise _bad(f"transfer.tensors lists {len(transfer.tensors)} tensors; at most {MAX_TENSORS}", "transfer.tensors")
    seen: set[str] = set()
    tensors = []
    for k, tensor in enumerate(transfer.tensors):
        name = tensor.name
        if not name or len(name) > MAX_NAME or not name.isprintable():
            raise _bad(f"transfer.tensors[{k}].name must be 1 to {MAX_NAME} printable characters", "transfer.tensors")
        if name in seen:
            raise _bad(f"tensor {name!r} is listed twice in transfer.tensors", "transfer.tensors")
        seen.add(name)
        if tensor.dtype not in DTYPE_BYTES:
            raise _bad(
                f"tensor {name!r} has dtype {tensor.dtype!r}; use a safetensors dtype name ({', '.join(DTYPE_BYTES)})",
                "transfer.tensors.dtype",
            )
        if len(tensor.shape) > 64 or any(d >= 1 << 48 for d in tensor.shape):
            raise _bad(f"tensor {name!r} has an implausible shape {list(tensor.shape)}", "transfer.tensors.shape")
        tensors.append((name, TensorSpec(tensor.dtype, tuple(int(d) for d in tensor.shape))))
    if engine == IPC and not transfer.ipc_handles_pickled and not transfer.validate_only:
        raise _bad("an IPC transfer carries its tensors' handles in transfer.ipc_handles_pickled", "transfer")
    if engine == NCCL and transfer.ipc_handles_pickled:
        raise _bad("transfer.ipc_handles_pickled is for IPC transfers only", "transfer.ipc_handles_pickled")
    if len(transfer.ipc_handles_pickled) > MAX_IPC_BYTES:
        raise _bad(f"transfer.ipc_handles_pickled is over {MAX_IPC_BYTES} bytes", "transfer.ipc_handles_pickled")
    return TransferPlan(engine, tuple(tensors), bytes(transfer.ipc_handles_pickled))


def needs_cuda(message: str) -> Unimplemented:
    """UNIMPLEMENTED WEIGHT_TRANSFER_NEEDS_CUDA: the engines exist, the GPUs do not."""
    return Unimplemented(message, reason="WEIGHT_TRANSFER_NEEDS_CUDA", metadata={"missing": "cuda"})


def unsupported(message: str, missing: str) -> Unimplemented:
    """UNIMPLEMENTED WEIGHT_TRANSFER_UNSUPPORTED; `missing` names what (metadata `missing`)."""
    return Unimplemented(message, reason="WEIGHT_TRANSFER_UNSUPPORTED", metadata={"missing": missing})


def not_initialized(engine: str, opened: str | None) -> FailedPrecondition:
    now = f"the open group is {opened}" if opened else "no group is open"
    return FailedPrecondition(
        f"a {engine} transfer needs InitWeightTransfer with that engine first ({now}; a restarted model server "
        "has none): open the group again, then update. Nothing was loaded",
        reason="WEIGHT_TRANSFER_NOT_INITIALIZED",
        metadata={"engine": engine},
    )
