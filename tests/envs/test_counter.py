"""The counter environment: example tasks, recorded rollouts, bad inputs and snapshots."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from gymrpc.envkit import (
    CheckpointMode,
    InvalidTask,
    SnapshotCorrupt,
    SnapshotFormat,
    TaskSpec,
    ToolError,
    task_from_row,
)
from gymrpc.envs.counter import CounterEnvironment, example_tasks_path


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


TASK_ROWS = _rows(example_tasks_path())
ROLLOUT_ROWS = _rows(example_tasks_path().with_name("example_rollouts.jsonl"))


def _task(**fields: Any) -> TaskSpec:
    return TaskSpec(task_id="t", input=[{"role": "user", "content": "x"}], fields=fields)


def _addends(row: dict[str, Any]) -> list[int]:
    text = row["responses_create_params"]["input"][0]["content"]
    return [int(n) for n in re.findall(r"add (\d+)", text)]


def test_declares_exported_checkpoints_and_its_snapshot_format() -> None:
    assert CounterEnvironment.name == "counter"
    assert CounterEnvironment.checkpoint_mode is CheckpointMode.EXPORTED
    assert CounterEnvironment.snapshot_format == SnapshotFormat("gymrpc.counter", 1, "application/json")


def test_tool_schemas_match_the_task_rows() -> None:
    offered = [
        {
            "name": t.name,
            "parameters": t.parameters,
            "strict": t.strict,
            "type": "function",
            "description": t.description,
        }
        for t in CounterEnvironment().tools()
    ]
    assert len(TASK_ROWS) == 5
    for row in TASK_ROWS:
        assert offered == row["responses_create_params"]["tools"]


@pytest.mark.parametrize("index", range(5))
def test_scripted_correct_sequence_earns_reward_one(index: int) -> None:
    row = TASK_ROWS[index]
    session, opening = CounterEnvironment().seed(task_from_row(row, str(index)))
    assert list(opening) == []
    for n in _addends(row):
        assert session.call_tool("increment_counter", {"count": n}).output == '{"success": true}'
    expected = row["expected_count"]
    assert session.call_tool("get_counter_value", {}).output == f'{{"count": {expected}}}'
    result = session.verify([])
    assert result.reward == 1.0
    assert result.details == {"count": expected, "expected_count": expected}


@pytest.mark.parametrize("index", range(5))
def test_skipping_an_increment_earns_reward_zero(index: int) -> None:
    row = TASK_ROWS[index]
    session, _ = CounterEnvironment().seed(task_from_row(row, str(index)))
    first = _addends(row)[0]
    session.call_tool("increment_counter", {"count": first})
    result = session.verify([])
    assert result.reward == 0.0
    assert result.details == {"count": row["initial_count"] + first, "expected_count": row["expected_count"]}


def _prompt(row: dict[str, Any]) -> str:
    return row["responses_create_params"]["input"][0]["content"]


@pytest.mark.parametrize("rollout", ROLLOUT_ROWS, ids=_prompt)
def test_replaying_recorded_rollouts_gives_the_recorded_outputs_and_reward(rollout: dict[str, Any]) -> None:
    (row,) = [r for r in TASK_ROWS if _prompt(r) == _prompt(rollout)]
    session, _ = CounterEnvironment().seed(task_from_row(row, "t"))
    items = rollout["response"]["output"]
    outputs = {}
    for item in items:
        if item["type"] == "function_call":
            outputs[item["call_id"]] = session.call_tool(item["name"], json.loads(item["arguments"])).output
    recorded = {i["call_id"]: i["output"] for i in items if i["type"] == "function_call_output"}
    assert outputs == recorded
    assert session.verify([]).reward == rollout["reward"]


@pytest.mark.parametrize(
    ("name", "arguments", "message"),
    [
        ("increment_counter", {}, "needs an integer argument 'count'"),
        ("increment_counter", {"count": "1"}, "must be an integer"),
        ("increment_counter", {"count": 1.0}, "must be an integer"),
        ("increment_counter", {"count": True}, "must be an integer"),
        ("increment_counter", {"count": None}, "must be an integer"),
        ("increment_counter", {"count": 1, "by": 2}, "unexpected: by"),
        ("get_counter_value", {"count": 1}, "takes no arguments"),
        ("reset_counter", {}, "unknown tool 'reset_counter'; the counter offers: increment_counter, get_"),
    ],
)
def test_bad_tool_calls_raise_tool_error_and_change_nothing(name: str, arguments: dict[str, Any], message: str) -> None:
    session, _ = CounterEnvironment().seed(_task(initial_count=3, expected_count=3))
    with pytest.raises(ToolError, match=message):
        session.call_tool(name, arguments)
    assert session.call_tool("get_counter_value", {}).output == '{"count": 3}'


def test_overshooting_the_expected_count_earns_reward_zero() -> None:
    session, _ = CounterEnvironment().seed(_task(initial_count=3, expected_count=6))
    session.call_tool("increment_counter", {"count": 4})
    assert session.verify([]).reward == 0.0


def test_negative_increments_are_allowed() -> None:
    session, _ = CounterEnvironment().seed(_task(initial_count=3, expected_count=1))
    session.call_tool("increment_counter", {"count": -2})
    assert session.verify([]).reward == 1.0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"expected_count": 6}, "lacks the integer field 'initial_count'"),
        ({"initial_count": 3}, "lacks the integer field 'expected_count'"),
        ({"initial_count": "3", "expected_count": 6}, "'initial_count' must be an integer"),
        ({"initial_count": 3.0, "expected_count": 6}, "'initial_count' must be an integer"),
        ({"initial_count": False, "expected_count": 6}, "'initial_count' must be an integer"),
        ({"initial_count": 3, "expected_count": None}, "'expected_count' must be an integer"),
        ({"initial_count": 3, "expected_count": True}, "'expected_count' must be an integer"),
    ],
)
def test_invalid_tasks_fail_at_seed_time(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidTask, match=message):
        CounterEnvironment().seed(_task(**fields))


def test_snapshot_is_canonical_and_round_trips_into_a_new_environment() -> None:
    session, _ = CounterEnvironment().seed(_task(initial_count=3, expected_count=6))
    session.call_tool("increment_counter", {"count": 1})
    payload = session.export()
    assert payload == b'{"count":4,"expected_count":6}'

    restored = CounterEnvironment().restore(payload)
    assert restored.export() == payload
    restored.call_tool("increment_counter", {"count": 2})
    assert restored.verify([]).reward == 1.0
    assert session.verify([]).reward == 0.0, "the restored copy must not share state with the original"


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"not json",
        b"\xff\xfe",
        b"[]",
        b'"count"',
        b'{"count":4}',
        b'{"count":4,"expected_count":6,"extra":0}',
        b'{"count":true,"expected_count":6}',
        b'{"count":4,"expected_count":false}',
        b'{"count":4.0,"expected_count":6}',
        b'{"count":"4","expected_count":6}',
        b'{"count":null,"expected_count":6}',
        b'{"count":NaN,"expected_count":6}',
        b'{"count":4,"count":5,"expected_count":6}',
        b"[" * 100_000,
        "{}",
    ],
)
def test_corrupt_snapshots_raise_snapshot_corrupt(payload: Any) -> None:
    with pytest.raises(SnapshotCorrupt):
        CounterEnvironment().restore(payload)
