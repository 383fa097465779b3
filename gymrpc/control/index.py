"""A checkpoint folder's index, `checkpoint.json`: what makes a coordinated checkpoint whole.

The controller writes it last and create-only, once every member committed: each member with the
sha256 of its manifest (`gymrpc.v1.CheckpointIndex`). A member whose commit failed leaves no
manifest, which cannot be told from a replica that never existed; so a restore reads exactly the
replicas the index lists and refuses a folder without one. The controller must therefore see the
checkpoint folder its participants write. Everything here blocks (file I/O).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from google.protobuf import json_format

from gymrpc import safeio
from gymrpc.control import store
from gymrpc.control.types import Kind
from gymrpc.errors import Aborted, DataLoss, FailedPrecondition, InvalidArgument, NotFound
from gymrpc.ids import check_endpoint_id, check_id
from gymrpc.pbtime import timestamp
from gymrpc.v1 import participant_service_pb2 as pb

INDEX = "checkpoint.json"
"""A checkpoint folder's index (`gymrpc.v1.CheckpointIndex` in JSON), written by the controller last."""
INDEX_SCHEMA_VERSION = 1


def endpoint_order(endpoint_id: str | None) -> tuple[int, int, str]:
    """Endpoint ids in numeric order (`2` before `10`), others after them."""
    if endpoint_id is None:
        return (0, 0, "")
    return (0, int(endpoint_id), "") if endpoint_id.isdigit() else (1, 0, endpoint_id)


