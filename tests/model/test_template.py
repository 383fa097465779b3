"""The chat template: Qwen2.5/hermes text format and prefix-stable token ids across turns."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from gymrpc.chat import ChatTemplate, CompletionMemory, assistant_body, default_tokenizer, parse_reply

COUNTER_TOOLS = [
    {"type": "function", "function": {"name": "increment_counter", "description": "",
     "parameters": {"type": "object", "properties": {"count": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "get_counter_value", "description": "", "parameters": {}}},
]  # fmt: skip

EXPECTED_TEXT = (
    "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\nYou may call one or more functions to "
    "assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML "
    'tags:\n<tools>\n{"type": "function", "function": {"name": "get_counter_value", "description": "", '
    '"parameters": {}}}\n</tools>\n\nFor each function call, return a json object with function name and '
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nhow much?<|im_end|>\n"
    '<|im_start|>assistant\nLet me look.\n<tool_call>\n{"name": "get_counter_value", "arguments": {}}\n'
    "</tool_call><|im_end|>\n"
    '<|im_start|>user\n<tool_response>\n{"count": 3}\n</tool_response><|im_end|>\n'
    "<|im_start|>assistant\n"
)


def _template(memory: CompletionMemory | None = None) -> ChatTemplate:
    return ChatTemplate(default_tokenizer(), memory=memory)


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_text_format_matches_qwen25_hermes() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "how much?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [_call("c0", "get_counter_value", "{}")],
        },
        {"role": "tool", "tool_call_id": "c0", "content": '{"count": 3}'},
    ]
    rendered = _template().render(messages, COUNTER_TOOLS[1:])
    assert rendered.text == EXPECTED_TEXT
    assert default_tokenizer().decode(rendered.token_ids) == EXPECTED_TEXT


def test_system_message_without_tools_and_developer_role() -> None:
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "developer", "content": "now in French"},
        {"role": "user", "content": "bye"},
    ]
    text = _template().render(messages, add_generation_prompt=False).text
    assert text == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>system\nnow in French<|im_end|>\n"
        "<|im_start|>user\nbye<|im_end|>\n"
    )


def test_consecutive_tool_results_share_one_user_turn() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [_call("a", "f", "{}"), _call("b", "g", "{}")]},
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
    ]
    text = _template().render(messages).text
    assert text.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


REPLIES = [
    '<tool_call>\n{"name": "increment_counter", "arguments": {"count": 4}}\n</tool_call>\n'
    '<tool_call>\n{"name": "increment_counter", "arguments": {"count": 5}}\n</tool_call>',
    'I will read it now.\n<tool_call>\n{"name": "get_counter_value", "arguments": {}}\n</tool_call>',
    "<think>\nThe tool said 12.\n</think>\n\nThe current count is 12. 🎉",
]
RESULTS = [['{"success": true}', '{"success": true}'], ['{"count": 12}'], []]


def _play(template: ChatTemplate, replies: list[str], remember: bool) -> list[tuple[list[int], list[int]]]:
    """Render, 'generate' each reply as its own token ids, append the parsed message and the tool results."""
    tok = template.tokenizer
    messages: list[dict[str, Any]] = [{"role": "user", "content": "add 4 then add 5 then get the count"}]
    calls = []
    for turn, (reply, results) in enumerate(zip(replies, RESULTS, strict=True)):
        prompt = template.render(messages, COUNTER_TOOLS).token_ids
        completion = [*tok.encode(reply), tok.im_end_id]
        calls.append((prompt, completion))
        message = parse_reply(reply, id_prefix=f"call_{turn}").to_message()
        if remember and template.memory is not None:
            template.memory.remember(prompt, message, completion)
        messages.append(message)
        for k, result in enumerate(results):
            messages.append({"role": "tool", "tool_call_id": f"call_{turn}_{k}", "content": result})
    return calls


def test_prompts_are_prefix_stable_across_turns() -> None:
    calls = _play(_template(), REPLIES, remember=False)
    for (prompt, completion), (next_prompt, _) in itertools.pairwise(calls):
        assert next_prompt[: len(prompt) + len(completion)] == prompt + completion


def test_canonical_replies_round_trip_through_parse() -> None:
    for reply in REPLIES:
        assert assistant_body(parse_reply(reply).to_message()) == reply


@pytest.mark.parametrize(
    "odd_reply",
    [
        '<tool_call>\n{"name":"increment_counter","arguments":{"count":4}}\n</tool_call>',  # compact JSON
        '<tool_call>{"name": "increment_counter", "arguments": {"count": 4}}</tool_call>\n\n',  # no newlines
        '\n<tool_call>\n{"name": "increment_counter", "arguments": "{\\"count\\": 4}"}\n</tool_call>',
    ],
)
def test_memory_keeps_non_canonical_replies_prefix_stable(odd_reply: str) -> None:
    replies = [odd_reply, REPLIES[1], REPLIES[2]]
    parsed = parse_reply(odd_reply)
    assert parsed.tool_calls, "the odd reply must still parse as a call"
    assert assistant_body(parsed.to_message()) != odd_reply  # so canonical re-rendering alone would differ

    without = _play(_template(), replies, remember=False)
    (p0, c0), (p1, _) = without[0], without[1]
    assert p1[: len(p0) + len(c0)] != p0 + c0

    memory = CompletionMemory()
    with_memory = _play(_template(memory), replies, remember=True)
    for (prompt, completion), (next_prompt, _) in itertools.pairwise(with_memory):
        assert next_prompt[: len(prompt) + len(completion)] == prompt + completion
    assert len(memory) == 3


def test_memory_is_keyed_by_prompt_and_bounded() -> None:
    memory = CompletionMemory(capacity=2)
    message = {"role": "assistant", "content": "x"}
    memory.remember([1, 2], message, [7, 2])
    assert memory.recall([1, 2], message) == (7, 2)
    assert memory.recall([1, 3], message) is None
    assert memory.recall([1, 2], {"role": "assistant", "content": "y"}) is None
    memory.remember([4], message, [8])
    memory.remember([5], message, [9])
    assert len(memory) == 2
    assert memory.recall([1, 2], message) is None


def test_tools_render_in_order_with_unicode_unescaped() -> None:
    tools = [{"type": "function", "function": {"name": "grüßen", "description": "sagt 'hallo' — laut",
                                               "parameters": {"b": 1, "a": 2}}}]  # fmt: skip
    text = _template().render([{"role": "user", "content": "x"}], tools).text
    line = json.dumps(tools[0], ensure_ascii=False)
    assert f"<tools>\n{line}\n</tools>" in text
    assert '"b": 1, "a": 2' in text  # key order as given, like jinja's tojson
