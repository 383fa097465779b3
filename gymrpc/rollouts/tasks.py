"""Task files in the reference's JSONL row format, and the deterministic episode ids derived from them.

Ids are `<prefix>-t<task index>-r<repeat>` (the prefix defaults to the file's stem), so
the same file collected twice gives the same ids: a re-run, or a `--resume` after Ctrl-C,
is recognisable in the results and by the servers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gymrpc.errors import GymrpcError
from gymrpc.ids import check_id
from gymrpc.messages import task_from_row
from gymrpc.v1 import common_pb2

_MAX_PREFIX = 100
"""Leaves room for `-t<index>-r<repeat>` within the 128 characters a rollout id may have."""


class TaskFileError(ValueError):
    """A task file that cannot be read; the message names the file and the line."""


@dataclass(frozen=True)
class RolloutTask:
    """One task to roll out: its position in the file, and the protocol `Task`."""

    index: int
    """Zero-based index among the file's task rows (blank lines are not rows)."""
    task: common_pb2.Task
    prefix: str = "rollout"
    """First part of the episode ids; a valid rollout id itself."""
    line: int | None = None
    """Line number in the task file, for error messages."""
    row_id: str | None = None
    """The row's own `id`, when it has one (kept in the results as `id`)."""

    def episode_id(self, repeat: int) -> str:
        return f"{self.prefix}-t{self.index}-r{repeat}"


def _row_id(row: Mapping[str, Any]) -> str | None:
    value = row.get("id")
    return None if value is None or isinstance(value, dict | list) else str(value)


def id_prefix(name: str) -> str:
    """A valid rollout-id prefix from a file stem: unsafe characters become '-', bounded length."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")[:_MAX_PREFIX] or "tasks"
    if not cleaned[0].isalnum():
        cleaned = "t" + cleaned
    return check_id(cleaned, "id prefix")


def check_prefix(prefix: str) -> str:
    """Validate a user-given prefix (the ids it forms must pass `check_id`)."""
    if len(prefix) > _MAX_PREFIX:
        raise TaskFileError(f"id prefix {prefix!r} is longer than {_MAX_PREFIX} characters")
    try:
        return check_id(prefix, "id prefix")
    except GymrpcError as exc:
        raise TaskFileError(exc.message) from None


def tasks_from_rows(rows: Iterable[Mapping[str, Any]], prefix: str = "rollout") -> list[RolloutTask]:
    """Rows already in memory (for example from a trainer's dataset) as `RolloutTask`s."""
    check_prefix(prefix)
    out = []
    for index, row in enumerate(rows):
        try:
            out.append(RolloutTask(index, task_from_row(row, str(index)), prefix, row_id=_row_id(row)))
        except (GymrpcError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise TaskFileError(f"task row {index}: {_describe(exc)}") from None
    return out


def load_tasks(path: Path, *, prefix: str | None = None, limit: int | None = None) -> list[RolloutTask]:
    """Read a JSONL task file; the first bad row stops with an error naming its line.

    Every row is converted before any episode runs, so a typo on line 900 is found at once,
    not after 899 episodes.
    """
    prefix = check_prefix(prefix) if prefix is not None else id_prefix(path.stem)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TaskFileError(f"task file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskFileError(f"task file {path} cannot be read: {exc}") from None
    tasks: list[RolloutTask] = []
    for number, line in enumerate(text.splitlines(), 1):
        if limit is not None and len(tasks) >= limit:
            break
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskFileError(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})") from None
        if not isinstance(row, dict):
            raise TaskFileError(f"{where}: a task row must be a JSON object, got {type(row).__name__}")
        index = len(tasks)
        try:
            task = task_from_row(row, str(index))
        except (GymrpcError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise TaskFileError(f"{where}: not a valid task row: {_describe(exc)}") from None
        tasks.append(RolloutTask(index, task, prefix, number, _row_id(row)))
    if not tasks:
        raise TaskFileError(f"task file {path} has no task rows")
    return tasks


def _describe(exc: BaseException) -> str:
    if isinstance(exc, GymrpcError):
        return exc.message
    if isinstance(exc, KeyError):
        return f"missing key {exc.args[0]!r}"
    return str(exc)
