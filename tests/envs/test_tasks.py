"""`task_from_row` against the bundled reference rows and against malformed ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import gymrpc.envs.blackjack
import gymrpc.envs.counter
from gymrpc.envkit import task_from_row


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _row(**extra: Any) -> dict[str, Any]:
    return {"responses_create_params": {"input": [{"role": "user", "content": "hi"}]}, **extra}


def test_counter_rows_split_into_input_and_fields() -> None:
    rows = _rows(gymrpc.envs.counter.example_tasks_path())
    assert len(rows) == 5
    task = task_from_row(rows[0], "0")
    assert task.task_id == "0"
    assert task.input == [{"role": "user", "content": "add 1 then add 2 then get the count"}]
    assert task.fields == {"initial_count": 3, "expected_count": 6}


def test_blackjack_rows_drop_agent_ref() -> None:
    rows = _rows(gymrpc.envs.blackjack.example_tasks_path())
    assert len(rows) == 5
    task = task_from_row(rows[3], "3")
    assert [m["role"] for m in task.input] == ["system", "user"]
    assert task.input[1]["content"] == "Deal me in."
    assert task.fields == {}


def test_rollout_rows_lose_message_type_and_ng_keys() -> None:
    path = gymrpc.envs.blackjack.example_tasks_path().with_name("example_rollouts.jsonl")
    row = _rows(path)[0]
    task = task_from_row(row, "r0")
    assert all(set(m) == {"role", "content"} for m in task.input)
    assert task.input[2]["content"].startswith("Your hand: [8, 5] = 13\n")
    assert not any(key.startswith("_ng_") for key in task.fields)
    assert "agent_ref" not in task.fields
    assert task.fields["reward"] == -1.0


def test_content_parts_are_joined_with_newlines() -> None:
    parts = [{"type": "input_text", "text": "first"}, {"type": "input_text", "text": "second"}]
    row = {"responses_create_params": {"input": [{"type": "message", "role": "user", "content": parts}]}}
    assert task_from_row(row, "t").input == [{"role": "user", "content": "first\nsecond"}]


def test_string_input_is_one_user_message() -> None:
    row = {"responses_create_params": {"input": "hello"}}
    assert task_from_row(row, "t").input == [{"role": "user", "content": "hello"}]


def test_task_id_key_wins_over_default_and_stays_a_field() -> None:
    assert task_from_row(_row(task_id="abc"), "default").task_id == "abc"
    assert task_from_row(_row(task_id=7), "default").task_id == "7"
    task = task_from_row(_row(task_id="abc", _ng_task_index=0, other=1))
    assert task.fields == {"task_id": "abc", "other": 1}


def test_fields_do_not_alias_the_row() -> None:
    row = _row(ground_truth=[{"name": "f"}])
    task = task_from_row(row, "t")
    row["ground_truth"].append({"name": "g"})
    assert task.fields["ground_truth"] == [{"name": "f"}]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ([], "JSON object"),
        ({}, "responses_create_params"),
        ({"responses_create_params": {}}, "'input'"),
        ({"responses_create_params": {"input": 3}}, "'input' must be"),
        ({"responses_create_params": {"input": ["hi"]}}, r"input\[0\] must be an object"),
        ({"responses_create_params": {"input": [{"content": "x"}]}}, "'role'"),
        ({"responses_create_params": {"input": [{"role": "user"}]}}, "'content'"),
        (
            {"responses_create_params": {"input": [{"type": "function_call", "role": "user"}]}},
            "function_call",
        ),
        (
            {"responses_create_params": {"input": [{"role": "user", "content": [{"type": "input_image"}]}]}},
            "not a text part",
        ),
        (
            {"responses_create_params": {"input": [{"role": "user", "content": [{"type": "input_text"}]}]}},
            "string 'text'",
        ),
        ({"responses_create_params": {"input": [{"role": "user", "content": 5}]}}, "content must be"),
        (_row(task_id=True), "'task_id'"),
        (_row(task_id=""), "empty"),
    ],
)
def test_malformed_rows_raise_value_error(row: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        task_from_row(row, "t")


def test_missing_task_id_without_default_is_an_error() -> None:
    with pytest.raises(ValueError, match="no 'task_id'"):
        task_from_row(_row())
