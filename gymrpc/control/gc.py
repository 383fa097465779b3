"""Removing checkpoint folders that were never published, so they do not pile up over a long run.

A checkpoint folder (`<root>/<checkpoint_id>`) is published once its index (`checkpoint.json`)
exists; a publish that failed leaves the manifests and records of the members that did write,
and no index. Two ways remove them:

- `remove_unpublished`: the controller, once every member confirmed that nothing writes into
  the folder any more (`Controller.discard`), removes that one folder;
- `sweep`: an operator's (or a trainer's) pass over a checkpoint root (`gymrpc ctl gc ROOT`)
  that removes every index-less checkpoint folder older than the newest published one.

Neither ever removes a folder with an index, nor one that is not shaped like a checkpoint
folder (anything but `<kind>/<member>/` folders holding manifests, records files and their
temporary files: a user's own folder under the root is left alone), nor follows a symlink. The
sweep keeps a folder that may still be written: one with a live publish lease (`LEASE`, written
by the controller from the capture until the publish ends) or with anything in it as new as the
newest published index, or one whose records an incremental checkpoint refers to (`referenced`).
A folder is removed by renaming it first (`.gc-<name>-<random>`), then
deleting the renamed tree: a late writer then fails on its vanished folder instead of writing
into half of it. Everything here blocks (file I/O).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gymrpc.control import store
from gymrpc.control.index import INDEX, load_index
from gymrpc.control.types import Kind
from gymrpc.durable import fsync_folder, make_folders
from gymrpc.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound
from gymrpc.v1 import participant_service_pb2 as pb

LEASE = ".publishing.json"
"""`{"checkpoint_id", "until"}` in a checkpoint folder: a publish may still happen until `until` (epoch s)."""
_MEMBER_FILE = re.compile(r"manifest\.json|records-[0-9a-f]{64}\.bin|\.(records|manifest)-[^/]*\.tmp")
_TOP_FILE = re.compile(rf"{re.escape(LEASE)}|\.(checkpoint|publishing)-[^/]*\.tmp")
_KINDS = frozenset(kind.folder for kind in Kind)


@dataclass(frozen=True)
class Verdict:
    """What the sweep did (or would do) with one entry of the root, and why."""

    path: Path
    removed: bool
    reason: str


def write_lease(folder: Path, checkpoint_id: str, until: float) -> None:
    """Mark `folder` as possibly still being published until `until` (replaces an earlier lease)."""
    make_folders(folder)
    temp = folder / f".publishing-{secrets.token_hex(4)}.tmp"
    temp.write_text(json.dumps({"checkpoint_id": checkpoint_id, "until": until}) + "\n")
    os.replace(temp, folder / LEASE)


def drop_lease(folder: Path) -> None:
    """The publish ended (published or abandoned): the folder is no longer leased."""
    with contextlib.suppress(FileNotFoundError):
        (folder / LEASE).unlink()


def lease_until(folder: Path) -> float | None:
    """Until when the folder's publish lease runs; None without a readable one."""
    try:
        doc = json.loads((folder / LEASE).read_text())
        return float(doc["until"])
    except (OSError, ValueError, TypeError, KeyError):
        return None


def check_root(value: str | os.PathLike[str]) -> Path:
    """A checkpoint root to sweep: absolute, normalised, an existing folder (no symlink), not `/`,
    and not itself a checkpoint folder (one with an index: its root is its parent)."""
    root = store.check_checkpoint_dir(os.fspath(value))
    if root == Path(root.anchor):
        raise InvalidArgument(f"{root} is a filesystem root; name a checkpoint root", metadata={"field": "root"})
    try:
        mode = os.lstat(root).st_mode
    except FileNotFoundError:
        raise NotFound(f"{root} does not exist", metadata={"checkpoint_dir": str(root)[:200]}) from None
    if not stat.S_ISDIR(mode):
        raise InvalidArgument(
            f"{root} is not a folder (a symlink or a file); name the checkpoint root itself",
            metadata={"field": "root"},
        )
    if (root / INDEX).exists() or checkpoint_shaped(root):
        raise InvalidArgument(
            f"{root} is a checkpoint folder, not a checkpoint root; name its parent ({root.parent})",
            metadata={"field": "root"},
        )
    if root.name in _KINDS and ((root.parent / INDEX).exists() or checkpoint_shaped(root.parent)):
        raise InvalidArgument(
            f"{root} is inside the checkpoint folder {root.parent}; name the checkpoint root ({root.parent.parent})",
            metadata={"field": "root"},
        )
    return root


