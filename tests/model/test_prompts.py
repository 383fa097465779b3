"""Incremental prompts: reused piece tokens give exactly the full render, only byte-identical pieces are reused,
and the model server's `--no-incremental-prompts` turns them off (the baseline of bench/episodes.py)."""

from __future__ import annotations

from gymrpc.chat import ChatTemplate, default_tokenizer
from gymrpc.launch.options import server_argv
from gymrpc.servers.model.__main__ import build_parser
from gymrpc.servers.model.backends.scripted import ScriptedBackend
from gymrpc.servers.model.backends.sources import CounterSolver
from gymrpc.servers.model.prompts import PromptTokenizer
from gymrpc.servers.model.service import ModelServicer

TOOLS = [{"name": "lookup", "description": "Look a record up. " * 8, "parameters": {"type": "object"}}]


def _conversation(turns: int, edit: str = "") -> list[dict[str, object]]:
    messages: list[dict[str, object]] = [
        {"role": "system", "content": "You are a careful assistant for the workplace tools. " * 6},
        {"role": "user", "content": "Find the customer and update their status, then report back. " * 3 + edit},
    ]
    for turn in range(turns):
        messages.append({"role": "assistant", "content": f"Looking up step {turn}. " * 10})
        messages.append({"role": "tool", "content": f'{{"rows": [{turn}], "note": "' + "x" * 200 + '"}'})
    return messages


def test_growing_conversation_reuses_its_prefix_and_renders_exactly_as_from_scratch() -> None:
    tokenizer = default_tokenizer()
    plain, incremental = ChatTemplate(tokenizer), PromptTokenizer(tokenizer)
    template = ChatTemplate(incremental)  # type: ignore[arg-type]
    for turns in range(6):
        messages = _conversation(turns)
        assert template.render(messages, TOOLS) == plain.render(messages, TOOLS), turns
    assert incremental.hits > incremental.misses, "later calls reuse the pieces of earlier ones"


def test_an_edited_earlier_turn_is_tokenised_again() -> None:
    tokenizer = default_tokenizer()
    incremental = PromptTokenizer(tokenizer)
    template, plain = ChatTemplate(incremental), ChatTemplate(tokenizer)  # type: ignore[arg-type]
    template.render(_conversation(3), TOOLS)
    misses = incremental.misses
    edited = _conversation(3, edit="Also call them.")
    assert template.render(edited, TOOLS) == plain.render(edited, TOOLS)
    assert incremental.misses == misses + 1, "only the changed piece was tokenised"


def test_the_memory_is_bounded() -> None:
    incremental = PromptTokenizer(default_tokenizer(), max_chars=10_000)
    for i in range(200):
        incremental.encode(f"piece {i} " * 20)
    assert incremental._chars <= 10_000


def test_the_model_server_switch_turns_incremental_prompts_off_with_the_same_render() -> None:
    parser = build_parser()
    assert parser.parse_args(["--policy", "counter"]).incremental_prompts is True
    assert parser.parse_args(["--policy", "counter", "--no-incremental-prompts"]).incremental_prompts is False
    off = ["--no-incremental-prompts"]
    module = "gymrpc.servers.model"
    assert server_argv("model/m", module, {"policy": ["counter"], "incremental_prompts": False})[-1:] == off
    assert server_argv("model/m", module, {"policy": ["counter"], "no_incremental_prompts": True})[-1:] == off

    tokenizer = default_tokenizer()
    servers = {
        on: ModelServicer(ScriptedBackend(tokenizer, [CounterSolver()]), tokenizer, incremental_prompts=on)
        for on in (True, False)
    }
    assert isinstance(servers[True].prompts, PromptTokenizer)
    assert servers[True].template.tokenizer is servers[True].prompts
    assert servers[False].prompts is None
    assert servers[False].template.tokenizer is tokenizer
    for turns in range(3):
        messages = _conversation(turns)
        assert servers[True].template.render(messages, TOOLS) == servers[False].template.render(messages, TOOLS)
