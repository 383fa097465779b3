"""The stateful counter: the smallest environment whose state matters across tool calls.

Behaviour follows NeMo Gym's `example_session_state_mgmt` server: the task's
`initial_count` seeds the counter (the reference's seed request requires it; its
`setdefault(..., 0)` only covers tools called on a never-seeded session, which
cannot happen here), `increment_counter` adds, `get_counter_value` reads, and the
reward is 1.0 exactly when the final count equals the task's `expected_count`.
Unlike the reference, `expected_count` is checked at seed time, because the
session must carry it to `verify` and a bad task should fail before any rollout.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gymrpc.envkit import (
    CheckpointMode,
    Environment,
    InvalidTask,
    Session,
    SnapshotCorrupt,
    SnapshotFormat,
    TaskSpec,
    ToolError,
    ToolResult,
    ToolSpec,
    VerifyResult,
)

_TOOLS = (
    ToolSpec(
        name="increment_counter",
        description="",
        parameters={
            "type": "object",
            "properties": {"count": {"type": "integer", "description": ""}},
            "required": ["count"],
            "additionalProperties": False,
        },
        strict=True,
    ),
    ToolSpec(
        name="get_counter_value",
        description="",
        parameters={"type": "object", "properties": {}, "required": [], "additionalProperties": False},
        strict=True,
    ),
)
_TOOL_NAMES = tuple(tool.name for tool in _TOOLS)
_SNAPSHOT_KEYS = frozenset({"count", "expected_count"})


def _is_int(value: Any) -> bool:
    # JSON decoders and callers hand us bools as ints; a bool count is always a mistake.
    return isinstance(value, int) and not isinstance(value, bool)


class CounterSession(Session):
    """One counter and the count the task expects it to end at."""

    def __init__(self, count: int, expected_count: int) -> None:
        self.count = count
        self.expected_count = expected_count

    def call_tool(self, name: str, arguments: Mapping[str, Any]) -> ToolResult:
        if name == "increment_counter":
            extra = sorted(set(arguments) - {"count"})
            if extra:
                raise ToolError(f"increment_counter takes only 'count'; unexpected: {', '.join(extra)}")
            if "count" not in arguments:
                raise ToolError("increment_counter needs an integer argument 'count'")
            count = arguments["count"]
            if not _is_int(count):
                raise ToolError(f"increment_counter: 'count' must be an integer, got {count!r}")
            self.count += count
            return ToolResult(json.dumps({"success": True}))
        if name == "get_counter_value":
            if arguments:
                raise ToolError(f"get_counter_value takes no arguments; got: {', '.join(sorted(arguments))}")
            return ToolResult(json.dumps({"count": self.count}))
        raise ToolError(f"unknown tool {name!r}; the counter offers: {', '.join(_TOOL_NAMES)}")

    def verify(self, messages: Sequence[Mapping[str, Any]]) -> VerifyResult:
        return VerifyResult(
            reward=float(self.count == self.expected_count),
            details={"count": self.count, "expected_count": self.expected_count},
        )

    def export(self) -> bytes:
        return _encode(self.count, self.expected_count)

    def capture(self) -> Callable[[], bytes]:
        """Two integers: taken now, encoded when the checkpoint is written."""
        return functools.partial(_encode, self.count, self.expected_count)


def _encode(count: int, expected_count: int) -> bytes:
    state = {"count": count, "expected_count": expected_count}
    return json.dumps(state, sort_keys=True, separators=(",", ":")).encode()


class CounterEnvironment(Environment):
    """Sessions are independent counters; the state is two integers, so snapshots are tiny JSON."""

    name = "counter"
    checkpoint_mode = CheckpointMode.EXPORTED
    snapshot_format = SnapshotFormat("gymrpc.counter", 1, "application/json")
    runs_inline = True  # integer arithmetic: no thread hop needed

    def tools(self) -> Sequence[ToolSpec]:
        return _TOOLS

    def seed(self, task: TaskSpec) -> tuple[CounterSession, Sequence[str]]:
        return CounterSession(_int_field(task, "initial_count"), _int_field(task, "expected_count")), ()

    def restore(self, payload: bytes) -> CounterSession:
        state = _decode(payload)
        if not isinstance(state, dict) or set(state) != _SNAPSHOT_KEYS:
            raise SnapshotCorrupt(f"counter snapshot must be an object with keys {sorted(_SNAPSHOT_KEYS)}")
        bad = sorted(key for key in _SNAPSHOT_KEYS if not _is_int(state[key]))
        if bad:
            raise SnapshotCorrupt(f"counter snapshot: {', '.join(bad)} must be integers")
        return CounterSession(state["count"], state["expected_count"])


def _int_field(task: TaskSpec, key: str) -> int:
    if key not in task.fields:
        raise InvalidTask(f"counter task {task.task_id!r} lacks the integer field {key!r}")
    value = task.fields[key]
    if not _is_int(value):
        raise InvalidTask(f"counter task {task.task_id!r}: {key!r} must be an integer, got {value!r}")
    return value


def _decode(payload: bytes) -> Any:
    """Parse JSON strictly: a snapshot with duplicate keys or NaN was not written by `export`."""

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in pairs]
        if len(set(keys)) != len(keys):
            raise SnapshotCorrupt("counter snapshot has duplicate keys")
        return dict(pairs)

    def no_constant(name: str) -> Any:
        raise SnapshotCorrupt(f"counter snapshot contains {name}")

    if not isinstance(payload, bytes | bytearray | memoryview):
        raise SnapshotCorrupt(f"counter snapshot must be bytes, got {type(payload).__name__}")
    try:
        return json.loads(bytes(payload), object_pairs_hook=no_duplicates, parse_constant=no_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, int too long
        raise SnapshotCorrupt(f"counter snapshot is not valid JSON: {exc}") from exc
