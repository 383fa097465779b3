"""One participant's part of a checkpoint on disk: one records file, then the manifest, last.

    <checkpoint_dir>/<kind>/<instance>/records-<sha256>.bin   delimited CheckpointRecord messages
    <checkpoint_dir>/<kind>/<instance>/manifest.json          CheckpointManifest, create-only

The folder is keyed by the whole name: `<instance>` when the name's role is the kind's folder
(`resources/counter` -> `resources/counter`), `<role>%2F<instance>` otherwise (`tools/x` ->
`resources/tools%2Fx`), so two names of one kind never share a folder (`%` never occurs in a
service name). Checkpoints written before that kept such names under `<instance>` alone; the
readers still find them there (`legacy_dir`) when the manifest there is the name's.
Replicas of one name each write their own folder: replica `0` (the only one without
replicas) `<folder>`, replica `k` `<folder>#k` (`#` never occurs in a service name).

One records file per participant keeps filesystem metadata work constant however many
episodes are in flight. The manifest is the commit point: it is created with `os.link`
of an fsynced temporary file, which never replaces an existing name, so of two racing
writers exactly one publishes and a crash before it leaves no checkpoint at all (the
previous checkpoints, in other directories, are never touched). An existing manifest
equal to ours (ignoring its time) is a replay; any other is CHECKPOINT_CONFLICT.
Reading verifies size, sha256 and count over the whole file and decodes every record
before returning any, so a restore installs all or nothing. The manifest's `episode_ids`
lists each episode once, in the order of its first record (a participant may file several
records under one episode); `record_count` counts records.

Incremental commits: given the records of the participant's previous write (`Written`, the
base: a published checkpoint of the same root), a record whose bytes (sha256) are already there
is not written again. The records file then holds only the new records, and the manifest's
`segments` say, in order, where every record is: runs of this records file or of the base's
(`<checkpoint_id>/<kind>/<folder>/records-<sha256>.bin`, relative to the root, with that file's
size and sha256; a reference always names the file that holds the bytes, never a reference).
A reader verifies every file it reads by size and sha256. A folder referred to this way must be
kept as long as a checkpoint refers to it (`gymrpc.control.gc` does).

Everything here blocks; callers run it in a thread, which `yielding` keeps from holding the
GIL for long while the event loop's thread waits for it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from google.protobuf import json_format
from google.protobuf.message import DecodeError

from gymrpc import safeio
from gymrpc.control.faults import crash_point
from gymrpc.control.types import Kind
from gymrpc.durable import fsync_folder, make_folders
from gymrpc.errors import Aborted, DataLoss, InvalidArgument, NotFound
from gymrpc.ids import ENDPOINT_ID, check_attempt, check_endpoint_id, check_id, check_service_name
from gymrpc.pbtime import timestamp
from gymrpc.v1 import checkpoint_records_pb2 as rec_pb
from gymrpc.v1 import common_pb2
from gymrpc.v1 import participant_service_pb2 as pb

SCHEMA_VERSION = 1
RECORDS_FORMAT = "gymrpc.v1.CheckpointRecord/delimited"
MANIFEST = "manifest.json"
RECORDS_FILE = re.compile(r"records-([0-9a-f]{64})\.bin")
MAX_DIR_LEN = 4096
MAX_RECORD_BYTES = 1 << 30
MAX_MANIFEST_BYTES = 64 << 20
"""A manifest lists every episode once; 64 MiB is about a million of them."""


T = TypeVar("T")
YIELD_EVERY = 64
"""Records a worker thread builds or serialises between two pauses that hand the GIL over."""


def yielding(items: Iterable[T], every: int = YIELD_EVERY) -> Iterator[T]:
    """`items`, pausing the calling (worker) thread briefly every `every` of them.

    Building and serialising thousands of records is Python holding the GIL; without pauses the
    event loop's thread, woken by a call, waits a whole switch interval (5 ms) for it each time,
    and a non-stop checkpoint's resume, which runs beside the write, takes tens of milliseconds.
    A sleep of 0 seconds releases the GIL but usually takes it straight back, so it is 50 µs.
    """
    for count, item in enumerate(items, 1):
        yield item
        if count % every == 0:
            time.sleep(50e-6)


class WriteStopped(Exception):
    """The checkpoint was resumed (aborted) while its records were being written."""


class WriteStop:
    """Lets a resume stop a write, and guarantees no manifest appears once `stop` returned."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stopped = False

    def check(self) -> None:
        if self._stopped:
            raise WriteStopped

    @contextlib.contextmanager
    def publishing(self) -> Iterator[None]:
        with self._lock:
            self.check()
            yield

    def stop(self) -> None:
        """Blocks while a manifest is being published (milliseconds)."""
        with self._lock:
            self._stopped = True


