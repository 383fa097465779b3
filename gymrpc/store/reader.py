"""A store folder read without opening the store: one episode's record, every episode, every log.

Works on a folder agents are appending to, and changes nothing in it: every log is read as
`LogView` reads another process's log (a batch not yet acknowledged is not read), and an
episode's record is its highest-version write in any log, as in `LogEpisodeStore`. Records
written by `FilesystemEpisodeStore` (root/episodes/*/*.ckpt) are read too. `gymrpc episodes`
(list, show, verify) is built on it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from google.protobuf.message import DecodeError

from gymrpc.errors import DataLoss
from gymrpc.store import codec, frames, ranges
from gymrpc.store.base import EpisodeCheckpoint
from gymrpc.store.files import _read_header
from gymrpc.store.log import OWNER, LogView, _corrupt, _log_names, _record_from, _segment_name

_READ = 1 << 20


@dataclass(slots=True)
class LogState:
    """One log of the folder, as read now."""

    name: str
    view: LogView
    in_use: bool = False
    """Its owner (an agent process) is alive and may still append."""
    segments: int = 0
    read_bytes: int = 0
    """Bytes of whole batches read (what the owner has acknowledged); `StoreFolder.measure` sets it."""
    unread_bytes: int = 0
    """Non-zero bytes past them: a batch being written now, or one a crash tore (never acknowledged)."""


@dataclass(slots=True)
class Entry:
    """Where an episode's current write is: a chain of frames in a log, or a file of the files store."""

    rollout_id: str
    version: int
    log: LogState | None = None
    chain: frames.Chain | None = None
    """None in a log: that write was lost to a damaged region (loads are DATA_LOSS)."""
    path: Path | None = None

    @property
    def stored_bytes(self) -> int:
        if self.path is not None:
            return _size(self.path)
        return sum(length for _, _, length in self.chain.frames) if self.chain else 0

    @property
    def where(self) -> str:
        return self.log.name if self.log is not None else "files"


class StoreFolder:
    """The logs of a store folder, read once at construction (`refresh` reads what was appended since)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        logs = self.root / "logs"
        if not logs.is_dir() and not (self.root / "episodes").is_dir():
            raise FileNotFoundError(f"{self.root} is not an episode store folder (it has no logs/ or episodes/)")
        self.logs = [LogState(n, LogView(logs / n)) for n in (_log_names(logs) if logs.is_dir() else [])]
        self.refresh()

    def refresh(self) -> None:
        for state in self.logs:
            state.view.refresh()
            state.in_use = _in_use(state.view.folder)

    def measure(self) -> None:
        """Each log's segments and bytes, read and unread (reads every log's tail, zeros ahead included)."""
        for state in self.logs:
            state.segments, state.read_bytes, state.unread_bytes = _measure(state.view)

    def entry(self, rollout_id: str) -> Entry | None:
        """The episode's current write, or None if it has none."""
        found = self._log_entries(rollout_id)
        key = hashlib.sha256(rollout_id.encode()).hexdigest()
        legacy = self.root / "episodes" / key[:2] / f"{key}.ckpt"
        header = _read_header(legacy)
        if header is not None:
            _keep_newest(found, Entry(rollout_id, header.revision, path=legacy))
        return found.get(rollout_id)

    def entries(self) -> dict[str, Entry]:
        """Every episode with a write in the folder (deleted ones included: `Entry.chain.deleted`), by id."""
        found = self._log_entries()
        for path in self._legacy_files():
            try:
                rollout_id, revision = _legacy_identity(path)
            except DataLoss:
                found.setdefault(path.stem, Entry(path.stem, 0, path=path))  # named by its key: load says why
                continue
            _keep_newest(found, Entry(rollout_id, revision, path=path))
        return found

    def load(self, entry: Entry) -> EpisodeCheckpoint | None:
        """The record `entry` holds (None: deleted); DATA_LOSS, saying why, if it cannot be read back."""
        if entry.path is not None:
            data = _read_record_file(entry.path)
            return codec.decode(data, entry.path, entry.rollout_id)
        assert entry.log is not None
        view = entry.log.view
        if entry.chain is None:
            problem = f"write {entry.version} was lost to a damaged log region"
            raise _corrupt(str(view.folder), entry.rollout_id, problem)
        if entry.chain.deleted:
            return None
        try:
            return _record_from(entry.chain, view.read, str(view.folder), entry.rollout_id)[0]
        except FileNotFoundError:  # its owner compacted the log meanwhile: read it again
            self.refresh()
            fresh = self.entry(entry.rollout_id)
            return None if fresh is None else self.load(fresh)

    def _log_entries(self, only: str | None = None) -> dict[str, Entry]:
        """The newest write of each episode (of `only`, if given) across the logs, as `LogEpisodeStore` picks it."""
        found: dict[str, Entry] = {}
        for state in self.logs:
            chains, damaged = state.view.index.settled()
            if only is not None:
                chains = {only: chains[only]} if only in chains else {}
                damaged = {only: damaged[only]} if only in damaged else {}
            for rollout_id, chain in chains.items():
                _keep_newest(found, Entry(rollout_id, chain.version, state, chain))
            for rollout_id, version in damaged.items():
                _keep_newest(found, Entry(rollout_id, version, state))
        return found

    def _legacy_files(self) -> Iterator[Path]:
        episodes = self.root / "episodes"
        for shard in sorted(episodes.iterdir()) if episodes.is_dir() else []:
            if shard.is_dir():
                yield from sorted(p for p in shard.iterdir() if p.suffix == ".ckpt")