def sources_of(replicas: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """(name, endpoint id) pairs -> name -> its endpoint ids in order (`RestoreRequest.source_endpoint_ids`)."""
    out: dict[str, set[str]] = {}
    for name, endpoint_id in replicas:
        out.setdefault(name, set()).add(endpoint_id or "0")
    return {name: sorted(ids, key=endpoint_order) for name, ids in sorted(out.items())}


def manifest_path(kind: int, name: str, endpoint_id: str) -> str:
    """`<kind>/<folder>[#<endpoint_id>]/manifest.json`, relative to the checkpoint folder (`store.name_folder`)."""
    return str(store.participant_dir(Path(), Kind(kind), name, endpoint_id or "0") / store.MANIFEST)


def manifest_paths(kind: int, name: str, endpoint_id: str) -> tuple[str, ...]:
    """Where an index may list a member's manifest: `manifest_path`, or its legacy place (`store.legacy_dir`)."""
    legacy = store.legacy_dir(Path(), Kind(kind), name, endpoint_id or "0")
    current = manifest_path(kind, name, endpoint_id)
    return (current,) if legacy is None else (current, str(legacy / store.MANIFEST))


def _index_text(index: pb.CheckpointIndex) -> str:
    return json_format.MessageToJson(index, preserving_proto_field_name=True, sort_keys=True, indent=1) + "\n"


def write_index(
    folder: Path,
    checkpoint_id: str,
    manifests: Iterable[pb.CheckpointManifest],
    *,
    trainer_state: pb.TrainerStateRef | None = None,
    weight_versions: Mapping[str, str] | None = None,
) -> pb.CheckpointIndex:
    """Index the manifests every member committed into `folder/INDEX`, last and create-only (blocking).

    Each manifest is read back from the folder (the controller must see it) and must be the one
    its participant reported; the index holds the sha256 of its bytes. An equal index already
    there (a retried commit) is kept; another one is CHECKPOINT_CONFLICT. `trainer_state` and
    `weight_versions` (model server name -> loaded version) are recorded as given.
    """
    index = pb.CheckpointIndex(
        checkpoint_id=checkpoint_id,
        create_time=timestamp(time.time()),
        schema_version=INDEX_SCHEMA_VERSION,
        trainer_state=trainer_state,
        weight_versions=dict(weight_versions or {}),
    )
    for manifest in manifests:
        relative = manifest_path(manifest.kind, manifest.name, manifest.endpoint_id)
        path = folder / relative
        try:
            data = store.read_manifest_bytes(path)
        except FileNotFoundError:
            raise FailedPrecondition(
                f"{path} does not exist here, though {manifest.name} reported it committed: the controller must "
                "see the checkpoint folder its participants write (a shared filesystem) to index it",
                metadata={"checkpoint_dir": str(folder)[:200], "name": manifest.name},
            ) from None
        on_disk = store.parse_manifest(data, path)
        if not store.manifests_equal(on_disk, manifest) or manifest.checkpoint_id != checkpoint_id:
            raise DataLoss(f"{path} is not the manifest {manifest.name} reported for checkpoint {checkpoint_id!r}")
        index.members.add(
            name=manifest.name,
            kind=manifest.kind,
            endpoint_id=manifest.endpoint_id or "0",
            manifest_path=relative,
            manifest_sha256=hashlib.sha256(data).hexdigest(),
        )
    try:
        created = store.create_file(folder / INDEX, _index_text(index))
    except OSError as exc:
        raise FailedPrecondition(
            f"could not write {folder / INDEX}: {exc}; the checkpoint is not complete",
            metadata={"checkpoint_dir": str(folder)[:200]},
        ) from exc
    if created:
        return index
    existing = load_index(folder / INDEX)
    same = pb.CheckpointIndex()
    same.CopyFrom(existing)
    same.create_time.CopyFrom(index.create_time)
    if same != index:
        raise Aborted(
            f"{folder / INDEX} already indexes another commit (checkpoint {existing.checkpoint_id!r}); "
            f"checkpoint {checkpoint_id!r} was not indexed there",
            reason="CHECKPOINT_CONFLICT",
            metadata={"checkpoint_id": checkpoint_id, "existing": existing.checkpoint_id},
        )
    return existing


def read_index(folder: Path) -> pb.CheckpointIndex:
    """The index of a checkpoint folder, every manifest it lists checked against its sha256 (blocking).

    NOT_FOUND: no such folder; FAILED_PRECONDITION `CHECKPOINT_INCOMPLETE`: a folder without an
    index, which must not be restored as if it were whole; DATA_LOSS: an index or manifest damaged
    or changed since the commit.
    """
    where = {"checkpoint_dir": str(folder)[:200]}
    path = folder / INDEX
    if not folder.is_dir():
        raise NotFound(f"{folder} is not a checkpoint folder: it does not exist", metadata=where)
    if not path.exists():
        raise FailedPrecondition(
            f"{folder} has no {INDEX}: the checkpoint is incomplete (some member's commit failed, or its "
            "controller stopped before indexing it) and is not restored. Restore an earlier checkpoint, or name "
            "the replicas that committed yourself (Controller.restore(sources=...), gymrpc ctl restore --source)",
            reason="CHECKPOINT_INCOMPLETE",
            metadata=where,
        )
    index = load_index(path)
    problems = []
    if index.schema_version != INDEX_SCHEMA_VERSION:
        problems.append(f"schema {index.schema_version} is not one this controller reads ({INDEX_SCHEMA_VERSION})")
    try:
        check_id(index.checkpoint_id, "checkpoint_id")
    except InvalidArgument as exc:
        problems.append(exc.message)
    seen: set[tuple[str, str]] = set()
    for member in index.members:
        try:
            allowed = manifest_paths(member.kind, member.name, check_endpoint_id(member.endpoint_id))
        except (InvalidArgument, ValueError) as exc:
            problems.append(f"member {member.name[:140]!r}: {exc}")
            continue
        expected = member.manifest_path
        if expected not in allowed or (member.name, member.endpoint_id) in seen:
            problems.append(f"{member.name!r} replica {member.endpoint_id!r} is listed at {member.manifest_path!r}")
            continue
        seen.add((member.name, member.endpoint_id))
        try:
            data = store.read_manifest_bytes(folder / expected)
        except FileNotFoundError as exc:
            problems.append(f"{expected} cannot be read ({exc.strerror})")
            continue
        except DataLoss as exc:
            problems.append(exc.message)
            continue
        if hashlib.sha256(data).hexdigest() != member.manifest_sha256:
            problems.append(f"{expected} is not the manifest that was committed (sha256 differs)")
    listed = {m.manifest_path for m in index.members}
    if unlisted := sorted(set(_manifests_in(folder)) - listed):
        problems.append(f"it does not list {', '.join(unlisted[:5])}")
    if problems:
        raise DataLoss(f"{path}: {'; '.join(problems)}; nothing was restored", metadata=where)
    return index


def _manifests_in(folder: Path) -> list[str]:
    """Every `<kind>/<entry>/manifest.json` under a checkpoint folder, relative to it."""
    found = []
    for kind in Kind:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(folder / kind.folder) as entries:
            found += [
                f"{kind.folder}/{e.name}/{store.MANIFEST}" for e in entries if Path(e.path, store.MANIFEST).exists()
            ]
    return found


def index_sources(index: pb.CheckpointIndex) -> dict[str, list[str]]:
    """Name -> endpoint ids of the replicas an index lists: the sources of a restore."""
    return sources_of((m.name, m.endpoint_id) for m in index.members)


def load_index(path: Path) -> pb.CheckpointIndex:
    index = pb.CheckpointIndex()
    try:
        json_format.Parse(safeio.read_regular(path, limit=store.MAX_MANIFEST_BYTES).decode(), index)
    except (OSError, safeio.UnsafeFile, UnicodeDecodeError, json_format.ParseError) as exc:
        raise DataLoss(
            f"{path} is not a gymrpc checkpoint index: {exc}", metadata={"checkpoint_dir": str(path.parent)[:200]}
        ) from None
    return index