@dataclass(frozen=True)
class Location:
    """Where a record's bytes are: record `index` of records file `records_path` (relative to the root)."""

    records_path: str
    sha256: str
    size_bytes: int
    index: int


@dataclass
class Written:
    """Where every record of a participant's write lies, by the sha256 of its bytes: an incremental base."""

    checkpoint_dir: Path
    locations: dict[str, Location] = field(default_factory=dict)

    def usable(self) -> bool:
        """Every file it refers to is still there with its size (else write everything again)."""
        files = {(loc.records_path, loc.size_bytes) for loc in self.locations.values()}
        root = self.checkpoint_dir.parent
        try:
            return all(os.stat(root / path).st_size == size for path, size in files)
        except OSError:
            return False


def check_checkpoint_dir(value: str) -> Path:
    """A checkpoint root from a request: absolute, normalised, printable, bounded."""
    path = Path(value)
    if (
        not value
        or len(value) > MAX_DIR_LEN
        or not value.isprintable()
        or not path.is_absolute()
        or os.path.normpath(value) != value.rstrip("/")
    ):
        raise InvalidArgument(
            f"checkpoint_dir {value[:200]!r} must be an absolute, normalised path (no '..', no '//')",
            metadata={"field": "checkpoint_dir"},
        )
    return path


def name_folder(kind: Kind, name: str) -> str:
    """The folder a name's checkpoints go in under its kind's: the instance when the role is the kind,
    else the whole name with its slash escaped (`tools/x` -> `tools%2Fx`)."""
    role, _, instance = check_service_name(name).partition("/")
    return instance if role == kind.folder else f"{role}%2F{instance}"


def _with_replica(folder: str, endpoint_id: str) -> str:
    return folder if check_endpoint_id(endpoint_id) == "0" else f"{folder}#{endpoint_id}"


def participant_dir(root: Path, kind: Kind, name: str, endpoint_id: str = "0") -> Path:
    """`<root>/<kind>/<folder>` (replica `0`) or `<root>/<kind>/<folder>#<endpoint_id>` (`name_folder`)."""
    return root / kind.folder / _with_replica(name_folder(kind, name), endpoint_id)


def legacy_dir(root: Path, kind: Kind, name: str, endpoint_id: str = "0") -> Path | None:
    """Where checkpoints written before `name_folder` kept `name`, if that is elsewhere: `<kind>/<instance>`."""
    if name_folder(kind, name) == (instance := name.partition("/")[2]):
        return None
    return root / kind.folder / _with_replica(instance, endpoint_id)


def _holds(folder: Path, name: str) -> bool:
    """The folder's manifest is `name`'s (a legacy folder may hold another name's of the same instance)."""
    try:
        manifest = load_manifest(folder / MANIFEST)
    except DataLoss:
        return False
    return manifest is not None and manifest.name == name


