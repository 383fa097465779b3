"""Where the scripted backend's replies come from: script files, recorded rollouts, a counter policy.

Every source answers one question: given the conversation so far, what does the
assistant say next (as template-format text), or None if it does not know. The
reply for turn k is the same on every call, so retries and resumed episodes see
the same tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from gymrpc.chat import assistant_body
from gymrpc.servers.model.backends.base import Conversation


class ReplySource(Protocol):
    def reply(self, conversation: Conversation) -> str | None: ...

    def describe(self) -> str: ...


def reply_text(reply: Any, where: str = "reply") -> str:
    """A reply given as template text (str) or as `{content, tool_calls, reasoning_content}`."""
    if isinstance(reply, str):
        return reply
    if not isinstance(reply, Mapping):
        raise ValueError(f"{where} must be a string or an object, got {type(reply).__name__}")
    calls = []
    for k, call in enumerate(reply.get("tool_calls") or ()):
        function = call.get("function", call) if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError(f"{where}.tool_calls[{k}] needs a string 'name'")
        arguments = function.get("arguments", {})
        calls.append(
            {
                "function": {
                    "name": function["name"],
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                }
            }
        )
    message = {
        "content": reply.get("content") or "",
        "reasoning_content": reply.get("reasoning_content") or "",
        "tool_calls": calls,
    }
    return assistant_body(message)


def _jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not valid JSON: {exc}") from None


class ScriptFile:
    """JSONL lines `{"first_user"|"rollout_id": ..., "turn": k, "reply": R}` or `{..., "replies": [R, ...]}`.

    A reply R is template text or an object with `content`, `tool_calls`
    (`[{"name", "arguments"}]`) and `reasoning_content`. Lines keyed by
    `rollout_id` win over lines keyed by the first user message.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._by_user: dict[tuple[str, int], str] = {}
        self._by_rollout: dict[tuple[str, int], str] = {}
        for number, row in _jsonl(self.path):
            where = f"{self.path}:{number}"
            if not isinstance(row, Mapping):
                raise ValueError(f"{where}: each line must be a JSON object")
            if isinstance(row.get("rollout_id"), str):
                table, key = self._by_rollout, row["rollout_id"]
            elif isinstance(row.get("first_user"), str):
                table, key = self._by_user, row["first_user"]
            else:
                raise ValueError(f"{where}: needs a string 'first_user' or 'rollout_id'")
            if "replies" in row:
                if not isinstance(row["replies"], list):
                    raise ValueError(f"{where}: 'replies' must be a list")
                for turn, reply in enumerate(row["replies"]):
                    table[(key, turn)] = reply_text(reply, f"{where} replies[{turn}]")
            elif "reply" in row:
                turn = row.get("turn", 0)
                if not isinstance(turn, int) or isinstance(turn, bool) or turn < 0:
                    raise ValueError(f"{where}: 'turn' must be a non-negative integer")
                table[(key, turn)] = reply_text(row["reply"], f"{where} reply")
            else:
                raise ValueError(f"{where}: needs 'reply' or 'replies'")

    def reply(self, conversation: Conversation) -> str | None:
        turn = conversation.assistant_turns()
        found = self._by_rollout.get((conversation.rollout_id, turn))
        return found if found is not None else self._by_user.get((conversation.first_user_text(), turn))

    def describe(self) -> str:
        return f"script {self.path}"


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return ""


class _Recording:
    """One recorded rollout: the user messages it saw and its assistant turns, as template text."""

    def __init__(self, row: Mapping[str, Any]) -> None:
        params = row.get("responses_create_params") or {}
        items = params.get("input") or []
        if isinstance(items, str):
            items = [{"role": "user", "content": items}]
        self.users = [_text(m.get("content")) for m in items if m.get("role") == "user"]
        self.turns: list[str] = []
        turn: dict[str, Any] | None = None
        for item in (row.get("response") or {}).get("output") or ():
            kind, role = item.get("type", "message"), item.get("role")
            if kind == "function_call" or (kind == "message" and role == "assistant") or kind == "reasoning":
                turn = turn or {"content": "", "reasoning_content": "", "tool_calls": []}
                if kind == "function_call":
                    turn["tool_calls"].append({"name": item.get("name", ""), "arguments": item.get("arguments", "{}")})
                elif kind == "reasoning":
                    turn["reasoning_content"] += "".join(_text(s.get("text")) for s in item.get("summary") or ())
                else:
                    turn["content"] += _text(item.get("content"))
                continue
            if turn is not None:  # a tool result or a user observation ends the assistant's turn
                self.turns.append(reply_text(turn))
                turn = None
            if kind == "message" and role == "user":
                self.users.append(_text(item.get("content")))
        if turn is not None:
            self.turns.append(reply_text(turn))


