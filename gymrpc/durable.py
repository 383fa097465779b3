"""Making file-system changes survive a crash: a new name is durable only once its folder is fsynced."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def fsync_folder(folder: Path) -> None:
    """Make the folder's entries (names created, renamed or removed in it) durable."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_folders(folder: Path) -> None:
    """Create missing folders and fsync each new one's parent, so the path survives a crash."""
    missing = []
    path = folder
    while not path.exists():
        missing.append(path)
        path = path.parent
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):
            path.mkdir()
        fsync_folder(path.parent)
