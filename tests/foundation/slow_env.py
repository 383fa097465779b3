"""A test environment whose one tool takes a set time: to observe calls in flight during a stop."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from gymrpc.envkit import Environment, Session, TaskSpec, ToolResult, ToolSpec, VerifyResult


class SlowSession(Session):
    def call_tool(self, name: str, arguments: Mapping[str, Any]) -> ToolResult:
        time.sleep(float(arguments.get("seconds", 1.0)))
        return ToolResult("done")

    def verify(self, messages: Sequence[Mapping[str, Any]]) -> VerifyResult:
        return VerifyResult(1.0)


class SlowEnvironment(Environment):
    name = "slow"

    def tools(self) -> Sequence[ToolSpec]:
        return (ToolSpec("sleep", "Sleeps.", {"type": "object", "properties": {"seconds": {"type": "number"}}}),)

    def seed(self, task: TaskSpec) -> tuple[Session, Sequence[str]]:
        return SlowSession(), ()
