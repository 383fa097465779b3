"""Checkpoint folders on shared filesystems: a start-up check that a server can really use its folder.

Durable resume (`--resume-dir`) and coordinated checkpoints write with the classic sequence:
create a temp file, fsync it, rename it over the target, fsync the folder; per-episode leases
are OFD byte-range locks (`F_OFD_SETLK`, the log store) or `flock` on a lock file (the files
store). On a cluster the folder must also be the *same* folder on every
node, or an episode resumed on another node finds nothing to resume. `check_checkpoint_dir`
runs that sequence once, in the folder, from the process (and so the node) that will use it, and
fails with the step that did not work. Given the launcher's marker it also proves the folder is
shared with the launcher rather than a node-local folder of the same name, and that `flock`
and OFD locks reach across nodes (the launcher holds both on the marker; taking them here must fail).
docs/ray.md says what each filesystem guarantees.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gymrpc.store import ranges

CHECKPOINT_ARGS = ("resume_dir",)
"""Server options (`args:` keys) that name a checkpoint folder the launcher checks before starting it."""
MARKER_PREFIX = ".gymrpc-marker-"
MARKER_BYTE = ranges.SPAN - 2
"""The byte of the marker the launcher holds an OFD read lock on (high, as the leases' bytes)."""


class CheckpointDirError(RuntimeError):
    """The folder cannot hold checkpoints from here; the message names the folder, the host and the step."""


def check_checkpoint_dir(path: str | Path, *, marker: tuple[str, str] | None = None, ofd: bool = True) -> str:
    """Create `path` if needed and prove, from this process, every file operation checkpoints rely on.

    Args:
        path: the checkpoint folder (absolute on clusters: every node resolves it alike).
        marker: `Marker.proof` of the marker `write_marker` left (and locked) in the folder on the
            launcher's node; when given, this node must read the same content there (the folder
            is shared) and must not get the lock the launcher holds (locks are shared too).
        ofd: also prove OFD byte-range locks work (the log store's leases; `--resume-store files`
            needs only flock).

    Returns the filesystem type (`ext4`, `nfs4`, ...), for the launcher's log.
    Raises CheckpointDirError naming the step that failed.
    """
    folder = Path(path)
    where = f"checkpoint folder {folder} on {socket.gethostname()} (pid {os.getpid()})"
    probe = folder / f".gymrpc-probe-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    step = "create the folder"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if marker is not None:
            step = "read the launcher's marker (is the folder shared with the launcher's node?)"
            name, content = marker
            seen = (folder / name).read_text()
            if seen != content:
                raise CheckpointDirError(f"{where}: the marker {name} holds other content: a different folder")
            step = "test the launcher's lock on the marker"
            _expect_locked(folder / name, where, ofd=ofd)
        step = "write and fsync a file"
        data = secrets.token_bytes(64)
        temp = probe.with_name(probe.name + ".tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        step = "rename it over another name and fsync the folder"
        os.replace(temp, probe)
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        step = "read it back"
        if probe.read_bytes() != data:
            raise CheckpointDirError(f"{where}: a file read back differs from what was written")
        step = "lock it with flock (per-episode leases)"
        fd = os.open(probe, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        if ofd:
            step = "lock a byte range with OFD locks (F_OFD_SETLK: the log store's per-episode leases)"
            try:
                ranges.check(folder)
            except (OSError, RuntimeError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                raise CheckpointDirError(
                    f"{where}: cannot {step}: {reason}. This filesystem (or kernel) does not give the log store's "
                    "leases; run the agent with --resume-store files here (one flock lock file per episode)"
                ) from exc
        step = "delete it"
        probe.unlink()
    except CheckpointDirError:
        raise
    except OSError as exc:
        raise CheckpointDirError(f"{where}: cannot {step}: {exc.strerror or exc}") from exc
    finally:
        for leftover in (probe, probe.with_name(probe.name + ".tmp")):
            with contextlib.suppress(OSError):
                leftover.unlink()
    return filesystem_type(folder)


@dataclass
class Marker:
    """A file only this launch knows, in a checkpoint folder, locked by the launcher while the stack runs."""

    folder: Path
    name: str
    content: str
    fd: int

    @property
    def proof(self) -> tuple[str, str]:
        """What a server's node must find in the folder (`check_checkpoint_dir(marker=...)`)."""
        return self.name, self.content

    def remove(self) -> None:
        """Delete the marker and drop the lock; idempotent."""
        with contextlib.suppress(OSError):
            (self.folder / self.name).unlink()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def write_marker(path: str | Path) -> Marker:
    """Create `path` if needed, write a marker file in it (durably) and hold `flock` on it."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    name, content = MARKER_PREFIX + secrets.token_hex(8), secrets.token_hex(16)
    temp = folder / (name + ".tmp")
    with open(temp, "w") as f:
        f.write(content)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, folder / name)
    fd = os.open(folder / name, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with contextlib.suppress(OSError):  # where OFD locks do not work, the node's check says so
        ranges.try_lock(fd, MARKER_BYTE, fcntl.F_RDLCK)
    return Marker(folder, name, content, fd)


def _expect_locked(path: Path, where: str, *, ofd: bool = True) -> None:
    """The launcher holds flock (and an OFD lock) on `path`: here they must show, or locks do not reach across nodes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if ofd and not ranges.held_elsewhere(fd, MARKER_BYTE):
            raise CheckpointDirError(
                f"{where}: OFD locks here do not see the launcher's lock on the same file, so the log store's "
                "per-episode leases would not keep two servers off one episode (NFS mounted with local_lock=posix "
                "or nolock?); run the agents with --resume-store files if flock reaches across nodes"
            )
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return
    finally:
        os.close(fd)
    raise CheckpointDirError(
        f"{where}: flock here ignores the launcher's lock on the same file, so per-episode leases would not "
        "keep two servers off one episode (NFS mounted with local_lock=flock or nolock? Lustre with localflock?)"
    )


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding `path`, from /proc/self/mountinfo (`unknown` elsewhere)."""
    target = os.path.realpath(path)
    best, kind = "", "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            mount = fields[4].replace("\\040", " ")
            fstype = fields[fields.index("-") + 1]
            inside = target == mount or target.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best):
                best, kind = mount, fstype
    return kind


def checkpoint_dirs(args: Mapping[str, Any]) -> list[str]:
    """The checkpoint folders a server's options name."""
    return [str(args[key]) for key in CHECKPOINT_ARGS if args.get(key)]


def needs_ofd(args: Mapping[str, Any]) -> bool:
    """Whether a server's episode store takes OFD leases (the log store, the agent's default)."""
    return str(args.get("resume_store", "log")) == "log"
