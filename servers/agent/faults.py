"""Fault injection for crash tests: the agent SIGKILLs itself at one exact boundary, once.

Timing a SIGKILL from outside cannot hit "right after the durable save of tool call 1";
the agent itself can. Set in the agent's environment:

    GYMRPC_CRASH_AT=after_seed | after_model[:N] | after_tool[:N] | after_turn[:N] | unsaved_tool[:N]
                    | during_verify | during_tool[:N]
    GYMRPC_CRASH_MARKER=/path/to/marker

`after_*` kills the process right after the save that follows the seed, model call N
(zero-based step), tool call N or text turn N of an episode (the first one when N is
omitted). `unsaved_tool[:N]` kills it as soon as tool call N has returned, before the
agent has waited for the save of the boundary before it (`EpisodeStore.begin_save`),
which may or may not have reached the disk. `during_verify` kills it after the resources
server has served `Verify` but before the agent has seen the reply, so the work is done
and its result is lost; `during_tool[:N]` likewise for tool call N of an episode. The
marker file is created (O_EXCL) before the kill; a process that finds it does not crash, so
the restarted agent finishes the episode. Never set these in production.
"""

from __future__ import annotations

import logging
import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
KINDS = ("after_seed", "after_model", "after_tool", "after_turn", "unsaved_tool", "during_verify", "during_tool")
_SPEC = re.compile(r"(?P<kind>[a-z_]+)(?::(?P<index>\d+))?")


@dataclass(frozen=True)
class CrashPlan:
    kind: str
    index: int | None
    marker: Path

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> CrashPlan | None:
        spec = environ.get("GYMRPC_CRASH_AT", "")
        if not spec:
            return None
        match = _SPEC.fullmatch(spec)
        if match is None or match["kind"] not in KINDS:
            raise ValueError(f"GYMRPC_CRASH_AT={spec!r}: expected one of {', '.join(KINDS)}, optionally ':N'")
        marker = environ.get("GYMRPC_CRASH_MARKER", "")
        if not marker:
            raise ValueError("GYMRPC_CRASH_AT needs GYMRPC_CRASH_MARKER (the file that makes the crash happen once)")
        return cls(match["kind"], None if match["index"] is None else int(match["index"]), Path(marker))

    def at(self, kind: str, index: int = 0) -> None:
        """Crash here if this is the planned boundary and the crash has not happened yet."""
        if kind == self.kind and (self.index is None or index == self.index) and self._claim():
            log.warning("fault injection: SIGKILL", extra={"crash_at": kind, "index": index})
            os.kill(os.getpid(), signal.SIGKILL)

    def _claim(self) -> bool:
        try:
            fd = os.open(self.marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return False
        os.write(fd, f"{self.kind}:{self.index} pid {os.getpid()}\n".encode())
        os.fsync(fd)
        os.close(fd)
        return True


class CrashingResources:
    """A resources stub that kills the agent once the reply of a `Verify` (`during_verify`) or of an
    episode's tool call N (`during_tool[:N]`) has arrived: the work is done, its result lost."""

    def __init__(self, stub: Any, plan: CrashPlan) -> None:
        self._stub, self._plan = stub, plan
        self._tool_calls: dict[str, int] = {}
        """Tool calls made so far, by session id (test runs hold few sessions)."""

    async def CallTool(self, request: Any, **kwargs: Any) -> Any:
        reply = await self._stub.CallTool(request, **kwargs)
        index = self._tool_calls.get(request.session_id, 0)
        self._tool_calls[request.session_id] = index + 1
        self._plan.at("during_tool", index)
        return reply

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)

    async def Verify(self, request: Any, **kwargs: Any) -> Any:
        reply = await self._stub.Verify(request, **kwargs)
        self._plan.at("during_verify")
        return reply