class RecordedRollouts:
    """Replays the reference's `example_rollouts.jsonl`: turn k of the rollout with the same opening.

    Among recordings that start with the same first user message, the first whose
    later user messages (for example blackjack's dealt hands) agree with the
    conversation so far is replayed; if none agrees, the first with that opening.
    """

    def __init__(self, paths: Sequence[str | Path]) -> None:
        self.paths = [Path(p) for p in paths]
        self._by_first: dict[str, list[_Recording]] = {}
        for path in self.paths:
            for number, row in _jsonl(path):
                if not isinstance(row, Mapping) or not isinstance(row.get("response"), Mapping):
                    raise ValueError(f"{path}:{number}: not a recorded rollout (no 'response' object)")
                recording = _Recording(row)
                if recording.users:
                    self._by_first.setdefault(recording.users[0], []).append(recording)

    def reply(self, conversation: Conversation) -> str | None:
        candidates = self._by_first.get(conversation.first_user_text(), [])
        users = [m.get("content") or "" for m in conversation.messages if m.get("role") == "user"]
        agreeing = [r for r in candidates if r.users[: len(users)] == users]
        turn = conversation.assistant_turns()
        for recording in agreeing or candidates[:1]:
            if turn < len(recording.turns):
                return recording.turns[turn]
        return None

    def describe(self) -> str:
        return "recorded " + ", ".join(str(p) for p in self.paths)


_STEP = re.compile(r"\b(add|plus|increment(?:\s+by)?|subtract|minus)\s+(-?\d+)", re.IGNORECASE)


class CounterSolver:
    """Plays the counter environment: `add 4 then add 5 then get the count` -> reward 1.

    Turn by turn, from the conversation alone: call `increment_counter` for every
    number not yet added (in one turn, as parallel calls), then `get_counter_value`,
    then answer with the count it returned. Needs the numbers as `add N` (or `plus`,
    `increment by`; `subtract`/`minus` N adds -N) in the first user message.
    """

    def reply(self, conversation: Conversation) -> str | None:
        steps = [
            -int(n) if op.lower() in ("subtract", "minus") else int(n)
            for op, n in _STEP.findall(conversation.first_user_text())
        ]
        names = conversation.tool_names()
        if not steps or (names and "increment_counter" not in names):
            return None
        calls = _calls_with_results(conversation.messages)
        added = sum(1 for name, _ in calls if name == "increment_counter")
        if added < len(steps):
            todo = [{"name": "increment_counter", "arguments": {"count": n}} for n in steps[added:]]
            return reply_text({"tool_calls": todo})
        reads = [result for name, result in calls if name == "get_counter_value"]
        if not reads:
            return reply_text({"tool_calls": [{"name": "get_counter_value", "arguments": {}}]})
        try:
            count = json.loads(reads[-1] or "")["count"]
        except (ValueError, TypeError, KeyError):
            return f"The counter tool answered: {reads[-1]}"
        return f"The current count is {count}."

    def describe(self) -> str:
        return "counter solver"


def _calls_with_results(messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, str | None]]:
    """(tool name, result text or None) for every call the assistant made, in order."""
    calls: list[tuple[str, str | None]] = []
    index: dict[str, int] = {}
    pending: list[int] = []  # calls of the latest assistant turn not yet answered, for id-less results
    for message in messages:
        role = message.get("role")
        if role == "assistant":
            pending = []
            for call in message.get("tool_calls") or ():
                function = call.get("function", call)
                index[call.get("id") or f"#{len(calls)}"] = len(calls)
                pending.append(len(calls))
                calls.append((function.get("name", ""), None))
        elif role == "tool":
            at = index.get(message.get("tool_call_id") or "")
            if at is None and pending:
                at = pending[0]
            if at is not None:
                calls[at] = (calls[at][0], message.get("content") or "")
                if at in pending:
                    pending.remove(at)
    return calls
