"""The model role's OpenAI front door, driven by the official `openai` SDK against a real model server.

One stack (`gymrpc up`) runs the model server with the scripted counter policy and
`--openai-port 0`; the test finds the front door by the model's stable name (the
`openai_url` label of its registry endpoint), as an agent does. The same conversation goes
through `ModelService.Generate` for the token ids to compare.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gymrpc import auth
from gymrpc.client import Client
from gymrpc.control import EpisodeKey
from gymrpc.controller import Controller
from gymrpc.messages import task_from_row
from gymrpc.v1 import common_pb2
from gymrpc.v1 import model_service_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
ROW = json.loads((ROOT / "envs/counter/data/example.jsonl").read_text().splitlines()[0])
TASK = task_from_row(ROW, "t0")
TOOLS = [
    {
        "type": "function",
        "function": {"name": t.name, "description": t.description, "parameters": json.loads(t.parameters_json_schema)},
    }
    for t in TASK.tools
]
USER = {"role": "user", "content": TASK.input[0].content}


def _config() -> dict[str, Any]:
    args = {"policy": "counter", "openai_port": 0}
    return {"servers": [{"name": "model/policy", "role": "model", "args": args}]}


async def _base_url(run_dir: Path) -> str:
    async with Client(run_dir=run_dir) as client:
        (endpoint,) = await client.registry.resolve("model/policy")
        return endpoint.labels["openai_url"]


async def _generate(run_dir: Path, messages: list[common_pb2.Message]) -> pb.GenerateResponse:
    async with Client(run_dir=run_dir) as client:
        request = pb.GenerateRequest(request_id="grpc-0", messages=messages, tools=TASK.tools)
        return await client.model("model/policy").Generate(request, timeout=30)


FrontDoor = tuple[Path, str, str]


@pytest.fixture
def front_door(start_stack: Any) -> tuple[Path, str, str]:
    """(run folder, front door URL, the stack token: the front door checks credentials as gRPC does)."""
    stack = start_stack(_config())
    return stack.run_dir, asyncio.run(_base_url(stack.run_dir)), auth.read_token_file(stack.run_dir / "token")


def test_chat_with_tools_returns_parsed_calls_and_the_token_ids_generate_gives(front_door: FrontDoor) -> None:
    run_dir, url, key = front_door

    async def scenario() -> None:
        async with openai.AsyncOpenAI(base_url=url, api_key=key) as client:
            models = await client.models.list()
            assert [m.id for m in models.data] == ["model/policy"]
            reply = await client.chat.completions.create(model="model/policy", messages=[USER], tools=TOOLS)
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls"
            calls = choice.message.tool_calls
            assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
                ("increment_counter", {"count": 1}),
                ("increment_counter", {"count": 2}),
            ]
            assert [c.id for c in calls] == ["call_0_0", "call_0_1"]
            extra = reply.model_extra or {}
            # The same conversation through ModelService.Generate: identical token ids.
            grpc_reply = await _generate(run_dir, list(TASK.input))
            assert extra["prompt_token_ids"] == list(grpc_reply.tokens.prompt_token_ids)
            assert (choice.model_extra or {})["token_ids"] == list(grpc_reply.tokens.completion_token_ids)
            assert reply.usage.prompt_tokens == len(grpc_reply.tokens.prompt_token_ids)
            assert extra["weight_version"] == grpc_reply.weight_version == "scripted:0"

            # Second turn: tool results go back; the template renders the first reply's exact ids.
            messages: list[Any] = [USER, choice.message.model_dump(exclude_none=True)]
            messages += [
                {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"count": 3 + 1 + k})}
                for k, c in enumerate(calls)
            ]
            second = await client.chat.completions.create(model="model/policy", messages=messages, tools=TOOLS)
            assert second.choices[0].message.tool_calls[0].function.name == "get_counter_value"
            prompt = (second.model_extra or {})["prompt_token_ids"]
            assert prompt[: len(extra["prompt_token_ids"])] == extra["prompt_token_ids"]

    asyncio.run(scenario())


def test_streaming_and_logprobs(front_door: FrontDoor) -> None:
    _run_dir, url, key = front_door
    calls = [("increment_counter", '{"count": 1}'), ("increment_counter", '{"count": 2}'), ("get_counter_value", "{}")]
    conversation: list[Any] = [
        USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": f"c{k}", "type": "function", "function": {"name": name, "arguments": arguments}}
                for k, (name, arguments) in enumerate(calls)
            ],
        },
        *({"role": "tool", "tool_call_id": f"c{k}", "content": json.dumps({"count": 4 + 2 * k})} for k in range(3)),
    ]

    async def scenario() -> None:
        async with openai.AsyncOpenAI(base_url=url, api_key=key) as client:
            plain = await client.chat.completions.create(
                model="m", messages=conversation, logprobs=True, top_logprobs=2
            )
            content = plain.choices[0].logprobs.content
            token_ids = (plain.choices[0].model_extra or {})["token_ids"]
            assert len(content) == len(token_ids) > 0
            assert all(entry.logprob == 0.0 for entry in content)  # the scripted backend's constant
            stream = await client.chat.completions.create(
                model="m", messages=conversation, stream=True, stream_options={"include_usage": True}, logprobs=True
            )
            text, ids, finish, usage = "", [], None, None
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    ids += (choice.model_extra or {}).get("token_ids") or []
                    finish = choice.finish_reason or finish
            assert text == plain.choices[0].message.content == "The current count is 8."
            assert ids == token_ids
            assert finish == "stop"
            assert usage is not None
            assert usage.completion_tokens == len(token_ids)

            # Streaming with tools: the parsed calls arrive as tool-call deltas.
            stream = await client.chat.completions.create(model="m", messages=[USER], tools=TOOLS, stream=True)
            names, finish = [], None
            async for chunk in stream:
                for choice in chunk.choices:
                    names += [c.function.name for c in choice.delta.tool_calls or ()]
                    finish = choice.finish_reason or finish
            assert names == ["increment_counter", "increment_counter"]
            assert finish == "tool_calls"

    asyncio.run(scenario())


def test_bad_requests_get_openai_error_bodies_and_are_not_retried(front_door: FrontDoor) -> None:
    _, url, key = front_door

    async def scenario() -> None:
        async with openai.AsyncOpenAI(base_url=url, api_key=key) as client:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model="m", messages=[])
            assert caught.value.status_code == 400
            assert caught.value.body["code"] == "invalid_request"
            assert caught.value.body["param"] == "messages"
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(
                    model="m", messages=[USER], temperature=9.0
                )  # the servicer's own check
            assert caught.value.body["param"] == "sampling.temperature"
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(
                    model="m", messages=[USER], extra_headers={"x-gymrpc-episode": "no-attempt"}
                )
            assert "x-gymrpc-episode" in caught.value.message
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}) as http:
            deep: Any = "x"
            for _ in range(200):
                deep = [deep]
            reply = await http.post(f"{url}/chat/completions", json={"model": "m", "messages": deep})
            assert reply.status_code == 400
            assert "nested deeper" in reply.json()["error"]["message"]
            reply = await http.post(f"{url}/chat/completions", content=b"{not json")
            assert reply.status_code == 400
            assert reply.headers["x-should-retry"] == "false"
            reply = await http.post(f"{url}/chat/completions", content=b" " * (9 * 1024 * 1024))
            assert reply.status_code == 413

    asyncio.run(scenario())


def test_responses_api_with_function_calls_and_outputs(front_door: FrontDoor) -> None:
    run_dir, url, key = front_door
    tools = [{"type": "function", **t["function"]} for t in TOOLS]

    async def scenario() -> None:
        async with openai.AsyncOpenAI(base_url=url, api_key=key) as client:
            first = await client.responses.create(model="m", input=USER["content"], tools=tools)
            calls = [item for item in first.output if item.type == "function_call"]
            assert [(c.name, c.call_id) for c in calls] == [
                ("increment_counter", "call_0_0"),
                ("increment_counter", "call_0_1"),
            ]
            grpc_reply = await _generate(run_dir, list(TASK.input))
            assert (first.model_extra or {})["prompt_token_ids"] == list(grpc_reply.tokens.prompt_token_ids)
            assert (first.model_extra or {})["token_ids"] == list(grpc_reply.tokens.completion_token_ids)
            items: list[Any] = [{"type": "message", "role": "user", "content": USER["content"]}]
            for k, call in enumerate(calls):
                items.append(
                    {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}
                )
                items.append(
                    {
                        "type": "function_call_output",
                        "call_id": call.call_id,
                        "output": json.dumps({"count": 4 + 2 * k}),
                    }
                )
            second = await client.responses.create(model="m", input=items, tools=tools)
            assert [i.name for i in second.output if i.type == "function_call"] == ["get_counter_value"]
            items.append({"type": "function_call", "call_id": "c9", "name": "get_counter_value", "arguments": "{}"})
            items.append({"type": "function_call_output", "call_id": "c9", "output": '{"count": 6}'})
            stream = await client.responses.create(model="m", input=items, tools=tools, stream=True)
            kinds, text, final = [], "", None
            async for event in stream:
                kinds.append(event.type)
                if event.type == "response.output_text.delta":
                    text += event.delta
                if event.type == "response.completed":
                    final = event.response
            assert kinds[0] == "response.created"
            assert kinds[-1] == "response.completed"
            assert text == "The current count is 6."
            assert final is not None
            assert final.output_text == text
            assert final.status == "completed"
            with pytest.raises(openai.BadRequestError):
                await client.responses.create(model="m", input=[{"type": "image", "url": "x"}])

    asyncio.run(scenario())


def test_episode_calls_are_captured_and_retire_frees_their_record(front_door: FrontDoor) -> None:
    run_dir, url, key = front_door
    stats_url = f"{url[: -len('/v1')]}/gymrpc/stats"

    async def scenario() -> None:
        async with Client(run_dir=run_dir) as client, openai.AsyncOpenAI(base_url=url, api_key=key) as model:
            controller = Controller(client)

            async def ledger_rows() -> int:
                return (await controller.status())["model/policy"].report.counts["ledger_rows"]

            before = await ledger_rows()
            await model.chat.completions.create(model="m", messages=[USER], tools=TOOLS)  # no episode
            assert await ledger_rows() == before
            headers = {"x-gymrpc-episode": "cap-1/0", "x-gymrpc-run": "run-1"}
            reply = await model.chat.completions.create(model="m", messages=[USER], tools=TOOLS, extra_headers=headers)
            assert (reply.model_extra or {})["gymrpc"] == {"episode": "cap-1/a0", "position": 0, "replayed": False}
            assert await ledger_rows() == before + 1
            # The episode in the body's metadata works as the header does.
            await model.chat.completions.create(
                model="m", messages=[USER], tools=TOOLS, metadata={"gymrpc_episode": "cap-2/0"}
            )
            assert await ledger_rows() == before + 2
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}) as http:
                assert (await http.get(stats_url, params={"episode": "cap-1/0"})).json()["recorded"] == 1
                await controller.retire("retire-1", [EpisodeKey("cap-1", 0)])
                assert (await http.get(stats_url, params={"episode": "cap-1/0"})).json()["recorded"] == 0
            with pytest.raises(openai.ConflictError) as caught:  # the retired attempt is fenced
                await model.chat.completions.create(model="m", messages=[USER], extra_headers=headers)
            assert caught.value.body["code"] == "stale_attempt"
            await controller.forget("forget-1", ["cap-1"])

    asyncio.run(scenario())


def test_a_streamed_call_is_replayed_as_a_stream_with_the_same_tokens(front_door: FrontDoor) -> None:
    _, url, key = front_door
    conversation: list[Any] = [USER]

    async def streamed(client: openai.AsyncOpenAI, run_id: str) -> tuple[str, list[int], list[Any]]:
        headers = {"x-gymrpc-episode": "stream-1/0", "x-gymrpc-run": run_id}
        stream = await client.chat.completions.create(
            model="m", messages=conversation, tools=TOOLS, stream=True, extra_headers=headers
        )
        ids, calls, replayed = [], [], []
        async for chunk in stream:
            replayed.append((chunk.model_extra or {}).get("gymrpc", {}).get("replayed"))
            for choice in chunk.choices:
                ids += (choice.model_extra or {}).get("token_ids") or []
                calls += [(c.id, c.function.name, c.function.arguments) for c in choice.delta.tool_calls or ()]
        return str(replayed[0]), ids, calls

    async def scenario() -> None:
        async with openai.AsyncOpenAI(base_url=url, api_key=key) as client:
            live = await streamed(client, "run-1")
            again = await streamed(client, "run-2")
        assert live[0] == "False"
        assert again[0] == "True"
        assert again[1:] == live[1:]
        assert len(live[2]) == 2

    asyncio.run(scenario())


def test_the_front_door_needs_a_credential_as_model_service_does(front_door: FrontDoor) -> None:
    run_dir, url, _key = front_door
    agent_key = auth.read_token_file(run_dir / "agent.token")

    trainer_key = auth.read_token_file(run_dir / "trainer.token")

    async def scenario() -> None:
        async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError):
                await client.models.list()
            with pytest.raises(openai.AuthenticationError):
                await client.chat.completions.create(model="m", messages=[USER])
        async with openai.AsyncOpenAI(base_url=url, api_key=trainer_key, max_retries=0) as client:
            with pytest.raises(openai.PermissionDeniedError):  # a trainer calls agents, not the model
                await client.chat.completions.create(model="m", messages=[USER])
        async with openai.AsyncOpenAI(base_url=url, api_key=agent_key) as client:  # an agent may call the model
            assert [m.id for m in (await client.models.list()).data]

    asyncio.run(scenario())
