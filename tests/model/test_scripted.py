"""The scripted backend and its reply sources, driven through the servicer (no transport)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from gymrpc.chat import default_tokenizer
from gymrpc.errors import FailedPrecondition
from gymrpc.servers.model.backends.base import Conversation, Finish, Sampling
from gymrpc.servers.model.backends.scripted import ScriptedBackend
from gymrpc.servers.model.backends.sources import CounterSolver, RecordedRollouts, ScriptFile
from gymrpc.servers.model.service import ModelServicer
from gymrpc.v1 import common_pb2
from gymrpc.v1 import model_service_pb2 as pb


def _servicer(*sources: Any, **kwargs: Any) -> ModelServicer:
    tok = default_tokenizer()
    return ModelServicer(ScriptedBackend(tok, list(sources), **kwargs), tok)


def _generate(servicer: ModelServicer) -> Any:
    async def call(request: pb.GenerateRequest) -> pb.GenerateResponse:
        return await servicer.Generate(request, None)  # type: ignore[arg-type]

    return call


def _calls(reply: pb.GenerateResponse) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, json.loads(c.arguments_json)) for c in reply.message.tool_calls]


def test_counter_solver_wins_every_example_task(counter_rows: list[dict[str, Any]], play_counter: Any) -> None:
    async def main() -> None:
        servicer = _servicer(CounterSolver())
        for index, row in enumerate(counter_rows):
            episode = await play_counter(_generate(servicer), row, f"task{index}")
            assert episode.reward == 1.0, row
            numbers = [int(n) for n in row["responses_create_params"]["input"][0]["content"].split() if n.isdigit()]
            first, second, final = episode.replies
            assert _calls(first) == [("increment_counter", {"count": n}) for n in numbers]
            assert _calls(second) == [("get_counter_value", {})]
            assert final.message.content == f"The current count is {row['expected_count']}."
            assert [r.finish_reason for r in episode.replies] == [
                common_pb2.FINISH_REASON_TOOL_CALLS, common_pb2.FINISH_REASON_TOOL_CALLS,
                common_pb2.FINISH_REASON_STOP,
            ]  # fmt: skip
            assert [c.id for c in first.message.tool_calls] == [f"call_0_{k}" for k in range(len(numbers))]
            assert second.message.tool_calls[0].id == "call_1_0"
            for reply in episode.replies:
                trace = reply.tokens
                assert len(trace.completion_logprobs) == len(trace.completion_token_ids) > 0
                assert trace.completion_token_ids[-1] == default_tokenizer().im_end_id
                assert reply.weight_version == "scripted:0"
                assert reply.usage.input_tokens == len(trace.prompt_token_ids)
            for before, after in zip(episode.replies, episode.replies[1:], strict=False):
                prefix = list(before.tokens.prompt_token_ids) + list(before.tokens.completion_token_ids)
                assert list(after.tokens.prompt_token_ids[: len(prefix)]) == prefix

    asyncio.run(main())


def test_counter_solver_handles_subtraction_and_declines_other_tasks() -> None:
    tools = [{"type": "function", "function": {"name": "increment_counter"}}]
    solver = CounterSolver()
    text = solver.reply(Conversation([{"role": "user", "content": "add 3 then subtract 2"}], tools))
    assert text is not None
    assert '"count": -2' in text
    assert solver.reply(Conversation([{"role": "user", "content": "hello"}], tools)) is None
    other = [{"type": "function", "function": {"name": "send_email"}}]
    assert solver.reply(Conversation([{"role": "user", "content": "add 3"}], other)) is None


def test_recorded_counter_rollouts_replay_to_reward_one(
    counter_rows: list[dict[str, Any]], play_counter: Any, data_dir: Path
) -> None:
    recorded = data_dir / "counter" / "data" / "example_rollouts.jsonl"
    recordings = [json.loads(line) for line in recorded.read_text().splitlines()]

    async def main() -> None:
        servicer = _servicer(RecordedRollouts([recorded]))
        for index, row in enumerate(counter_rows):
            episode = await play_counter(_generate(servicer), row, f"replay{index}")
            assert episode.reward == 1.0
            opening = row["responses_create_params"]["input"][0]["content"]
            recording = next(r for r in recordings if r["responses_create_params"]["input"][0]["content"] == opening)
            output = recording["response"]["output"]
            expected_calls = [(o["name"], json.loads(o["arguments"])) for o in output if o["type"] == "function_call"]
            assert [c for r in episode.replies for c in _calls(r)] == expected_calls
            assert episode.replies[-1].message.content == output[-1]["content"][0]["text"]

    asyncio.run(main())


def test_recorded_blackjack_replays_the_rollout_with_the_same_hand(data_dir: Path) -> None:
    recorded = data_dir / "blackjack" / "data" / "example_rollouts.jsonl"
    rows = [json.loads(line) for line in recorded.read_text().splitlines()]
    source = RecordedRollouts([recorded])
    for row in rows:
        opening = [dict(role=m["role"], content=m["content"]) for m in row["responses_create_params"]["input"]]
        said = [o for o in row["response"]["output"] if o.get("role") == "assistant"]
        assert source.reply(Conversation(opening)) == said[0]["content"][0]["text"]
    assert source.reply(Conversation([{"role": "user", "content": "never recorded"}])) is None


def test_script_file_by_first_user_and_by_rollout(tmp_path: Path) -> None:
    script = tmp_path / "script.jsonl"
    lines = [
        {"first_user": "hi", "replies": ["Hello!", {"content": "Again?", "tool_calls": [
            {"name": "f", "arguments": {"x": 1}}]}]},
        {"rollout_id": "special", "turn": 0, "reply": "Just for you."},
    ]  # fmt: skip
    script.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    source = ScriptFile(script)
    user = [{"role": "user", "content": "hi"}]
    assert source.reply(Conversation(user)) == "Hello!"
    second = [*user, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "more"}]
    assert (
        source.reply(Conversation(second)) == 'Again?\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    )
    assert source.reply(Conversation(user, rollout_id="special")) == "Just for you."
    assert source.reply(Conversation([*second, {"role": "assistant", "content": "x"}])) is None


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{", "not valid JSON"),
        ('{"reply": "x"}', "needs a string 'first_user' or 'rollout_id'"),
        ('{"first_user": "a"}', "needs 'reply' or 'replies'"),
        ('{"first_user": "a", "turn": -1, "reply": "x"}', "non-negative"),
        ('{"first_user": "a", "reply": {"tool_calls": [{"arguments": {}}]}}', "needs a string 'name'"),
    ],
)
def test_bad_script_files_fail_at_load(tmp_path: Path, line: str, message: str) -> None:
    script = tmp_path / "bad.jsonl"
    script.write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        ScriptFile(script)


def test_no_reply_is_a_clear_failed_precondition_unless_a_fallback_is_set() -> None:
    backend = ScriptedBackend(default_tokenizer(), [CounterSolver()])
    with pytest.raises(FailedPrecondition, match="no scripted reply for turn 0"):
        backend.reply_text(Conversation([{"role": "user", "content": "tell me a joke"}]))
    backend.fallback = "I cannot help."
    assert backend.reply_text(Conversation([{"role": "user", "content": "tell me a joke"}])) == "I cannot help."


def test_max_tokens_cuts_with_length_and_stop_strings_cut_the_text() -> None:
    tok = default_tokenizer()
    backend = ScriptedBackend(tok, [], fallback="The current count is 6.")
    conversation = Conversation([{"role": "user", "content": "x"}])

    async def main() -> None:
        full = await backend.generate([1], Sampling(max_tokens=100), "a", conversation=conversation)
        assert full.finish is Finish.STOP
        assert tok.decode(full.token_ids) == "The current count is 6.<|im_end|>"
        cut = await backend.generate([1], Sampling(max_tokens=3), "b", conversation=conversation)
        assert cut.finish is Finish.LENGTH
        assert cut.token_ids == full.token_ids[:3]
        stopped = await backend.generate([1], Sampling(max_tokens=100, stop=(" is",)), "c", conversation=conversation)
        assert tok.decode(stopped.token_ids) == "The current count<|im_end|>"

    asyncio.run(main())


def test_abort_mid_stream_keeps_the_prefix() -> None:
    tok = default_tokenizer()
    backend = ScriptedBackend(tok, [], fallback="one two three four five six seven", token_delay=0.01)
    conversation = Conversation([{"role": "user", "content": "x"}])

    async def main() -> None:
        deltas = []
        async for delta in backend.stream([1], Sampling(max_tokens=100), "req", conversation=conversation):
            deltas.append(delta)
            if len(deltas) == 3:
                assert await backend.abort("req")
        assert deltas[-1].finish is Finish.ABORT
        assert [t for d in deltas for t in d.token_ids] == tok.encode("one two three four five six seven")[:3]
        assert not await backend.abort("req")  # finished: nothing to abort

    asyncio.run(main())
