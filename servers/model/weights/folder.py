"""A folder of safetensors files, checked before a byte of it reaches a model.

A weight update names a folder (or uploads one into a staging folder). Before anything is
swapped, every file is opened without following symlinks, its safetensors header is parsed
and bounded (the header length, every tensor's dtype, shape and byte range), and the tensor
set is compared with the loaded model's: a missing or extra tensor, or another shape or
dtype, refuses the update with WEIGHTS_MISMATCH and the old weights keep serving. The header
is read here without the `safetensors` package so the check runs in any server (the scripted
backend has no torch).
"""

from __future__ import annotations

import json
import os
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gymrpc.errors import FailedPrecondition, InvalidArgument

SUFFIX = ".safetensors"
MAX_FILES = 1024
"""Files one update may name (sharded checkpoints of very large models stay well under)."""
MAX_HEADER_BYTES = 100 * 1024 * 1024
"""The safetensors format's own limit on the JSON header."""
DEFAULT_MAX_TOTAL_BYTES = 256 * 1024**3
"""Bytes one update may hold in total, unless the server is started with another bound."""
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


@dataclass(frozen=True)
class TensorSpec:
    """What must match between the loaded model and new weights."""

    dtype: str
    shape: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


@dataclass(frozen=True)
class WeightsFolder:
    """A checked folder: its files and every tensor's spec (tensor name -> file, spec)."""

    path: Path
    files: tuple[Path, ...]
    tensors: Mapping[str, tuple[Path, TensorSpec]]
    size_bytes: int

    def specs(self) -> dict[str, TensorSpec]:
        return {name: spec for name, (_, spec) in self.tensors.items()}


def corrupt(message: str, **metadata: str) -> InvalidArgument:
    return InvalidArgument(message, reason="CORRUPT_WEIGHTS", metadata=metadata)


def mismatch(message: str, **metadata: str) -> FailedPrecondition:
    return FailedPrecondition(message, reason="WEIGHTS_MISMATCH", metadata=metadata)


def check_file_name(name: str) -> None:
    """A bare `*.safetensors` file name: no directory part, nothing hidden, printable."""
    if (
        not name
        or len(name) > 255
        or "/" in name
        or "\\" in name
        or name.startswith(".")
        or not name.isprintable()
        or not name.endswith(SUFFIX)
    ):
        raise InvalidArgument(
            f"weights file name {name!r} must be a bare name ending in {SUFFIX} (no directories, not hidden)",
            metadata={"field": "files.name"},
        )


def open_folder(path: str | os.PathLike[str], *, max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES) -> WeightsFolder:
    """Check `path` as a weights folder; every refusal is a clear error and reads no tensor data."""
    text = os.fspath(path)
    if not text or not os.path.isabs(text):
        raise InvalidArgument(f"weights path {text!r} must be an absolute path", metadata={"field": "path"})
    folder = Path(text)
    try:
        info = os.lstat(folder)
    except OSError as exc:
        raise InvalidArgument(
            f"weights path {text!r} cannot be read: {exc.strerror}", metadata={"field": "path"}
        ) from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise InvalidArgument(
            f"weights path {text!r} is not a directory (a symlink is not followed)", metadata={"field": "path"}
        )
    names = sorted(os.listdir(folder))
    chosen = [n for n in names if n.endswith(SUFFIX)]
    if not chosen:
        raise InvalidArgument(f"weights folder {text!r} holds no {SUFFIX} files", metadata={"field": "path"})
    if len(chosen) > MAX_FILES:
        raise InvalidArgument(
            f"weights folder {text!r} holds {len(chosen)} {SUFFIX} files; at most {MAX_FILES}",
            metadata={"field": "path"},
        )
    files, tensors, total = [], {}, 0
    for name in chosen:
        file = folder / name
        info = os.lstat(file)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidArgument(
                f"weights file {name!r} is not a regular file (symlinks, fifos and devices are refused)",
                metadata={"field": "path", "file": name},
            )
        total += info.st_size
        if total > max_total_bytes:
            raise InvalidArgument(
                f"weights folder {text!r} holds more than this server's limit of {max_total_bytes} bytes",
                metadata={"field": "path"},
            )
        for tensor, spec in read_header(file).items():
            if tensor in tensors:
                raise corrupt(f"tensor {tensor!r} is in both {tensors[tensor][0].name} and {name}", file=name)
            tensors[tensor] = (file, spec)
        files.append(file)
    return WeightsFolder(folder, tuple(files), tensors, total)


def read_header(file: Path) -> dict[str, TensorSpec]:
    """The tensors a safetensors file declares, after checking each lies inside the file."""
    name = file.name
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise corrupt(f"weights file {name!r} cannot be opened: {exc.strerror}", file=name) from None
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise corrupt(f"weights file {name!r} is too short to be safetensors ({size} bytes)", file=name)
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise corrupt(f"weights file {name!r} declares a {length}-byte header in a {size}-byte file", file=name)
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise corrupt(f"weights file {name!r} has a header that is not JSON: {exc}", file=name) from None
    if not isinstance(header, dict):
        raise corrupt(f"weights file {name!r} has a header that is not a JSON object", file=name)
    data_bytes = size - 8 - length
    out: dict[str, TensorSpec] = {}
    for tensor, entry in header.items():
        if tensor == "__metadata__":
            continue
        out[tensor] = _tensor_spec(name, tensor, entry, data_bytes)
    return out


def _tensor_spec(name: str, tensor: str, entry: object, data_bytes: int) -> TensorSpec:
    bad = f"weights file {name!r}: tensor {tensor!r}"
    if not isinstance(entry, dict):
        raise corrupt(f"{bad} has no dtype/shape/data_offsets", file=name, tensor=tensor)
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise corrupt(f"{bad} has unknown dtype {dtype!r}", file=name, tensor=tensor)
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise corrupt(f"{bad} has a malformed shape {shape!r}", file=name, tensor=tensor)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise corrupt(f"{bad} has malformed data_offsets {offsets!r}", file=name, tensor=tensor)
    start, end = offsets
    count = 1
    for d in shape:
        count *= d
    if not 0 <= start <= end <= data_bytes or end - start != count * DTYPE_BYTES[dtype]:
        raise corrupt(
            f"{bad} ({dtype}{shape}) claims bytes {start}..{end} of a {data_bytes}-byte data section",
            file=name,
            tensor=tensor,
        )
    return TensorSpec(dtype, tuple(shape))


def check_matches(new: Mapping[str, TensorSpec], loaded: Mapping[str, TensorSpec]) -> None:
    """Refuse weights that are not the loaded model's tensors with the same shapes and dtypes."""
    missing = sorted(set(loaded) - set(new))
    if missing:
        raise mismatch(
            f"the new weights lack {len(missing)} tensors of the loaded model, e.g. {missing[:3]}; nothing was loaded",
            tensor=missing[0],
        )
    extra = sorted(set(new) - set(loaded))
    if extra:
        raise mismatch(
            f"the new weights hold {len(extra)} tensors the loaded model does not have, e.g. {extra[:3]}; "
            "nothing was loaded",
            tensor=extra[0],
        )
    for tensor in sorted(new):
        if new[tensor] != loaded[tensor]:
            raise mismatch(
                f"tensor {tensor!r} is {new[tensor].describe()} in the new weights but "
                f"{loaded[tensor].describe()} in the loaded model; nothing was loaded",
                tensor=tensor,
            )
