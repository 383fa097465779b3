"""The agent over real gRPC: registry, resources (counter, blackjack), FAKE model, agents, one loop.

Every server is started in-process with `gymrpc.servers.bootstrap.start_server` and registers
under its stable name; the test reaches the agents through `gymrpc.Client`, and the
agents reach resources and model through their own `gymrpc.Client`, exactly as
`python -m gymrpc.servers.agent` does. (`test_process.py` runs the same stack as processes.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gymrpc import auth
from gymrpc.client import Client
from gymrpc.envkit import Environment
from gymrpc.envs.blackjack import BlackjackEnvironment
from gymrpc.envs.counter import CounterEnvironment
from gymrpc.errors import InvalidArgument
from gymrpc.servers.agent.service import AgentConfig, AgentServicer
from gymrpc.servers.bootstrap import RunningServer, ServerConfig, ServiceBinding, start_server
from gymrpc.servers.registry.service import CONTROL_METHODS, RegistryServicer
from gymrpc.servers.resources.service import ResourcesServicer
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import agent_service_pb2_grpc as agent_grpc
from gymrpc.v1 import common_pb2
from gymrpc.v1 import model_service_pb2 as model_pb
from gymrpc.v1 import model_service_pb2_grpc as model_grpc
from gymrpc.v1 import registry_service_pb2 as registry_pb
from gymrpc.v1 import registry_service_pb2_grpc as registry_grpc
from gymrpc.v1 import resources_service_pb2 as resources_pb
from gymrpc.v1 import resources_service_pb2_grpc as resources_grpc
from tests.agent.fake_model import FakeModelServicer
from tests.agent.fakes import blackjack_tasks, counter_task, counter_tasks

TOOL = common_pb2.ROLE_TOOL


def _resources(environment: Environment) -> ServiceBinding:
    return ServiceBinding(
        resources_pb.DESCRIPTOR.services_by_name["ResourcesService"],
        ResourcesServicer(environment),
        resources_grpc.add_ResourcesServiceServicer_to_server,
    )


@contextlib.asynccontextmanager
async def stack() -> AsyncIterator[Client]:
    """Registry, resources/{counter,blackjack}, model/policy (FAKE), agent/simple, agent/blackjack."""
    token = auth.new_token()
    registry_servicer = RegistryServicer()
    registry_servicer.start()
    servers: list[RunningServer] = []
    clients: list[Client] = []
    try:
        registry = await start_server(
            ServerConfig(name="registry/main", token=token),
            [
                ServiceBinding(
                    registry_pb.DESCRIPTOR.services_by_name["RegistryService"],
                    registry_servicer,
                    registry_grpc.add_RegistryServiceServicer_to_server,
                    CONTROL_METHODS,
                )
            ],
        )
        servers.append(registry)

        async def serve(name: str, binding: ServiceBinding) -> None:
            config = ServerConfig(name=name, registry=registry.address, token=token, grace=0.5)
            servers.append(await start_server(config, [binding]))

        await serve("resources/counter", _resources(CounterEnvironment()))
        await serve("resources/blackjack", _resources(BlackjackEnvironment()))
        await serve(
            "model/policy",
            ServiceBinding(
                model_pb.DESCRIPTOR.services_by_name["ModelService"],
                FakeModelServicer(),
                model_grpc.add_ModelServiceServicer_to_server,
            ),
        )
        downstream = Client(registry=registry.address, token=token)
        clients.append(downstream)
        for name, resources in (
            ("agent/simple", "resources/counter"),
            ("agent/blackjack", "resources/blackjack"),
        ):
            config = AgentConfig(resources_name=resources, model_name="model/policy", max_steps=8)
            servicer = AgentServicer(config, downstream.resources(resources), downstream.model("model/policy"))
            await serve(
                name,
                ServiceBinding(
                    agent_pb.DESCRIPTOR.services_by_name["AgentService"],
                    servicer,
                    agent_grpc.add_AgentServiceServicer_to_server,
                ),
            )
        client = Client(registry=registry.address, token=token)
        clients.append(client)
        yield client
    finally:
        for c in clients:
            await c.close()
        for server in reversed(servers):
            await server.stop(0.2)
        await registry_servicer.stop()


def _request(task: common_pb2.Task, rollout_id: str = "", **options: Any) -> agent_pb.RunRequest:
    return agent_pb.RunRequest(
        task=task,
        episode_id=common_pb2.EpisodeId(rollout_id=rollout_id),
        options=agent_pb.RunOptions(**options),
    )


def test_counter_examples_earn_reward_one() -> None:
    async def scenario() -> list[agent_pb.Trajectory]:
        async with stack() as client:
            agent = client.agent("agent/simple")
            replies = [
                await agent.Run(_request(task, f"counter-{i}"), timeout=10) for i, task in enumerate(counter_tasks())
            ]
            return [r.trajectory for r in replies]

    trajectories = asyncio.run(scenario())
    assert [t.reward for t in trajectories] == [1.0] * 5
    for i, t in enumerate(trajectories):
        assert (t.episode_id.rollout_id, t.task_id) == (f"counter-{i}", str(i))
        assert (t.stop_reason, t.steps, len(t.tool_calls)) == (agent_pb.STOP_REASON_FINAL_ANSWER, 4, 3)
        assert len(t.model_calls) == 4
        assert all(c.tokens.completion_token_ids for c in t.model_calls)
        assert t.timing.total.ToNanoseconds() > 0


def test_blackjack_examples_end_to_end_with_streaming() -> None:
    async def scenario() -> tuple[list[agent_pb.Trajectory], list[agent_pb.RunStreamResponse]]:
        async with stack() as client:
            agent = client.agent("agent/blackjack")
            tasks = blackjack_tasks()
            replies = await asyncio.gather(*(agent.Run(_request(t), timeout=10) for t in tasks))
            request = agent_pb.RunStreamRequest(request=_request(blackjack_tasks(seed=3)[0], "bj-stream"))
            events = await _stream(client, "agent/blackjack", request)
            return [r.trajectory for r in replies], events

    trajectories, events = asyncio.run(scenario())
    for t in trajectories:
        assert t.reward in (-1.0, 0.0, 1.0)
        assert t.messages[2].content.startswith("Your hand:")
        assert t.stop_reason == agent_pb.STOP_REASON_FINAL_ANSWER
        assert json.loads(t.verify_details_json)["result"] in ("win", "loss", "draw", "push")
    assert [e.WhichOneof("event") for e in events] == ["progress"] * 4 + ["trajectory"]
    assert [e.progress.phase for e in events[:-1]] == [
        agent_pb.EPISODE_PHASE_READY_FOR_MODEL,
        agent_pb.EPISODE_PHASE_READY_FOR_TOOL,
        agent_pb.EPISODE_PHASE_READY_FOR_VERIFY,
        agent_pb.EPISODE_PHASE_COMPLETED,
    ]
    assert events[-1].trajectory.episode_id.rollout_id == "bj-stream"


async def _stream(client: Client, name: str, request: agent_pb.RunStreamRequest) -> list[agent_pb.RunStreamResponse]:
    return [event async for event in client.agent(name).RunStream(request, timeout=10)]


def test_client_run_stream() -> None:
    async def scenario() -> list[str]:
        async with stack() as client:
            request = agent_pb.RunStreamRequest(request=_request(counter_tasks()[0]))
            return [e.WhichOneof("event") async for e in client.agent("agent/simple").RunStream(request, timeout=10)]

    assert asyncio.run(scenario())[-1] == "trajectory"


def test_bad_input_is_invalid_argument_and_model_mistakes_are_tool_errors() -> None:
    lacking = counter_tasks()[0]
    lacking.env_json = json.dumps({"initial_count": 3})

    async def scenario() -> tuple[list[InvalidArgument], agent_pb.Trajectory]:
        async with stack() as client:
            agent = client.agent("agent/simple")
            errors = []
            for request in (_request(lacking), _request(counter_tasks()[0], "bad/id"), agent_pb.RunRequest()):
                with pytest.raises(InvalidArgument) as caught:
                    await agent.Run(request, timeout=10)
                errors.append(caught.value)
            task = counter_task("[fake:unknown-tool] [fake:bad-args] add 2 then add 3 then get the count", 1, 6)
            reply = await agent.Run(_request(task, "mistakes"), timeout=10)
            return errors, reply.trajectory

    errors, t = asyncio.run(scenario())
    assert errors[0].message.startswith("resources/counter SeedSession: task rejected by counter")
    assert "'expected_count'" in errors[0].message
    assert "episode_id.rollout_id 'bad/id' is invalid" in errors[1].message
    assert errors[2].message == "task is required"
    assert [(r.call.name, r.is_error) for r in t.tool_calls[:2]] == [
        ("no_such_tool", True),
        ("increment_counter", True),
    ]
    assert "unknown tool" in t.tool_calls[0].output
    assert "not valid JSON" in t.tool_calls[1].output
    assert [m.content for m in t.messages if m.role == TOOL][:2] == [
        t.tool_calls[0].output,
        t.tool_calls[1].output,
    ]
    assert (t.reward, t.steps) == (1.0, 6)


def test_two_hundred_concurrent_counter_episodes() -> None:
    tasks = counter_tasks()

    async def scenario() -> tuple[list[Any], float]:
        async with stack() as client:
            agent = client.agent("agent/simple")
            started = time.monotonic()
            results = await asyncio.gather(
                *(agent.Run(_request(tasks[i % 5], f"many-{i}"), timeout=60) for i in range(200)),
                return_exceptions=True,
            )
            return results, time.monotonic() - started

    results, elapsed = asyncio.run(scenario())
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, failures[:3]
    assert [r.trajectory.reward for r in results] == [1.0] * 200
    assert len({r.trajectory.episode_id.rollout_id for r in results}) == 200
    assert elapsed < 30
