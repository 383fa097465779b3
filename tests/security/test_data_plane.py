"""Data-plane credentials and session ownership, probed with raw stubs against a live stack.

The probes of the security review: an anonymous caller reads, overwrites, takes over and drops
another episode's session; an agent token drives a checkpoint. Each must fail with the right
status and reason and change nothing (the session's counter, its owner, the participant phase).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from gymrpc import auth
from gymrpc.channels import service_channel_options
from gymrpc.client import Client
from gymrpc.errors import PermissionDenied
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import agent_service_pb2_grpc as agent_grpc
from gymrpc.v1 import common_pb2
from gymrpc.v1 import model_service_pb2 as model_pb
from gymrpc.v1 import model_service_pb2_grpc as model_grpc
from gymrpc.v1 import participant_service_pb2 as part_pb
from gymrpc.v1 import participant_service_pb2_grpc as part_grpc
from gymrpc.v1 import resources_service_pb2 as res_pb
from gymrpc.v1 import resources_service_pb2_grpc as res_grpc
from tests.agent.fakes import counter_tasks

STACK = {
    "servers": [
        {"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}},
        {"name": "model/policy", "role": "model", "args": {"policy": "counter"}},
        {"name": "agent/counter", "role": "agent", "args": {"resources": "resources/counter", "model": "model/policy"}},
    ]
}
SESSION = "victim-session"
OWNER = common_pb2.EpisodeId(rollout_id="victim", attempt=0)
INTRUDER = common_pb2.EpisodeId(rollout_id="intruder", attempt=0)


def reason_of(exc: grpc.aio.AioRpcError) -> str:
    for key, value in exc.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info):
                    return info.reason
    return ""


async def refused(call: Awaitable[Any]) -> tuple[grpc.StatusCode, str]:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code(), reason_of(exc)
    raise AssertionError("the call was let through")


def md(token: str | None) -> tuple[tuple[str, str], ...]:
    return auth.metadata(token)


@pytest.fixture
def stack(start_stack: Any) -> Any:
    return start_stack(STACK)


def _channel(stack: Any, name: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(stack.server(name)["address"], options=service_channel_options())


def test_anonymous_and_foreign_callers_cannot_touch_a_session(stack: Any) -> None:
    token = stack.token
    agent_token = auth.role_token(token, "agent")

    async def scenario() -> None:
        async with _channel(stack, "resources/counter") as channel:
            raw = res_grpc.ResourcesServiceStub(channel)
            task = common_pb2.Task(task_id="t", env_json=json.dumps({"initial_count": 3, "expected_count": 6}))
            await raw.SeedSession(
                res_pb.SeedSessionRequest(session_id=SESSION, episode_id=OWNER, task=task), metadata=md(agent_token)
            )

            def call_tool(n: int, episode: common_pb2.EpisodeId, token_: str | None) -> Awaitable[Any]:
                call = common_pb2.ToolCall(id=f"c{n}", name="increment_counter", arguments_json='{"count": 1}')
                request = res_pb.CallToolRequest(session_id=SESSION, episode_id=episode, call=call)
                return raw.CallTool(request, metadata=md(token_), timeout=10)

            async def count() -> int:
                call = common_pb2.ToolCall(id=f"get-{asyncio.get_running_loop().time()}", name="get_counter_value")
                request = res_pb.CallToolRequest(session_id=SESSION, episode_id=OWNER, call=call)
                reply = await raw.CallTool(request, metadata=md(agent_token), timeout=10)
                return int(json.loads(reply.output)["count"])

            before = await count()
            snapshot = (
                await raw.CheckpointSession(
                    res_pb.CheckpointSessionRequest(session_id=SESSION, episode_id=OWNER), metadata=md(agent_token)
                )
            ).snapshot
            unauthenticated = (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
            not_owner = (grpc.StatusCode.PERMISSION_DENIED, "NOT_SESSION_OWNER")
            read = res_pb.CheckpointSessionRequest(session_id=SESSION, episode_id=OWNER)
            overwrite = res_pb.RestoreSessionRequest(session_id=SESSION, episode_id=OWNER, snapshot=snapshot)
            takeover = res_pb.RestoreSessionRequest(session_id=SESSION, episode_id=INTRUDER, snapshot=snapshot)
            drop = res_pb.DiscardSessionRequest(session_id=SESSION, episode_id=OWNER)
            # Anonymous, or with a token of no stack: turned away before the servicer runs.
            for credential in (None, "not-a-token", auth.role_token("another-stack", "agent")):
                assert await refused(raw.CheckpointSession(read, metadata=md(credential))) == unauthenticated
                assert await refused(raw.RestoreSession(overwrite, metadata=md(credential))) == unauthenticated
                assert await refused(raw.RestoreSession(takeover, metadata=md(credential))) == unauthenticated
                assert await refused(raw.DiscardSession(drop, metadata=md(credential))) == unauthenticated
                assert await refused(call_tool(1, OWNER, credential)) == unauthenticated
            # A valid credential, but another episode's id: the session is not its to use.
            for credential in (agent_token, token):
                foreign_read = res_pb.CheckpointSessionRequest(session_id=SESSION, episode_id=INTRUDER)
                foreign_drop = res_pb.DiscardSessionRequest(session_id=SESSION, episode_id=INTRUDER)
                assert await refused(raw.CheckpointSession(foreign_read, metadata=md(credential))) == not_owner
                assert await refused(raw.RestoreSession(takeover, metadata=md(credential))) == not_owner
                assert await refused(raw.DiscardSession(foreign_drop, metadata=md(credential))) == not_owner
                assert await refused(call_tool(2, INTRUDER, credential)) == not_owner
            # A trainer token may drive agents, not resources.
            trainer = auth.role_token(token, "trainer")
            assert await refused(raw.CheckpointSession(read, metadata=md(trainer))) == (
                grpc.StatusCode.PERMISSION_DENIED,
                "ROLE_NOT_ALLOWED",
            )
            # Nothing changed: the owner still has its session, with its count.
            assert await count() == before
            await call_tool(3, OWNER, agent_token)
            assert await count() == before + 1

    asyncio.run(scenario())


def test_an_agent_token_cannot_drive_a_checkpoint_or_an_agent(stack: Any) -> None:
    agent_token = auth.role_token(stack.token, "agent")
    trainer_token = auth.role_token(stack.token, "trainer")
    task = counter_tasks()[0]

    async def scenario() -> None:
        for name in ("resources/counter", "model/policy", "agent/counter"):
            async with _channel(stack, name) as channel:
                raw = part_grpc.ParticipantServiceStub(channel)
                before = await raw.GetStatus(part_pb.GetStatusRequest(), metadata=md(stack.token), timeout=10)
                for credential in (agent_token, trainer_token, None):
                    prepare = part_pb.PrepareRequest(checkpoint_id="stolen")
                    code, reason = await refused(raw.Prepare(prepare, metadata=md(credential), timeout=10))
                    assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED"), name
                    code, _ = await refused(raw.GetStatus(part_pb.GetStatusRequest(), metadata=md(credential)))
                    assert code == grpc.StatusCode.UNAUTHENTICATED
                after = await raw.GetStatus(part_pb.GetStatusRequest(), metadata=md(stack.token), timeout=10)
                assert after.phase == before.phase, name
        async with _channel(stack, "agent/counter") as channel:
            raw_agent = agent_grpc.AgentServiceStub(channel)
            run = agent_pb.RunRequest(task=task, episode_id=common_pb2.EpisodeId(rollout_id="by-agent-token"))
            assert await refused(raw_agent.Run(run, metadata=md(agent_token), timeout=60)) == (
                grpc.StatusCode.PERMISSION_DENIED,
                "ROLE_NOT_ALLOWED",
            )
            assert await refused(raw_agent.Run(run, metadata=md(None), timeout=60)) == (
                grpc.StatusCode.UNAUTHENTICATED,
                "UNAUTHENTICATED",
            )
            run = agent_pb.RunRequest(task=task, episode_id=common_pb2.EpisodeId(rollout_id="by-trainer-token"))
            reply = await raw_agent.Run(run, metadata=md(trainer_token), timeout=60)
            assert reply.trajectory.reward == 1.0  # the agent passed its own token on to resources and model
        async with _channel(stack, "model/policy") as channel:
            generate = model_pb.GenerateRequest(request_id="anon", messages=task.input)
            code, _ = await refused(model_grpc.ModelServiceStub(channel).Generate(generate, timeout=10))
            assert code == grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(scenario())


def test_the_run_folder_client_and_role_token_files_just_work(stack: Any) -> None:
    """`gymrpc.Client()` in the run folder sends the stack token; the role token files work as tokens."""
    for file_name in auth.ROLE_TOKEN_FILES.values():
        assert (stack.run_dir / file_name).stat().st_mode & 0o777 == 0o600
    trainer = (stack.run_dir / auth.ROLE_TOKEN_FILES["trainer"]).read_text().strip()
    assert trainer == auth.role_token(stack.token, "trainer")
    task = counter_tasks()[1]

    async def scenario() -> None:
        async with Client(run_dir=stack.run_dir) as client:
            tools = await client.resources("resources/counter").ListTools(res_pb.ListToolsRequest())
            assert tools.environment == "counter"
        async with Client(run_dir=stack.run_dir, token=trainer) as client:
            trajectory = await client.run(task, episode_id="with-trainer", policy_version="v", agent="agent/counter")
            assert trajectory.reward == 1.0
            with pytest.raises(PermissionDenied) as caught:
                await client.resources("resources/counter").ListTools(res_pb.ListToolsRequest())
            assert caught.value.reason == "ROLE_NOT_ALLOWED"

    asyncio.run(scenario())
