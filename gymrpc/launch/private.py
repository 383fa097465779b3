"""Private folders that hold a process's secrets (a control token, TLS keys), gone when the process is.

A process removes its own folder when it stops, but one that is SIGKILLed (a Ray host actor
whose worker was killed, a client killed mid-run) cannot, and its folder keeps a private key on
the node. So each folder holds `owner.lock`, locked (`flock`) by its owner for as long as it
lives, and the next process that makes a folder of the same kind removes the folders whose lock
it can take: the kernel drops a lock when its holder dies, however it dies, where a pid could be
reused or belong to another PID namespace. A folder is made under a staging name and renamed
once locked, so a sweep never sees one half-made; a folder with no lock file (written before
this existed) is left alone, since nothing tells whether its owner lives.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)
LOCK = "owner.lock"
_STAGING = "gymrpc-staging-"


class PrivateFolder:
    """A 0700 folder named `<prefix><random>`, locked by this process until `remove`."""

    def __init__(self, prefix: str, parent: Path | None = None) -> None:
        parent = Path(parent if parent is not None else tempfile.gettempdir())
        sweep(prefix, parent)
        staging = Path(tempfile.mkdtemp(prefix=_STAGING, dir=parent))
        self._fd: int | None = os.open(staging / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else can hold it
        self.path = parent / (prefix + staging.name.removeprefix(_STAGING))
        os.rename(staging, self.path)

    def remove(self) -> None:
        """Delete the folder, then let go of its lock (in this order: a sweep never races its owner)."""
        if self._fd is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)
        self._fd = None


def sweep(prefix: str, parent: Path) -> list[Path]:
    """Remove this user's `<prefix>*` folders in `parent` whose owner is dead; the folders removed."""
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            fd = os.open(os.path.join(entry.path, LOCK), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue  # no lock file (an older folder, or not ours), or it went away meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # its owner lives
        else:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
        finally:
            os.close(fd)
    if removed:
        log.info("removed private folders of dead processes", extra={"folders": [str(p) for p in removed]})
    return removed
