"""The trainer's own state, registered with a checkpoint's index so trainer and stack restore together.

A trainer writes its state (weights, optimizer, data cursor, RNG) before it asks for the
checkpoint, as a folder or a single file (a blob), then passes its path to
`Controller.checkpoint(trainer_state=...)`. The index (`checkpoint.json`) records where it is,
its size and sha256 (of a file, or of the folder's `MANIFEST` when the trainer wrote one), so
after a crash `read_trainer_state` finds it and refuses a copy that changed since.
Everything here blocks (file I/O).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from gymrpc.errors import DataLoss, InvalidArgument, NotFound
from gymrpc.v1 import participant_service_pb2 as pb

FOLDER_MANIFEST = "MANIFEST"
"""A file a trainer may write into its state folder (any listing of what it holds) to have it hashed."""


@dataclass(frozen=True)
class TrainerState:
    """What `Controller.checkpoint(trainer_state=...)` takes: a path (or URI) and a label."""

    uri: str
    label: str = ""
    hash_it: bool = True
    """Hash a local file or folder MANIFEST (off for a URI this host cannot read)."""


def reference(state: TrainerState | str | os.PathLike[str]) -> pb.TrainerStateRef:
    """The index's record of `state`; a local path must exist (the trainer writes it first)."""
    if not isinstance(state, TrainerState):
        state = TrainerState(os.fspath(state))
    uri = state.uri
    if not uri or len(uri) > 4096:
        raise InvalidArgument("trainer_state must name a folder, a file or a URI (at most 4096 characters)")
    if "://" in uri:
        return pb.TrainerStateRef(uri=uri, label=state.label)
    path = Path(os.path.abspath(uri))
    if not path.exists():
        raise NotFound(f"trainer state {path} does not exist: write it before the checkpoint that registers it")
    out = pb.TrainerStateRef(uri=str(path), label=state.label)
    if path.is_file():
        out.size_bytes = path.stat().st_size
        if state.hash_it:
            out.sha256 = _sha256(path)
    elif state.hash_it and (path / FOLDER_MANIFEST).is_file():
        out.sha256 = _sha256(path / FOLDER_MANIFEST)
        out.size_bytes = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return out


def read_trainer_state(index: pb.CheckpointIndex) -> pb.TrainerStateRef | None:
    """The trainer state an index registered, checked against its sha256; None when it has none."""
    if not index.HasField("trainer_state"):
        return None
    ref = index.trainer_state
    if ref.sha256 and "://" not in ref.uri:
        path = Path(ref.uri)
        target = path / FOLDER_MANIFEST if path.is_dir() else path
        if not target.exists():
            raise NotFound(f"checkpoint {index.checkpoint_id}'s trainer state {path} is gone")
        if _sha256(target) != ref.sha256:
            raise DataLoss(f"checkpoint {index.checkpoint_id}'s trainer state {target} changed since it was registered")
    return ref


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