def checkpoint_shaped(folder: Path, *, empty: bool = False) -> bool:
    """`folder` holds only what checkpoints write: `<kind>/<member>/` folders of manifests, records files
    and temporary files, plus the lease; and at least one kind folder (unless `empty`). No symlink anywhere."""
    kinds = 0
    try:
        for entry in os.scandir(folder):
            if entry.is_symlink():
                return False
            if entry.is_dir(follow_symlinks=False) and entry.name in _KINDS:
                kinds += 1
                for member in os.scandir(entry.path):
                    if member.is_symlink() or not member.is_dir(follow_symlinks=False):
                        return False
                    for item in os.scandir(member.path):
                        if not item.is_file(follow_symlinks=False) or not _MEMBER_FILE.fullmatch(item.name):
                            return False
            elif not (entry.is_file(follow_symlinks=False) and _TOP_FILE.fullmatch(entry.name)):
                return False
    except (FileNotFoundError, NotADirectoryError):
        return False
    return empty or kinds > 0


def _manifests(folder: Path) -> Iterator[pb.CheckpointManifest | None]:
    """Each member's manifest in checkpoint folder `folder`, None for a damaged one; members without one are skipped.

    The one walk over `<kind>/<member>/manifest.json` that the removal checks and the reference scan share.
    """
    for kind in sorted(_KINDS):
        try:
            members = sorted(os.scandir(folder / kind), key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for member in members:
            try:
                manifest = store.load_manifest(Path(member.path, store.MANIFEST))
            except DataLoss:
                yield None
                continue
            if manifest is not None:
                yield manifest


def _manifest_ids(folder: Path) -> set[str]:
    """The checkpoint ids the folder's manifests name; `?` for a damaged one (it could be anyone's)."""
    return {"?" if manifest is None else manifest.checkpoint_id for manifest in _manifests(folder)}


def _newest_mtime(folder: Path) -> float:
    """The newest modification time of the folder or anything in it (a write in progress touches it)."""
    newest = os.lstat(folder).st_mtime
    for path, dirs, files in os.walk(folder):
        for name in (*dirs, *files):
            try:
                newest = max(newest, os.lstat(os.path.join(path, name)).st_mtime)
            except FileNotFoundError:
                continue
    return newest


def _remove(folder: Path) -> None:
    """Rename, then delete: a writer that is late finds its folder gone rather than half of it."""
    hidden = folder.with_name(f".gc-{folder.name}-{secrets.token_hex(4)}")
    os.rename(folder, hidden)
    fsync_folder(folder.parent)
    shutil.rmtree(hidden)


def remove_unpublished(folder: Path, checkpoint_id: str) -> bool:
    """Remove the folder of checkpoint `checkpoint_id`, which will not be published; False if none is there.

    Refused (FAILED_PRECONDITION, nothing removed) when the folder has an index, is not shaped like a
    checkpoint folder, or holds a manifest of another checkpoint. Call it only once no member can still
    write into the folder (`Controller.discard`).
    """
    where = {"checkpoint_dir": str(folder)[:200], "checkpoint_id": checkpoint_id}
    if not os.path.lexists(folder):
        return False
    if (folder / INDEX).exists():
        raise FailedPrecondition(f"{folder} is published (it has {INDEX}); it is not removed", metadata=where)
    if not checkpoint_shaped(folder, empty=True):
        raise FailedPrecondition(f"{folder} holds more than a checkpoint's files; it is not removed", metadata=where)
    if others := _manifest_ids(folder) - {checkpoint_id}:
        raise FailedPrecondition(
            f"{folder} holds manifests of checkpoint {sorted(others)[0]!r}, not only of {checkpoint_id!r}; "
            "it is not removed",
            metadata=where,
        )
    _remove(folder)
    return True


def newest_published(root: Path) -> Path | None:
    """The published checkpoint folder under `root` with the newest index; None if there is none."""
    newest: tuple[float, Path] | None = None
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return None
    for entry in entries:
        if entry.name.startswith(".") or entry.is_symlink() or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            when = load_index(Path(entry.path, INDEX)).create_time.ToNanoseconds() / 1e9
        except DataLoss:
            continue  # no index (FileNotFoundError is reported as DataLoss there too), or a damaged one
        if newest is None or when > newest[0]:
            newest = (when, Path(entry.path))
    return None if newest is None else newest[1]


def referenced(root: Path) -> dict[str, set[str]]:
    """Checkpoint folder name -> the folders under `root` whose manifests refer to its records (incremental)."""
    refs: dict[str, set[str]] = {}
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.is_symlink() or not entry.is_dir(follow_symlinks=False):
            continue
        for manifest in _manifests(Path(entry.path)):
            for segment in manifest.segments if manifest is not None else ():
                name = segment.records_path.partition("/")[0]
                if name and name != entry.name:
                    refs.setdefault(name, set()).add(entry.name)
    return refs


def sweep(
    root: str | os.PathLike[str], *, dry_run: bool = False, now: float | None = None, keep: int | None = None
) -> list[Verdict]:
    """Remove the unpublished checkpoint folders under `root` older than its newest published checkpoint.

    Returns a verdict for every index-less checkpoint folder (removed, or kept and why), sorted by
    name; published folders and entries that are not checkpoint folders are left alone and not listed.
    `dry_run`: decide, remove nothing. Without any published checkpoint under `root` nothing is removed.
    `keep`: also remove published checkpoints other than the newest `keep` (at least 1), except
    those whose records a checkpoint that stays refers to (incremental commits); those are listed too.
    """
    root = check_root(root)
    if keep is not None and keep < 1:
        raise InvalidArgument(f"keep must be at least 1, not {keep}", metadata={"field": "keep"})
    now = time.time() if now is None else now
    published: list[float] = []
    by_time: list[tuple[float, Path]] = []
    candidates: list[Path] = []
    verdicts = []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.is_symlink() or not entry.is_dir(follow_symlinks=False):
            continue
        if entry.name.startswith(".gc-"):  # condemned by an earlier removal that did not finish
            if not dry_run:
                shutil.rmtree(entry.path)
            verdicts.append(Verdict(Path(entry.path), True, "left by an earlier removal that did not finish"))
            continue
        if entry.name.startswith("."):
            continue
        folder = Path(entry.path)
        if (folder / INDEX).exists():
            try:
                published.append(load_index(folder / INDEX).create_time.ToNanoseconds() / 1e9)
                by_time.append((published[-1], folder))
            except DataLoss:
                continue  # damaged: neither garbage nor a reference point
        elif checkpoint_shaped(folder):
            candidates.append(folder)
    newest = max(published, default=None)
    refs = referenced(root) if candidates or keep is not None else {}
    for folder in candidates:
        until = lease_until(folder)
        if folder.name in refs:
            reason = f"checkpoint {min(refs[folder.name])} refers to its records (an incremental commit)"
        elif newest is None:
            reason = "no checkpoint under the root is published yet"
        elif until is not None and until > now:
            reason = f"its publish lease runs until {time.strftime('%H:%M:%S', time.localtime(until))}"
        elif _newest_mtime(folder) >= newest:
            reason = "it is as new as the newest published checkpoint (it may still be written)"
        else:
            if not dry_run:
                _remove(folder)
            verdicts.append(Verdict(folder, True, "unpublished, older than the newest published checkpoint"))
            continue
        verdicts.append(Verdict(folder, False, reason))
    if keep is not None:
        verdicts += _retire_published(sorted(by_time, reverse=True)[keep:], root, refs, dry_run)
    return verdicts


def _retire_published(
    old: list[tuple[float, Path]], root: Path, refs: dict[str, set[str]], dry_run: bool
) -> list[Verdict]:
    """Remove the published folders `old`, but none whose records a folder that stays refers to."""
    removable = {folder.name for _, folder in old}
    changed = True
    while changed:  # a folder kept for a reference keeps what it refers to in turn
        changed = False
        for name in sorted(removable):
            if refs.get(name, set()) - removable:
                removable.discard(name)
                changed = True
    verdicts = []
    for _, folder in sorted(old, key=lambda t: t[1].name):
        if folder.name in removable:
            if not dry_run:
                _remove(folder)
            verdicts.append(Verdict(folder, True, "published, older than the checkpoints kept"))
        else:
            stays = min(refs[folder.name] - removable)
            verdicts.append(Verdict(folder, False, f"published; checkpoint {stays} refers to its records"))
    return verdicts
