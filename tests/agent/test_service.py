"""AgentServicer without sockets: validation, identity, deadlines, the per-episode lease, streaming."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any

import pytest

from gymrpc.errors import Aborted, DeadlineExceeded, GymrpcError, InvalidArgument
from gymrpc.pbtime import duration
from gymrpc.servers.agent.service import AgentConfig, AgentServicer
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2
from tests.agent.fakes import (
    ScriptedModel,
    blackjack_resources,
    blackjack_tasks,
    counter_resources,
    counter_tasks,
    fake_model,
    reply,
)

CONFIG = AgentConfig(resources_name="resources/counter", model_name="model/policy", max_steps=8, max_steps_limit=50)


def _servicer(resources: Any = None, model: Any = None, config: AgentConfig = CONFIG) -> AgentServicer:
    return AgentServicer(config, resources or counter_resources(), model or fake_model())


def _request(task: common_pb2.Task | None = None, rollout_id: str = "", **options: Any) -> agent_pb.RunRequest:
    request = agent_pb.RunRequest(task=task or counter_tasks()[0], options=agent_pb.RunOptions(**options))
    if rollout_id:
        request.episode_id.rollout_id = rollout_id
    return request


def _run(servicer: AgentServicer, request: agent_pb.RunRequest) -> agent_pb.Trajectory:
    return asyncio.run(servicer.Run(request, None)).trajectory  # type: ignore[arg-type]


def _no_task() -> agent_pb.RunRequest:
    return agent_pb.RunRequest()


def _empty_input() -> agent_pb.RunRequest:
    request = _request()
    del request.task.input[:]
    return request


def _bad_role() -> agent_pb.RunRequest:
    request = _request()
    request.task.input.add(content="no role")
    return request


def _bad_env_json() -> agent_pb.RunRequest:
    request = _request()
    request.task.env_json = "[1, 2]"
    return request


def _nameless_tool() -> agent_pb.RunRequest:
    request = _request()
    request.task.tools.add()
    return request


def _attempt_without_rollout() -> agent_pb.RunRequest:
    request = _request()
    request.episode_id.attempt = 2
    return request


@pytest.mark.parametrize(
    ("make", "field", "text"),
    [
        (_no_task, "task", "task is required"),
        (_empty_input, "task.input", "task.input is empty"),
        (_bad_role, "task.input[1].role", "not a known Role"),
        (_bad_env_json, "task.env_json", "must be a JSON object"),
        (_nameless_tool, "task.tools[2].name", "is empty"),
        (lambda: _request(rollout_id="../x"), "episode_id.rollout_id", "must match"),
        (lambda: _request(rollout_id="x" * 129), "episode_id.rollout_id", "must match"),
        (_attempt_without_rollout, "episode_id.rollout_id", "rollout_id is empty"),
        (lambda: _request(max_steps=51), "options.max_steps", "exceeds this agent's limit of 50"),
        (lambda: _request(episode_timeout=duration(-1)), "options.episode_timeout", "must be positive"),
        (
            lambda: agent_pb.RunRequest(task=counter_tasks()[0], policy_version="v" * 300),
            "policy_version",
            "at most",
        ),
    ],
)
def test_bad_requests_are_invalid_argument_before_any_episode_call(
    make: Callable[[], agent_pb.RunRequest], field: str, text: str
) -> None:
    resources = counter_resources()
    with pytest.raises(InvalidArgument, match=re.escape(text)) as caught:
        _run(_servicer(resources), make())
    assert caught.value.metadata["field"] == field
    assert set(resources.methods()) <= {"ListTools"}


def test_a_request_without_episode_id_gets_a_random_rollout_id() -> None:
    servicer = _servicer()
    first, second = _run(servicer, _request()), _run(servicer, _request())
    assert re.fullmatch(r"[0-9a-f]{32}", first.episode_id.rollout_id)
    assert first.episode_id.rollout_id != second.episode_id.rollout_id
    assert first.reward == second.reward == 1.0


def test_episode_id_and_policy_version_reach_every_call() -> None:
    resources, model = counter_resources(), fake_model()
    request = _request(rollout_id="roll.1_x")
    request.episode_id.attempt = 3
    request.policy_version = "iteration:107"
    t = _run(_servicer(resources, model), request)
    assert (t.episode_id.rollout_id, t.episode_id.attempt, t.policy_version) == (
        "roll.1_x",
        3,
        "iteration:107",
    )
    seed = next(r for m, r in resources.calls if m == "SeedSession")
    assert seed.session_id == "roll.1_x-a3"
    assert {r.episode_id.attempt for m, r in resources.calls if m != "ListTools"} == {3}
    assert model.calls[0][1].request_id == "roll.1_x/a3/step0"


def test_options_override_the_agent_defaults() -> None:
    t = _run(_servicer(), _request(max_steps=1))
    assert (t.steps, t.stop_reason) == (1, agent_pb.STOP_REASON_MAX_STEPS)


def test_the_environment_is_described_once_and_text_turns_are_detected() -> None:
    resources = blackjack_resources()
    servicer = _servicer(resources)
    for task in blackjack_tasks(seed=1)[:2]:
        t = _run(servicer, _request(task))
        assert t.messages[-1].role == common_pb2.ROLE_ASSISTANT
        assert t.reward in (-1.0, 0.0, 1.0)
    assert resources.methods().count("ListTools") == 1
    assert resources.methods().count("Step") == 2


def test_episode_timeout_is_deadline_exceeded_naming_the_phase() -> None:
    resources = counter_resources()
    servicer = _servicer(resources, ScriptedModel(reply("late"), delay=5))

    async def scenario() -> None:
        request = _request(rollout_id="r1", episode_timeout=duration(0.1))
        with pytest.raises(DeadlineExceeded, match=r"episode r1/a0 ran past its timeout of 0.1s in phase READY_FOR"):
            await servicer.Run(request, None)  # type: ignore[arg-type]
        await asyncio.sleep(0.05)  # the session is closed in the background

    asyncio.run(scenario())
    assert resources.methods()[-1] == "CloseSession"


def test_a_second_run_of_a_running_episode_is_aborted_with_retry_info() -> None:
    servicer = _servicer(model=ScriptedModel(reply("slow"), delay=0.2))

    async def both() -> list[Any]:
        return await asyncio.gather(
            *(servicer.Run(_request(rollout_id="dup"), None) for _ in range(2)),  # type: ignore[arg-type]
            return_exceptions=True,
        )

    results = asyncio.run(both())
    errors = [r for r in results if isinstance(r, GymrpcError)]
    assert len(errors) == 1
    assert isinstance(errors[0], Aborted)
    assert (errors[0].reason, errors[0].retry_delay) == ("LEASE_HELD", 1.0)
    assert _run(servicer, _request(rollout_id="dup")).reward == 0.0  # the lease is released afterwards


def test_run_stream_reports_every_boundary_then_the_trajectory() -> None:
    servicer = _servicer()

    async def collect() -> list[agent_pb.RunStreamResponse]:
        request = agent_pb.RunStreamRequest(request=_request(rollout_id="s1"))
        return [event async for event in servicer.RunStream(request, None)]  # type: ignore[arg-type]

    events = asyncio.run(collect())
    progress = [e.progress for e in events[:-1]]
    assert all(e.WhichOneof("event") == "progress" for e in events[:-1])
    assert [p.phase for p in progress] == [
        agent_pb.EPISODE_PHASE_READY_FOR_MODEL,
        *[agent_pb.EPISODE_PHASE_READY_FOR_TOOL, agent_pb.EPISODE_PHASE_READY_FOR_MODEL] * 3,
        agent_pb.EPISODE_PHASE_READY_FOR_VERIFY,
        agent_pb.EPISODE_PHASE_COMPLETED,
    ]
    assert [p.step for p in progress] == [0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert progress[2].message.role == common_pb2.ROLE_TOOL
    assert events[-1].WhichOneof("event") == "trajectory"
    assert events[-1].trajectory.reward == 1.0


def test_agent_config_refuses_impossible_limits() -> None:
    with pytest.raises(ValueError, match="max_steps"):
        AgentConfig(max_steps=0)
    with pytest.raises(ValueError, match="positive"):
        AgentConfig(episode_timeout=0)
