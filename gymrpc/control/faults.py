"""Fault injection for crash tests of the control plane: a participant SIGKILLs itself once.

Timing a SIGKILL from outside cannot land between "records written" and "manifest
created"; the participant itself can. Set in the server's environment:

    GYMRPC_CONTROL_CRASH_AT=commit_before_manifest | commit_after_manifest | restore_before_install
                          | persist_before_write
    GYMRPC_CONTROL_CRASH_MARKER=/path/to/marker

The marker is created (O_EXCL) before the kill, so the restarted process does not crash
again. Never set these in production.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)
POINTS = ("commit_before_manifest", "commit_after_manifest", "restore_before_install", "persist_before_write")
"""`persist_before_write`: a background commit captured, its checkpoint resumed, nothing written yet."""


def armed(point: str) -> bool:
    """`point` is the planned crash (the code may wait for the moment it stands for first)."""
    return os.environ.get("GYMRPC_CONTROL_CRASH_AT") == point


def crash_point(point: str) -> None:
    """SIGKILL this process if `point` is the planned one and the crash has not happened yet."""
    if os.environ.get("GYMRPC_CONTROL_CRASH_AT") != point:
        return
    marker = os.environ.get("GYMRPC_CONTROL_CRASH_MARKER")
    if not marker:
        raise RuntimeError("GYMRPC_CONTROL_CRASH_AT needs GYMRPC_CONTROL_CRASH_MARKER")
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    os.write(fd, f"{point} pid {os.getpid()}\n".encode())
    os.fsync(fd)
    os.close(fd)
    log.warning("fault injection: SIGKILL", extra={"crash_at": point})
    os.kill(os.getpid(), signal.SIGKILL)
