"""In-process stand-ins for downstream stubs, so loop and service tests need no sockets.

`DirectStub` calls a real servicer's methods directly (the real resources server logic
with the real environments); `ScriptedModel` is a FAKE model replaying canned replies.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gymrpc.envs.blackjack import BlackjackEnvironment
from gymrpc.envs.counter import CounterEnvironment, example_tasks_path
from gymrpc.messages import task_from_row
from gymrpc.servers.resources.service import ResourcesServicer
from gymrpc.v1 import common_pb2
from gymrpc.v1 import model_service_pb2 as model_pb
from gymrpc.v1 import resources_service_pb2 as resources_pb
from tests.agent.fake_model import FakeModelServicer

ASSISTANT, USER, TOOL = common_pb2.ROLE_ASSISTANT, common_pb2.ROLE_USER, common_pb2.ROLE_TOOL


class DirectStub:
    """Looks like a generated stub; forwards `await stub.Method(request, timeout=...)` to a servicer."""

    def __init__(self, servicer: Any) -> None:
        self.servicer = servicer
        self.calls: list[tuple[str, Any]] = []

    def __getattr__(self, method: str) -> Callable[..., Any]:
        impl = getattr(self.servicer, method)

        async def call(request: Any, *, timeout: float | None = None) -> Any:
            self.calls.append((method, request))
            return await impl(request, None)

        return call

    def methods(self) -> list[str]:
        return [name for name, _ in self.calls]


def counter_resources() -> DirectStub:
    return DirectStub(ResourcesServicer(CounterEnvironment(), workers=2))


def blackjack_resources() -> DirectStub:
    return DirectStub(ResourcesServicer(BlackjackEnvironment(), workers=2))


def fake_model() -> DirectStub:
    """The scripted FAKE model of `tests.agent.fake_model`, called in-process."""
    return DirectStub(FakeModelServicer())


def reply(
    content: str = "",
    *,
    calls: Sequence[tuple[str, str, str]] = (),
    finish: int = common_pb2.FINISH_REASON_STOP,
    reasoning: str = "",
) -> model_pb.GenerateResponse:
    """A canned model reply; `calls` are (id, name, arguments_json)."""
    message = common_pb2.Message(role=ASSISTANT, content=content, reasoning_content=reasoning)
    for call_id, name, arguments in calls:
        message.tool_calls.add(id=call_id, name=name, arguments_json=arguments)
    return model_pb.GenerateResponse(
        message=message,
        finish_reason=finish,
        weight_version="scripted:1",
        tokens=common_pb2.TokenTrace(
            prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5], completion_logprobs=[-0.5, -0.25]
        ),
        usage=common_pb2.Usage(input_tokens=3, output_tokens=2),
    )


class ScriptedModel:
    """FAKE model stub: returns `replies` in order (the last one forever); records requests."""

    def __init__(self, *replies: model_pb.GenerateResponse, delay: float = 0.0) -> None:
        self.replies, self.delay = list(replies), delay
        self.requests: list[model_pb.GenerateRequest] = []

    async def Generate(self, request: model_pb.GenerateRequest, *, timeout: float | None = None) -> Any:
        self.requests.append(request)
        if self.delay:
            await asyncio.sleep(self.delay)
        return self.replies[min(len(self.requests) - 1, len(self.replies) - 1)]


class EndlessTextEnv:
    """FAKE text-turn resources stub whose game never ends unless `truncate_at` turns were played."""

    def __init__(self, truncate_at: int | None = None) -> None:
        self.truncate_at, self.turns = truncate_at, 0
        self.closed = False

    async def SeedSession(self, request: Any, *, timeout: float | None = None) -> Any:
        return resources_pb.SeedSessionResponse(observations=[common_pb2.Message(content="your move")])

    async def Step(self, request: resources_pb.StepRequest, *, timeout: float | None = None) -> Any:
        self.turns += 1
        truncated = self.truncate_at is not None and self.turns >= self.truncate_at
        return resources_pb.StepResponse(
            observations=[] if truncated else [common_pb2.Message(role=USER, content=f"turn {self.turns} played")],
            truncated=truncated,
        )

    async def Verify(self, request: Any, *, timeout: float | None = None) -> Any:
        return resources_pb.VerifyResponse(reward=0.5, details_json="{}")

    async def CloseSession(self, request: Any, *, timeout: float | None = None) -> Any:
        self.closed = True
        return resources_pb.CloseSessionResponse()


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def counter_tasks() -> list[common_pb2.Task]:
    return [task_from_row(row, str(i)) for i, row in enumerate(rows(example_tasks_path()))]


def blackjack_tasks(seed: int | None = None) -> list[common_pb2.Task]:
    from gymrpc.envs.blackjack import example_tasks_path as blackjack_path

    tasks = [task_from_row(row, str(i)) for i, row in enumerate(rows(blackjack_path()))]
    if seed is not None:
        for i, task in enumerate(tasks):
            task.env_json = json.dumps({"seed": seed + i})
    return tasks


def counter_task(text: str, initial: int, expected: int, task_id: str = "t") -> common_pb2.Task:
    """A counter task like the example rows, with its own text (for `[fake:...]` markers)."""
    task = counter_tasks()[0]
    task.task_id = task_id
    del task.input[:]
    task.input.add(role=USER, content=text)
    task.env_json = json.dumps({"initial_count": initial, "expected_count": expected})
    return task
