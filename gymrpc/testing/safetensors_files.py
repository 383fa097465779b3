"""Write small safetensors files without numpy or torch, for weight-update tests and benches.

    write_safetensors(path, {"w": ("F32", (2, 3), None)})   # zeros
    write_safetensors(path, {"w": ("F32", (2, 3), bytes_of_length_24)})

The format: an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, then the data. Enough to build folders that are right, or wrong in one
chosen way (a shape, a dtype, a missing tensor), for the checks the model server runs.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path

DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U8": 1, "F64": 8}

Tensor = tuple[str, tuple[int, ...], bytes | None]
"""(dtype, shape, data or None for zeros)."""


def write_safetensors(path: Path, tensors: Mapping[str, Tensor]) -> Path:
    header: dict[str, object] = {}
    chunks: list[bytes] = []
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        count = 1
        for d in shape:
            count *= d
        size = count * DTYPE_BYTES[dtype]
        if data is None:
            data = bytes(size)
        if len(data) != size:
            raise ValueError(f"{name}: {len(data)} bytes for {dtype}{list(shape)} (needs {size})")
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        chunks.append(data)
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    return path


def synthetic_specs(hidden: int, layers: int, vocab: int) -> dict[str, Tensor]:
    """A transformer-shaped tensor set (F32 zeros) of roughly `layers * 12 * hidden**2` parameters."""
    out: dict[str, Tensor] = {"embed.weight": ("F32", (vocab, hidden), None)}
    for k in range(layers):
        out[f"layers.{k}.attn.qkv.weight"] = ("F32", (3 * hidden, hidden), None)
        out[f"layers.{k}.attn.out.weight"] = ("F32", (hidden, hidden), None)
        out[f"layers.{k}.mlp.up.weight"] = ("F32", (4 * hidden, hidden), None)
        out[f"layers.{k}.mlp.down.weight"] = ("F32", (hidden, 4 * hidden), None)
        out[f"layers.{k}.norm.weight"] = ("F32", (hidden,), None)
    return out
