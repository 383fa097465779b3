"""Conversion of the reference's JSONL task rows into `TaskSpec`s.

Environments see only the opening conversation and their own fields, so that they
never depend on the Responses API request shape the datasets happen to use.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from gymrpc.envkit._types import TaskSpec

_NOT_FIELDS = frozenset({"responses_create_params", "agent_ref"})
_TEXT_PART_TYPES = frozenset({"input_text", "output_text", "text"})


def task_from_row(row: Mapping[str, Any], default_task_id: str | None = None) -> TaskSpec:
    """Split one dataset row into the opening conversation and the environment's fields.

    The task id comes from the row's `task_id` key when present, else `default_task_id`
    (typically the row's index). Raise `ValueError` when the row is malformed.
    """
    if not isinstance(row, Mapping):
        raise ValueError(f"task row must be a JSON object, got {type(row).__name__}")
    params = row.get("responses_create_params")
    if not isinstance(params, Mapping):
        raise ValueError("task row needs a 'responses_create_params' object")
    if "input" not in params:
        raise ValueError("responses_create_params needs an 'input'")
    return TaskSpec(
        task_id=_task_id(row, default_task_id),
        input=_messages(params["input"]),
        fields={
            key: copy.deepcopy(value)
            for key, value in row.items()
            if key not in _NOT_FIELDS and not key.startswith("_ng_")
        },
    )


def _task_id(row: Mapping[str, Any], default: str | None) -> str:
    if "task_id" not in row:
        if default is None:
            raise ValueError("task row has no 'task_id' and no default task id was given")
        return default
    value = row["task_id"]
    # Ids are compared as strings downstream; an int id is common in JSONL, a bool never meant one.
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ValueError(f"'task_id' must be a string or an integer, got {value!r}")
    if value == "":
        raise ValueError("'task_id' must not be empty")
    return str(value)


def _messages(raw: Any) -> list[dict[str, str]]:
    # The Responses API also accepts a bare string as the whole input: one user message.
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise ValueError(f"'input' must be a string or a list of messages, got {type(raw).__name__}")
    return [_message(i, item) for i, item in enumerate(raw)]


def _message(index: int, item: Any) -> dict[str, str]:
    where = f"input[{index}]"
    if not isinstance(item, Mapping):
        raise ValueError(f"{where} must be an object, got {type(item).__name__}")
    kind = item.get("type", "message")
    if kind != "message":
        raise ValueError(f"{where} has type {kind!r}; only 'message' items can open a task")
    role = item.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"{where} needs a non-empty string 'role'")
    if "content" not in item:
        raise ValueError(f"{where} needs a 'content'")
    return {"role": role, "content": _flatten(where, item["content"])}


def _flatten(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") not in _TEXT_PART_TYPES:
            raise ValueError(f"{where}.content[{j}] is not a text part ({sorted(_TEXT_PART_TYPES)})")
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{where}.content[{j}] needs a string 'text'")
        texts.append(text)
    # Newline-joined, as vLLM's chat templating joins text parts, so token ids match a served run.
    return "\n".join(texts)