def replica_ids(root: Path, kind: Kind, name: str) -> list[str]:
    """Endpoint ids of the replicas of `name` whose folder under `root` holds a manifest, sorted.

    What a restore onto any number of replicas reads from (`RestoreRequest.source_endpoint_ids`).
    A folder counts when its manifest is this name's (in the legacy layout, another name's may be there).
    """
    found = set()
    legacy = legacy_dir(root, kind, name)
    for prefix in (name_folder(kind, name), None if legacy is None else legacy.name):
        if prefix is None:
            continue
        try:
            entries = list(os.scandir(root / kind.folder))
        except (FileNotFoundError, NotADirectoryError):
            return []
        for entry in entries:
            endpoint = "0" if entry.name == prefix else entry.name.removeprefix(f"{prefix}#")
            if endpoint != entry.name and ENDPOINT_ID.fullmatch(endpoint) and _holds(Path(entry.path), name):
                found.add(endpoint)
    return sorted(found)


def checkpoint_dir_of(root: Path, kind: Kind, name: str, endpoint_id: str = "0") -> Path:
    """The folder holding `name`'s part of the checkpoint at `root`: its own, else a legacy one that holds it."""
    folder = participant_dir(root, kind, name, endpoint_id)
    legacy = legacy_dir(root, kind, name, endpoint_id)
    if legacy is not None and not os.path.lexists(folder / MANIFEST) and _holds(legacy, name):
        return legacy
    return folder


def write_checkpoint(
    root: Path,
    kind: Kind,
    name: str,
    checkpoint_id: str,
    records: Sequence[rec_pb.CheckpointRecord],
    stop: WriteStop,
    endpoint_id: str = "0",
    base: Written | None = None,
    track: Written | None = None,
) -> pb.CheckpointManifest:
    """Write the records file, then create the manifest; returns the published manifest.

    `base`: records whose bytes it holds are referred to, not written (an incremental commit).
    `track`: filled with where every record now lies, the base of a next incremental commit.
    """
    folder = participant_dir(root, kind, name, endpoint_id)
    stop.check()  # stopped before it began: create nothing (the folder may be being deleted)
    make_folders(folder)
    existing = load_manifest(folder / MANIFEST)
    if existing is not None and existing.checkpoint_id != checkpoint_id:
        raise _conflict(folder, existing, checkpoint_id)
    fd, temp = tempfile.mkstemp(dir=folder, prefix=".records-", suffix=".tmp")
    try:
        digest, size, own = hashlib.sha256(), 0, 0
        segments: list[pb.RecordSegment] = []
        new: list[tuple[str, int]] = []
        with os.fdopen(fd, "wb") as out:
            for record in yielding(records):
                stop.check()
                data = record.SerializeToString(deterministic=True)
                key = hashlib.sha256(data).hexdigest() if base is not None or track is not None else ""
                where = base.locations.get(key) if base is not None else None
                if where is not None:
                    _extend(segments, where.records_path, where.sha256, where.size_bytes, where.index)
                    if track is not None:
                        track.locations[key] = where
                    continue
                chunk = _varint(len(data)) + data
                out.write(chunk)
                digest.update(chunk)
                size += len(chunk)
                _extend(segments, "", "", 0, own)
                new.append((key, own))
                own += 1
            out.flush()
            os.fsync(out.fileno())
        manifest = pb.CheckpointManifest(
            checkpoint_id=checkpoint_id,
            kind=int(kind),  # type: ignore[arg-type]
            name=name,
            records_file=f"records-{digest.hexdigest()}.bin",
            record_count=len(records),
            sha256=digest.hexdigest(),
            size_bytes=size,
            episode_ids=_episode_ids(records),
            create_time=timestamp(time.time()),
            schema_version=SCHEMA_VERSION,
            records_format=RECORDS_FORMAT,
            endpoint_id=endpoint_id,
        )
        if any(s.records_path for s in segments):  # something was referred to, not written
            manifest.segments.extend(segments)
        if track is not None:
            own_path = f"{root.name}/{folder.relative_to(root)}/{manifest.records_file}"
            for key, index in new:
                track.locations[key] = Location(own_path, manifest.sha256, size, index)
        with stop.publishing():
            os.replace(temp, folder / manifest.records_file)
            fsync_folder(folder)  # the records file's name is durable before a manifest names it
            crash_point("commit_before_manifest")
            published = _create_manifest(folder, manifest)
        crash_point("commit_after_manifest")
        return published
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)


