"""Fixtures for the model server tests: example data, an episode driver, an in-process gRPC server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from gymrpc.channels import insecure_channel, service_channel_options
from gymrpc.envs.counter import CounterEnvironment
from gymrpc.messages import messages_to_dicts, task_from_row, task_spec
from gymrpc.servers.bootstrap import ServerConfig, ServiceBinding, start_server
from gymrpc.servers.model.service import ModelServicer
from gymrpc.v1 import common_pb2
from gymrpc.v1 import model_service_pb2 as pb
from gymrpc.v1 import model_service_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def counter_rows() -> list[dict[str, Any]]:
    return _rows(ROOT / "envs" / "counter" / "data" / "example.jsonl")


@pytest.fixture
def data_dir() -> Path:
    return ROOT / "envs"


class Episode:
    """The result of `play_counter`: the reward and every model reply, in order."""

    def __init__(self, reward: float, replies: list[pb.GenerateResponse], messages: list[common_pb2.Message]):
        self.reward, self.replies, self.messages = reward, replies, messages


@pytest.fixture
def play_counter() -> Callable[..., Any]:
    """`await play_counter(generate, row)`: a minimal agent loop on a real counter session."""

    async def play(generate: Callable[..., Any], row: dict[str, Any], rollout_id: str = "r0") -> Episode:
        task = task_from_row(row, "0")
        session, _ = CounterEnvironment().seed(task_spec(task))
        messages = list(task.input)
        replies = []
        for step in range(10):
            request = pb.GenerateRequest(
                request_id=f"{rollout_id}/a0/step{step}",
                episode_id=common_pb2.EpisodeId(rollout_id=rollout_id),
                messages=messages,
                tools=task.tools,
            )
            reply = await generate(request)
            replies.append(reply)
            messages.append(reply.message)
            if not reply.message.tool_calls:
                break
            for call in reply.message.tool_calls:
                result = session.call_tool(call.name, json.loads(call.arguments_json))
                messages.append(
                    common_pb2.Message(
                        role=common_pb2.ROLE_TOOL, content=result.output, tool_call_id=call.id, name=call.name
                    )
                )
        return Episode(session.verify(messages_to_dicts(messages)).reward, replies, messages)

    return play


@asynccontextmanager
async def _serve(servicer: ModelServicer) -> AsyncIterator[pb_grpc.ModelServiceStub]:
    binding = ServiceBinding(
        pb.DESCRIPTOR.services_by_name["ModelService"], servicer, pb_grpc.add_ModelServiceServicer_to_server
    )
    running = await start_server(ServerConfig(name="model/test", token="t"), [binding])
    try:
        async with insecure_channel(running.address, service_channel_options(), token="t") as channel:
            yield pb_grpc.ModelServiceStub(channel)
    finally:
        await running.stop(0)
        await servicer.close()


@pytest.fixture
def serve_model() -> Callable[[ModelServicer], Any]:
    """`async with serve_model(servicer) as stub:` a real grpc.aio server on 127.0.0.1:0."""
    return _serve
