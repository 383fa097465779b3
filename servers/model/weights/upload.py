"""Receive an `UploadWeights` stream into a private staging folder, checking every byte.

The header names each file with its size and sha256; chunks must follow in header order,
each at most `MAX_CHUNK_BYTES` and at the offset already received, so a file is written
sequentially and hashed as it arrives. A file is fsynced and its sha256 compared before the
next starts; the folder is handed to `open_folder` only when every file is complete. Any
refusal removes the staging folder: a failed upload leaves nothing behind and changes nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from gymrpc.errors import InvalidArgument
from gymrpc.servers.model.weights.folder import MAX_FILES, check_file_name, corrupt
from gymrpc.v1 import weights_service_pb2 as pb

MAX_CHUNK_BYTES = 4 * 1024 * 1024
"""Largest `WeightsChunk.data`; a client sends files in slices of at most this."""
SHA256 = re.compile(r"[0-9a-f]{64}")


def _bad(message: str, field: str) -> InvalidArgument:
    return InvalidArgument(message, metadata={"field": field})


def check_header(header: pb.UploadWeightsHeader, max_total_bytes: int) -> None:
    files = header.files
    if not files:
        raise _bad("the upload header lists no files", "header.files")
    if len(files) > MAX_FILES:
        raise _bad(f"the upload header lists {len(files)} files; at most {MAX_FILES}", "header.files")
    seen: set[str] = set()
    total = 0
    for k, f in enumerate(files):
        check_file_name(f.name)
        if f.name in seen:
            raise _bad(f"files[{k}].name {f.name!r} is listed twice", "header.files")
        seen.add(f.name)
        if not SHA256.fullmatch(f.sha256):
            raise _bad(f"files[{k}].sha256 must be 64 lowercase hex digits", "header.files.sha256")
        total += f.size_bytes
    if total > max_total_bytes:
        raise _bad(f"the upload holds {total} bytes; this server takes at most {max_total_bytes}", "header.files")


async def receive(
    header: pb.UploadWeightsHeader,
    chunks: AsyncIterator[pb.UploadWeightsRequest],
    staging_root: Path,
    max_total_bytes: int,
) -> Path:
    """Write the uploaded files into a new folder under `staging_root` (the server's private folder, which
    exists); the caller removes it."""
    check_header(header, max_total_bytes)
    folder = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="upload-", dir=staging_root))
    try:
        await _write(header, chunks, folder)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


async def _write(header: pb.UploadWeightsHeader, chunks: AsyncIterator[pb.UploadWeightsRequest], folder: Path) -> None:
    files = list(header.files)
    index, written, digest = 0, 0, hashlib.sha256()
    out = _create(folder, files[0].name) if files else None

    def finish_file() -> None:
        nonlocal index, written, digest, out
        assert out is not None
        out.flush()
        os.fsync(out.fileno())
        out.close()
        name = files[index].name
        if digest.hexdigest() != files[index].sha256:
            raise corrupt(f"uploaded file {name!r} fails its sha256 (got {digest.hexdigest()})", file=name)
        index, written, digest = index + 1, 0, hashlib.sha256()
        out = _create(folder, files[index].name) if index < len(files) else None

    while index < len(files) and files[index].size_bytes == 0:
        finish_file()
    async for message in chunks:
        if message.WhichOneof("part") != "chunk":
            raise _bad("only the first message of an upload is a header; the rest are chunks", "header")
        chunk = message.chunk
        if len(chunk.data) > MAX_CHUNK_BYTES:
            raise _bad(f"a chunk holds {len(chunk.data)} bytes; at most {MAX_CHUNK_BYTES}", "chunk.data")
        if index >= len(files):
            raise _bad("a chunk arrived after every file was complete", "chunk.file_index")
        if chunk.file_index != index or chunk.offset != written:
            raise _bad(
                f"expected a chunk of file {index} at offset {written}, got file {chunk.file_index} at {chunk.offset}; "
                "send files in header order, each sequentially",
                "chunk.offset",
            )
        if not chunk.data:
            raise _bad("a chunk is empty", "chunk.data")
        size = files[index].size_bytes
        if written + len(chunk.data) > size:
            raise _bad(f"file {files[index].name!r} is longer than the {size} bytes its header says", "chunk.data")
        assert out is not None
        out.write(chunk.data)
        digest.update(chunk.data)
        written += len(chunk.data)
        while index < len(files) and written == files[index].size_bytes:
            finish_file()
    if index < len(files):
        raise _bad(
            f"the upload ended with file {files[index].name!r} at {written} of {files[index].size_bytes} bytes",
            "chunk",
        )
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create(folder: Path, name: str):
    fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    return os.fdopen(fd, "wb")
