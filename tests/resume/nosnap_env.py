"""A counter-like test environment whose sessions cannot be snapshotted: resume must refuse it up front."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gymrpc.envkit import Environment, Session, TaskSpec, ToolResult, ToolSpec, VerifyResult


class TallySession(Session):
    def __init__(self) -> None:
        self.calls = 0

    def call_tool(self, name: str, arguments: Mapping[str, Any]) -> ToolResult:
        self.calls += 1
        return ToolResult(str(self.calls))

    def verify(self, messages: Sequence[Mapping[str, Any]]) -> VerifyResult:
        return VerifyResult(1.0)


class NoSnapshotEnvironment(Environment):
    """Keeps state (a call tally) but declares no snapshot format."""

    name = "nosnap"

    def tools(self) -> Sequence[ToolSpec]:
        return (ToolSpec("tally", "Counts calls.", {"type": "object", "properties": {}}),)

    def seed(self, task: TaskSpec) -> tuple[Session, Sequence[str]]:
        return TallySession(), ()