def read_checkpoint(
    root: Path, kind: Kind, name: str, endpoint_id: str = "0", stop: threading.Event | None = None
) -> tuple[pb.CheckpointManifest, list[rec_pb.CheckpointRecord]]:
    """Read and verify a participant's (replica's) manifest and every record; DATA_LOSS on any damage.

    Reads regular files only and never more than the manifest's `size_bytes` (`gymrpc.safeio`);
    `stop` set (the restore's deadline passed) ends the read with `safeio.ReadStopped`.
    """
    folder = checkpoint_dir_of(root, kind, name, endpoint_id)
    manifest = load_manifest(folder / MANIFEST)
    if manifest is None:
        replica = "" if endpoint_id == "0" else f" replica {endpoint_id}"
        raise NotFound(
            f"{folder} holds no manifest: {root} is not a committed checkpoint of {name}{replica}",
            metadata={"checkpoint_dir": str(root)[:200], "name": name, "endpoint_id": endpoint_id},
        )
    _check_manifest(manifest, folder, kind, name, endpoint_id)
    path = folder / manifest.records_file
    try:
        data = safeio.read_regular(
            path, limit=manifest.size_bytes, size=manifest.size_bytes, sha256=manifest.sha256, stop=stop
        )
    except FileNotFoundError:
        raise DataLoss(f"{path} is missing; the checkpoint is damaged", reason="CORRUPT_SNAPSHOT") from None
    except safeio.UnsafeFile as exc:
        raise DataLoss(f"{exc}: it fails its size or sha256 check; nothing was restored") from None
    records = list(_decode(data, path))
    if manifest.segments:
        records = _assemble(root, manifest, records, stop)
    if len(records) != manifest.record_count:
        raise DataLoss(f"{path} holds {len(records)} records, its manifest says {manifest.record_count}")
    return manifest, records