def read_record(root: str | Path, rollout_id: str) -> EpisodeCheckpoint | None:
    """The episode's current record in the store folder `root`, or None; DATA_LOSS if it was damaged."""
    root = Path(root)
    if not (root / "logs").is_dir() and not (root / "episodes").is_dir():
        return None
    folder = StoreFolder(root)
    entry = folder.entry(rollout_id)
    return None if entry is None else folder.load(entry)


def _keep_newest(found: dict[str, Entry], entry: Entry) -> None:
    held = found.get(entry.rollout_id)
    if held is None or entry.version > held.version:
        found[entry.rollout_id] = entry


def _in_use(folder: Path) -> bool:
    try:
        fd = os.open(folder / OWNER, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return ranges.held_elsewhere(fd, 0)
    finally:
        os.close(fd)


def _measure(view: LogView) -> tuple[int, int, int]:
    """Segments, bytes the view read, and non-zero bytes past them (read a chunk at a time)."""
    segments = read = unread = 0
    for seq, end in sorted(view.ends().items()):
        segments += 1
        read += end
        try:
            with open(view.folder / _segment_name(seq), "rb") as f:
                while chunk := os.pread(f.fileno(), _READ, end):
                    unread += len(chunk) - chunk.count(0)
                    end += len(chunk)
        except FileNotFoundError:
            continue
    return segments, read, unread


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _read_record_file(path: Path) -> bytes:
    """A files-store record, never read past the largest its format allows."""
    with open(path, "rb") as f:
        return f.read(codec.HEADER_SIZE + codec.MAX_RECORD_BYTES + 1)


def _legacy_identity(path: Path) -> tuple[str, int]:
    """The rollout id and revision of a files-store record, checked against the file's name (its id's hash)."""
    data = _read_record_file(path)
    header = codec.decode_header(data, path)
    record = EpisodeCheckpoint()
    try:
        record.ParseFromString(data[codec.HEADER_SIZE :])
    except DecodeError as exc:
        raise codec.corrupt(path, f"payload does not parse: {exc}") from None
    rollout_id = record.episode_id.rollout_id
    if hashlib.sha256(rollout_id.encode()).hexdigest() != path.stem:
        raise codec.corrupt(path, f"it holds episode {rollout_id!r}, whose file has another name")
    return rollout_id, header.revision
