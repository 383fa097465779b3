"""The hermes tool-call parser: good calls, several calls, malformed blocks, never a crash."""

from __future__ import annotations

import json
import random

import pytest

from gymrpc.chat import ParsedReply, ToolCall, assistant_body, parse_reply


def _block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_one_call() -> None:
    reply = parse_reply(_block('{"name": "increment_counter", "arguments": {"count": 4}}'), id_prefix="call_0")
    assert reply == ParsedReply(content="", tool_calls=(ToolCall("call_0_0", "increment_counter", '{"count": 4}'),))


def test_several_calls_with_content_keep_order_and_ids() -> None:
    text = "Adding both.\n" + "\n".join(
        _block(json.dumps({"name": "increment_counter", "arguments": {"count": n}})) for n in (4, 5, -3)
    )
    reply = parse_reply(text, id_prefix="call_2")
    assert reply.content == "Adding both."
    assert [c.id for c in reply.tool_calls] == ["call_2_0", "call_2_1", "call_2_2"]
    assert [json.loads(c.arguments_json)["count"] for c in reply.tool_calls] == [4, 5, -3]


def test_arguments_are_kept_as_written() -> None:
    reply = parse_reply(_block('{ "name" : "f" , "arguments" : {"b":1,  "a": [1, 2]} }'))
    assert reply.tool_calls[0].arguments_json == '{"b":1,  "a": [1, 2]}'


def test_string_arguments_and_missing_arguments() -> None:
    reply = parse_reply(_block('{"name": "f", "arguments": "{\\"x\\": 1}"}') + "\n" + _block('{"name": "g"}'))
    assert [(c.name, c.arguments_json) for c in reply.tool_calls] == [("f", '{"x": 1}'), ("g", "{}")]


def test_non_object_arguments_reach_the_environment() -> None:
    reply = parse_reply(_block('{"name": "f", "arguments": [1, 2]}'))
    assert reply.tool_calls[0].arguments_json == "[1, 2]"


def test_reasoning_is_split_off() -> None:
    reply = parse_reply("<think>add them</think>Done.")
    assert (reply.reasoning_content, reply.content, reply.tool_calls) == ("add them", "Done.", ())


def test_plain_text_is_content() -> None:
    assert parse_reply("The current count is 6.") == ParsedReply(content="The current count is 6.")


@pytest.mark.parametrize(
    "text",
    [
        _block('{"name": "f", "arguments": {"count": 4}'),  # unbalanced JSON
        _block("not json at all"),
        _block('{"arguments": {}}'),  # no name
        _block('{"name": "", "arguments": {}}'),
        _block('{"name": 7, "arguments": {}}'),
        _block('["f", {}]'),
        _block('{"name": "f", "arguments": {}} trailing'),
        _block('{"name": "f", "arguments": {}}') + "\n<tool_call>\n{",  # second block never closed
        "<tool_call>\n" + '{"name": "f", "arguments": {}}',  # unclosed
        '{"name": "f", "arguments": {}}\n</tool_call>',  # close without open
        _block('{"name": "f", "arguments": {}}') + "\n" + _block("{oops}"),  # one bad block spoils all
    ],
)
def test_malformed_calls_stay_in_content(text: str) -> None:
    reply = parse_reply(text)
    assert reply.tool_calls == ()
    assert reply.content == text


def test_text_after_calls_is_kept() -> None:
    reply = parse_reply(_block('{"name": "f", "arguments": {}}') + "\nThat is all.")
    assert reply.content == "That is all."
    assert len(reply.tool_calls) == 1


def test_round_trip_of_canonical_messages() -> None:
    message = {
        "role": "assistant",
        "content": "Sure.\n",
        "reasoning_content": "plan",
        "tool_calls": [
            {"function": {"name": "f", "arguments": '{"a": "ü"}'}},
            {"function": {"name": "g", "arguments": "{}"}},
        ],
    }
    reply = parse_reply(assistant_body(message))
    assert (reply.content, reply.reasoning_content) == ("Sure.\n", "plan")
    assert [(c.name, c.arguments_json) for c in reply.tool_calls] == [("f", '{"a": "ü"}'), ("g", "{}")]


def test_never_raises_on_garbage() -> None:
    rng = random.Random(7)
    alphabet = ['<tool_call>', '</tool_call>', '<think>', '</think>', '{', '}', '"name"', ':', ',', '"f"',
                '"arguments"', '[', ']', '\n', ' ', 'x', '\\', '"', '1e999', 'null']  # fmt: skip
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        reply = parse_reply(text)
        assert isinstance(reply, ParsedReply)
        for call in reply.tool_calls:
            assert call.name
    deep = _block('{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert isinstance(parse_reply(deep), ParsedReply)
