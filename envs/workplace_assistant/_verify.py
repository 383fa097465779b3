"""The reward: replaying tool calls on fresh tables and comparing the five tables the reference compares.

Mode `replay` is the reference's `is_correct`: replay the predicted calls (every tool call
in the conversation) and the ground truth, each on fresh tables, skip calls that raise,
lower-case every string column but `status`, `list_name` and `board` with `.str.lower()`,
and require `DataFrame.equals` on calendar events, emails, plots, project tasks and CRM.
That reward never looks at the session's own tables, so it cannot notice a bad restore.

Mode `live` is stricter: the replay check must pass *and* the session's live tables must
equal the ground-truth replay under the same case folding, compared strictly (dtypes, index
labels, None versus NaN), so a restore that changed any table changes the reward.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from gymrpc.envs.workplace_assistant._data import COMPARED_TABLES, fresh_tables
from gymrpc.envs.workplace_assistant.tools import ToolBox
from gymrpc.snapshots import TableSet, frame_differences, frame_fingerprint

VERIFY_MODES = ("replay", "live")
CASE_SENSITIVE = frozenset({"status", "list_name", "board"})


def predicted_calls(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every tool call the assistant made, in order, as `{"name", "arguments"}` (arguments as sent)."""
    calls = []
    for message in messages:
        if message.get("role") != "assistant":
            continue
        for call in message.get("tool_calls") or ():
            function = call.get("function", call)
            calls.append({"name": function.get("name"), "arguments": function.get("arguments")})
    return calls


def replay(calls: Sequence[Mapping[str, Any]]) -> TableSet:
    """Fresh tables after running the calls the way the reference's replay does (failures skipped)."""
    tables = fresh_tables(with_blocks=False)
    box = ToolBox(tables)
    for call in calls:
        try:
            box.invoke(call["name"], json.loads(call["arguments"]))
        except Exception:
            continue
    return tables


def _lower_like_reference(frame: pd.DataFrame) -> pd.DataFrame:
    out = frame.copy()
    for column in out.columns:
        if column not in CASE_SENSITIVE:
            out[column] = out[column].str.lower()
    return out


def _fold_case_strictly(frame: pd.DataFrame) -> pd.DataFrame:
    """Lower-case str values only; None, NaN and every other value stay exactly what they were."""
    out = frame.copy()
    for position, column in enumerate(out.columns):
        if column in CASE_SENSITIVE or out.dtypes.iloc[position].kind != "O":
            continue
        values = out.iloc[:, position].to_numpy(dtype=object)
        folded = np.array([v.lower() if type(v) is str else v for v in values], dtype=object)
        out.isetitem(position, pd.Series(folded, index=out.index, dtype=object))
    return out


def reference_mismatches(predicted: TableSet, truth: TableSet) -> list[str]:
    """Names of compared tables that differ under the reference's rule."""
    return [
        name
        for name in COMPARED_TABLES
        if not _lower_like_reference(predicted.get(name)).equals(_lower_like_reference(truth.get(name)))
    ]


def live_differences(live: TableSet, truth: TableSet) -> dict[str, list[str]]:
    """Strict differences between the live tables and the ground-truth replay, per compared table."""
    out = {}
    for name in COMPARED_TABLES:
        problems = frame_differences(_fold_case_strictly(live.get(name)), _fold_case_strictly(truth.get(name)), 3)
        if problems:
            out[name] = problems
    return out


def score(
    live: TableSet, messages: Sequence[Mapping[str, Any]], ground_truth: Sequence[Mapping[str, Any]], mode: str
) -> tuple[float, dict[str, Any]]:
    """The reward and its explanation, including a strict fingerprint of every live table."""
    calls = predicted_calls(messages)
    details: dict[str, Any] = {"verify_mode": mode, "predicted_calls": len(calls)}
    truth = replay(ground_truth)
    try:
        mismatched = reference_mismatches(replay(calls), truth)
    except (AttributeError, TypeError, ValueError) as exc:  # e.g. `.str` on a column no longer holding text
        mismatched = list(COMPARED_TABLES)
        details["error"] = f"{type(exc).__name__}: {exc}"
    details["replay_match"] = not mismatched
    details["mismatched_tables"] = mismatched
    passed = not mismatched
    if mode == "live":
        differences = live_differences(live, truth)
        details["live_match"] = not differences
        details["live_differences"] = differences
        passed = passed and not differences
    details["tables"] = {name: frame_fingerprint(live.get(name)) for name in live}
    return (1.0 if passed else 0.0), details