def checkpoint_episodes(root: Path) -> set[tuple[str, int]]:
    """Every episode some member's manifest under `root` lists: what the checkpoint holds as a whole.

    A member holds only its own episodes (an environment those with a session there), so a
    restore checks what it is asked for against the union, not against its own manifest.
    """
    held: set[tuple[str, int]] = set()
    for kind in Kind:
        try:
            entries = sorted(os.scandir(root / kind.folder), key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            manifest = load_manifest(Path(entry.path, MANIFEST))
            if manifest is not None:
                held.update((e.rollout_id, e.attempt) for e in manifest.episode_ids)
    return held


def manifests_equal(a: pb.CheckpointManifest, b: pb.CheckpointManifest) -> bool:
    """Equal in everything but the time it was written."""
    a, b = _without_time(a), _without_time(b)
    return a == b


# -- helpers ---------------------------------------------------------------------------------------


def _extend(segments: list[pb.RecordSegment], path: str, sha256: str, size: int, index: int) -> None:
    """Append record `index` of `path` to the runs, growing the last run when it continues it."""
    if segments and segments[-1].records_path == path and segments[-1].first + segments[-1].count == index:
        segments[-1].count += 1
    else:
        segments.append(pb.RecordSegment(records_path=path, sha256=sha256, size_bytes=size, first=index, count=1))


def _referenced(root: Path, records_path: str) -> Path:
    """A segment's records file, `<checkpoint_id>/<kind>/<folder>/records-<sha256>.bin` under the root."""
    parts = records_path.split("/")
    ok = len(parts) == 4 and parts[1] in {k.folder for k in Kind} and parts[2] not in ("", ".", "..")
    try:
        check_id(parts[0], "segment")
    except InvalidArgument:
        ok = False
    if not ok or RECORDS_FILE.fullmatch(parts[-1]) is None or "%" in parts[2].replace("%2F", ""):
        raise DataLoss(f"{root}: a segment names {records_path[:200]!r}, not a records file of this checkpoint root")
    return root.parent / records_path


def _assemble(
    root: Path, manifest: pb.CheckpointManifest, own: list[rec_pb.CheckpointRecord], stop: threading.Event | None
) -> list[rec_pb.CheckpointRecord]:
    """An incremental manifest's records in order, from its own file and the (verified) files it refers to."""
    files: dict[str, list[rec_pb.CheckpointRecord]] = {"": own}
    out: list[rec_pb.CheckpointRecord] = []
    for segment in manifest.segments:
        name = segment.records_path
        if name not in files:
            path = _referenced(root, name)
            if RECORDS_FILE.fullmatch(path.name).group(1) != segment.sha256:  # type: ignore[union-attr]
                raise DataLoss(f"{root}: segment {name!r} does not match its sha256")
            try:
                data = safeio.read_regular(
                    path, limit=segment.size_bytes, size=segment.size_bytes, sha256=segment.sha256, stop=stop
                )
            except FileNotFoundError:
                raise DataLoss(
                    f"{path} is missing: checkpoint {root} refers to its records (an incremental commit); "
                    "nothing was restored",
                    reason="CORRUPT_SNAPSHOT",
                ) from None
            except safeio.UnsafeFile as exc:
                raise DataLoss(f"{exc}: it fails its size or sha256 check; nothing was restored") from None
            files[name] = list(_decode(data, path))
        records = files[name]
        if segment.count == 0 or segment.first + segment.count > len(records):
            raise DataLoss(f"{root}: a segment runs past the {len(records)} records of {name or 'its records file'}")
        out.extend(records[segment.first : segment.first + segment.count])
    if sum(s.count for s in manifest.segments if not s.records_path) != len(own):
        raise DataLoss(f"{root}: the segments do not name every record of its own records file")
    return out


def _create_manifest(folder: Path, manifest: pb.CheckpointManifest) -> pb.CheckpointManifest:
    text = json_format.MessageToJson(manifest, preserving_proto_field_name=True, sort_keys=True, indent=1)
    if create_file(folder / MANIFEST, text + "\n"):
        return manifest
    existing = load_manifest(folder / MANIFEST)
    if existing is None or not manifests_equal(existing, manifest):
        raise _conflict(folder, existing, manifest.checkpoint_id)
    return existing


def create_file(path: Path, text: str) -> bool:
    """Create `path` holding `text`, durably, never replacing a file there: False if one exists.

    A commit point: `os.link` of an fsynced temporary file publishes whole or not at all, of two
    racing writers exactly one wins, and the folder is fsynced so the name survives a crash.
    """
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        try:
            os.link(temp, path)
        except FileExistsError:
            return False
        fsync_folder(path.parent)
        return True
    finally:
        os.unlink(temp)


def load_manifest(path: Path) -> pb.CheckpointManifest | None:
    """The manifest at `path`, None if there is none (a member that never wrote); DATA_LOSS if it is damaged.

    Absence is an answer, not an error: a member folder without a manifest is an unfinished write.
    """
    try:
        data = read_manifest_bytes(path)
    except FileNotFoundError:
        return None
    return parse_manifest(data, path)


def read_manifest_bytes(path: Path) -> bytes:
    """A manifest file's bytes: a regular file of at most `MAX_MANIFEST_BYTES`; DATA_LOSS otherwise.

    FileNotFoundError passes through.
    """
    try:
        return safeio.read_regular(path, limit=MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise
    except (OSError, safeio.UnsafeFile) as exc:
        raise DataLoss(f"{path} cannot be read: {exc}") from None


def parse_manifest(data: bytes, path: Path) -> pb.CheckpointManifest:
    """A manifest's bytes as read from `path`; DATA_LOSS if they are not one."""
    manifest = pb.CheckpointManifest()
    try:
        json_format.Parse(data.decode(), manifest)
    except (UnicodeDecodeError, json_format.ParseError) as exc:
        raise DataLoss(f"{path} is not a gymrpc checkpoint manifest: {exc}") from None
    return manifest


def _check_manifest(manifest: pb.CheckpointManifest, folder: Path, kind: Kind, name: str, endpoint_id: str) -> None:
    where = folder / MANIFEST
    if manifest.schema_version != SCHEMA_VERSION or manifest.records_format != RECORDS_FORMAT:
        raise DataLoss(
            f"{where}: schema {manifest.schema_version} / format {manifest.records_format!r} is not one this "
            f"server reads (schema {SCHEMA_VERSION}, {RECORDS_FORMAT})"
        )
    if manifest.kind != kind or manifest.name != name:
        raise DataLoss(
            f"{where} belongs to {pb.ParticipantKind.Name(manifest.kind)} {manifest.name!r}, not to "
            f"{pb.ParticipantKind.Name(int(kind))} {name!r}"  # type: ignore[arg-type]
        )
    if (manifest.endpoint_id or "0") != endpoint_id:
        raise DataLoss(f"{where} belongs to replica {manifest.endpoint_id!r} of {name!r}, not to {endpoint_id!r}")
    try:
        check_id(manifest.checkpoint_id, "manifest.checkpoint_id")
    except InvalidArgument as exc:
        raise DataLoss(f"{where}: {exc.message}") from None
    match = RECORDS_FILE.fullmatch(manifest.records_file)
    if match is None or match.group(1) != manifest.sha256:
        raise DataLoss(f"{where}: records_file {manifest.records_file!r} does not match its sha256")


def _decode(data: bytes, path: Path) -> Iterator[rec_pb.CheckpointRecord]:
    pos, end = 0, len(data)
    while pos < end:
        length, pos = _read_varint(data, pos, path)
        if length > MAX_RECORD_BYTES or pos + length > end:
            raise DataLoss(f"{path}: a record runs past the end of the file")
        record = rec_pb.CheckpointRecord()
        try:
            record.ParseFromString(data[pos : pos + length])
            check_id(record.episode_id.rollout_id, "record.episode_id.rollout_id")
            check_attempt(record.episode_id.attempt, "record.episode_id.attempt")
        except (DecodeError, InvalidArgument) as exc:
            raise DataLoss(f"{path}: a record does not decode: {exc}") from None
        pos += length
        yield record


def _episode_ids(records: Sequence[rec_pb.CheckpointRecord]) -> list[common_pb2.EpisodeId]:
    """Each episode once, in the order of its first record.

    A participant may file several records under one episode (a session and the shared table
    blocks it names first); the manifest lists episodes, not records (`record_count` counts those).
    """
    seen: dict[tuple[str, int], common_pb2.EpisodeId] = {}
    for record in records:
        episode = record.episode_id
        seen.setdefault((episode.rollout_id, episode.attempt), episode)
    return list(seen.values())


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits, value = value & 0x7F, value >> 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _read_varint(data: bytes, pos: int, path: Path) -> tuple[int, int]:
    value, shift = 0, 0
    while pos < len(data) and shift < 64:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise DataLoss(f"{path}: a record length is truncated")


def _without_time(manifest: pb.CheckpointManifest) -> pb.CheckpointManifest:
    copy = pb.CheckpointManifest()
    copy.CopyFrom(manifest)
    copy.ClearField("create_time")
    return copy


def _conflict(folder: Path, existing: pb.CheckpointManifest | None, checkpoint_id: str) -> Aborted:
    other = existing.checkpoint_id if existing is not None else "?"
    return Aborted(
        f"{folder / MANIFEST} already holds a different commit (checkpoint {other!r}); "
        f"checkpoint {checkpoint_id!r} was not written there",
        reason="CHECKPOINT_CONFLICT",
        metadata={"checkpoint_id": checkpoint_id, "existing": other},
    )
