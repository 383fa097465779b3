"""Hermes-style tool-call parsing: completion text -> content, reasoning and tool calls.

The format is the one the chat template teaches (Qwen2.5 / hermes): each call is
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. Like vLLM's hermes
parser, a completion with any malformed call block is returned whole as content:
nothing the model wrote is dropped, nothing half-parsed is executed, and the text
re-renders exactly as generated. Call ids are made from a caller-given prefix, so a
retried request gets the same ids.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments_json: str
    """The arguments object exactly as the model wrote it (or the string it gave)."""


@dataclass(frozen=True)
class ParsedReply:
    content: str
    reasoning_content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()

    def to_message(self) -> dict[str, Any]:
        """The assistant message in the OpenAI chat shape the template renders."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
                for c in self.tool_calls
            ]
        return message


def parse_reply(text: str, *, id_prefix: str = "call") -> ParsedReply:
    """Split a completion (without its stop token) into reasoning, content and tool calls.

    Call k gets id `f"{id_prefix}_{k}"`. Never raises on model output.
    """
    reasoning, rest = _split_reasoning(text)
    blocks = list(_BLOCK.finditer(rest))
    if not blocks or rest.count(CALL_OPEN) != len(blocks) or rest.count(CALL_CLOSE) != len(blocks):
        return ParsedReply(content=rest, reasoning_content=reasoning)
    calls = []
    for k, block in enumerate(blocks):
        call = _parse_call(block.group(1), f"{id_prefix}_{k}")
        if call is None:
            return ParsedReply(content=rest, reasoning_content=reasoning)
        calls.append(call)
    content = rest[: blocks[0].start()]
    # The template writes one newline between content and the first call; it is not content.
    content = content.removesuffix("\n")
    gaps = [rest[a.end() : b.start()] for a, b in itertools.pairwise(blocks)]
    extra = "\n".join(g.strip() for g in (*gaps, rest[blocks[-1].end() :]) if g.strip())
    if extra:
        content = f"{content}\n{extra}" if content else extra
    return ParsedReply(content=content, reasoning_content=reasoning, tool_calls=tuple(calls))


def format_tool_call(name: str, arguments_json: str) -> str:
    """One call block as the template renders it (arguments verbatim)."""
    name_json = json.dumps(name, ensure_ascii=False)
    return f'{CALL_OPEN}\n{{"name": {name_json}, "arguments": {arguments_json}}}\n{CALL_CLOSE}'


def _split_reasoning(text: str) -> tuple[str, str]:
    if text.startswith(THINK_OPEN):
        end = text.find(THINK_CLOSE)
        if end >= 0:
            return text[len(THINK_OPEN) : end], text[end + len(THINK_CLOSE) :]
    return "", text


def _parse_call(body: str, call_id: str) -> ToolCall | None:
    fields = _object_fields(body.strip())
    if fields is None or "name" not in fields:
        return None
    name, _ = fields["name"]
    if not isinstance(name, str) or not name:
        return None
    if "arguments" not in fields:
        return ToolCall(call_id, name, "{}")
    value, raw = fields["arguments"]
    # A string is what OpenAI-style models sometimes emit: it already is the JSON text.
    return ToolCall(call_id, name, value if isinstance(value, str) else raw)


def _object_fields(text: str) -> dict[str, tuple[Any, str]] | None:
    """Top-level fields of a JSON object with the raw text of each value; None if not one object."""
    try:
        i = _skip(text, 0)
        if text[i] != "{":
            return None
        i = _skip(text, i + 1)
        fields: dict[str, tuple[Any, str]] = {}
        if text[i] == "}":
            return fields if not text[i + 1 :].strip() else None
        while True:
            key, i = _DECODER.raw_decode(text, i)
            i = _skip(text, i)
            if not isinstance(key, str) or text[i] != ":":
                return None
            start = _skip(text, i + 1)
            value, end = _DECODER.raw_decode(text, start)
            fields[key] = (value, text[start:end])
            i = _skip(text, end)
            if text[i] == ",":
                i = _skip(text, i + 1)
                continue
            if text[i] == "}" and not text[i + 1 :].strip():
                return fields
            return None
    except (ValueError, IndexError, RecursionError):
        return None


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i
