"""Oversized and hostile inputs are refused cleanly and change nothing, on real server processes.

- a 10 MiB Generate is refused (INVALID_ARGUMENT, field `messages`) before it is tokenised, a
  health check sent beside it answers within 1 s, the server's memory does not grow with it, and
  the refused request id is still free;
- tokenising runs off the event loop: while one prompt is being tokenised, the server answers;
- JSON nested 100,000 deep or holding a 5,000-digit number: as tool arguments the `is_error` tool
  result (the session is byte-for-byte what it was), as `env_json` (resources, agent) and as a
  tool schema (model) INVALID_ARGUMENT naming the field;
- `attempt` 4294967295 on Run, SeedSession, Generate and Restore is INVALID_ARGUMENT naming
  `attempt`, before anything is done.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gymrpc import safejson
from gymrpc.chat import ChatTokenizer, default_tokenizer
from gymrpc.registry import RegistryClient
from gymrpc.servers.bootstrap import ServerConfig, ServiceBinding, start_server
from gymrpc.servers.model.backends.scripted import ScriptedBackend
from gymrpc.servers.model.backends.sources import CounterSolver
from gymrpc.servers.model.service import ModelServicer
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import agent_service_pb2_grpc as agent_grpc
from gymrpc.v1 import common_pb2
from gymrpc.v1 import model_service_pb2 as model_pb
from gymrpc.v1 import model_service_pb2_grpc as model_grpc
from gymrpc.v1 import participant_service_pb2_grpc as pb_grpc
from gymrpc.v1 import resources_service_pb2 as res_pb
from gymrpc.v1 import resources_service_pb2_grpc as res_grpc
from tests.agent.fakes import counter_task
from tests.control.test_bad_input import restore_request
from tests.security.helpers import CONTROL, TOKEN, ServerProcess, channel, comparable, participant_status, refused

INVALID = grpc.StatusCode.INVALID_ARGUMENT
DEEP = "[" * 100_000 + "]" * 100_000
DEEP_OBJECT = '{"a":' * 100_000 + "1" + "}" * 100_000
HUGE_NUMBER = '{"count": ' + "9" * 5000 + "}"
MAX_UINT32 = 2**32 - 1


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def user(text: str) -> common_pb2.Message:
    return common_pb2.Message(role=common_pb2.ROLE_USER, content=text)


TOOLS = [
    common_pb2.ToolDefinition(name="increment_counter", parameters_json_schema='{"type": "object"}'),
    common_pb2.ToolDefinition(name="get_counter_value", parameters_json_schema="{}"),
]


def generate_request(request_id: str, text: str = "add 4 then count", **fields: Any) -> model_pb.GenerateRequest:
    fields.setdefault("tools", TOOLS)
    episode = common_pb2.EpisodeId(rollout_id="ep")
    return model_pb.GenerateRequest(request_id=request_id, episode_id=episode, messages=[user(text)], **fields)


@pytest.fixture
def model_server(tmp_path: Path) -> Iterator[ServerProcess]:
    server = ServerProcess("gymrpc.servers.model", "model/policy", ["--policy", "counter"], tmp_path / "model")
    yield server
    server.stop()


@pytest.fixture
def resources_server(tmp_path: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(
        "gymrpc.servers.resources", "resources/r", ["--environment", "counter"], tmp_path / "resources"
    )
    yield server
    server.stop()


def test_a_10_mib_prompt_is_refused_at_once_and_the_server_keeps_answering(model_server: ServerProcess) -> None:
    async def main() -> None:
        async with channel(model_server.address) as ch:
            model = model_grpc.ModelServiceStub(ch)
            health = health_pb2_grpc.HealthStub(ch)
            await model.Generate(generate_request("warm-up"), timeout=30)
            before = rss_kib(model_server.pid)
            big = generate_request("big", "x" * (10 << 20))
            generate = asyncio.ensure_future(
                refused(model.Generate(big, timeout=60), INVALID, "INVALID_REQUEST", says="bytes")
            )
            answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            error = await generate
            assert "--max-prompt-bytes" in (error.details() or "")
            # Refused before tokenising: no prompt-sized allocations stayed behind (it used to be 2 GB).
            assert rss_kib(model_server.pid) - before < 200 * 1024
            # Nothing was cached under the refused id: a good request may still use it.
            reply = await model.Generate(generate_request("big"), timeout=30)
            assert reply.message.tool_calls

    asyncio.run(main())


class GatedTokenizer(ChatTokenizer):
    """Blocks `encode` of a text holding MARKER until released; says when it started and ended."""

    MARKER = "<<gate>>"

    def __init__(self) -> None:
        base = default_tokenizer()
        super().__init__(base._tokenizer, name="gated")
        self.started, self.release, self.returned = threading.Event(), threading.Event(), threading.Event()

    def encode(self, text: str) -> list[int]:
        if self.MARKER in text:
            self.started.set()
            self.release.wait(60)
            self.returned.set()
        return super().encode(text)


def test_tokenising_runs_off_the_event_loop() -> None:
    async def main() -> None:
        tokenizer = GatedTokenizer()
        servicer = ModelServicer(ScriptedBackend(tokenizer, [CounterSolver()]), tokenizer)
        binding = ServiceBinding(
            model_pb.DESCRIPTOR.services_by_name["ModelService"],
            servicer,
            model_grpc.add_ModelServiceServicer_to_server,
        )
        running = await start_server(ServerConfig(name="model/gated", token=TOKEN), [binding])
        try:
            async with channel(running.address) as ch:
                model = model_grpc.ModelServiceStub(ch)
                slow = asyncio.ensure_future(
                    model.Generate(generate_request("slow", f"add 1 {GatedTokenizer.MARKER}"), timeout=120)
                )
                await asyncio.to_thread(tokenizer.started.wait, 60)
                assert tokenizer.started.is_set()
                # While that prompt is tokenised, the same server answers health checks and other prompts.
                answer = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=60)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
                other = await model.Generate(generate_request("other"), timeout=60)
                assert other.message.tool_calls
                assert not tokenizer.returned.is_set(), "the server answered only after tokenising"
                tokenizer.release.set()
                assert (await slow).message.content or (await slow).message.tool_calls
        finally:
            tokenizer.release.set()
            await running.stop(0)
            await servicer.close()

    asyncio.run(main())


def test_hostile_json_gets_the_promised_refusals(model_server: ServerProcess, resources_server: ServerProcess) -> None:
    async def main() -> None:
        async with channel(resources_server.address) as rch, channel(model_server.address) as mch:
            resources = res_grpc.ResourcesServiceStub(rch)
            episode = common_pb2.EpisodeId(rollout_id="e1")
            await resources.SeedSession(
                res_pb.SeedSessionRequest(session_id="s1", episode_id=episode, task=counter_task("count", 0, 3)),
                timeout=30,
            )

            async def snapshot() -> str:
                reply = await resources.CheckpointSession(
                    res_pb.CheckpointSessionRequest(session_id="s1", episode_id=episode), timeout=30
                )
                return hashlib.sha256(reply.snapshot.payload).hexdigest()

            before = await snapshot()
            for index, arguments in enumerate([DEEP, DEEP_OBJECT, HUGE_NUMBER, '{"count": NaN}']):
                call = common_pb2.ToolCall(id=f"c{index}", name="increment_counter", arguments_json=arguments)
                reply = await resources.CallTool(
                    res_pb.CallToolRequest(session_id="s1", episode_id=episode, call=call), timeout=30
                )
                assert reply.is_error, arguments[:20]
                assert "arguments of increment_counter" in reply.output
                assert await snapshot() == before
            # A good call afterwards still works: the session was not harmed.
            good = common_pb2.ToolCall(id="ok", name="increment_counter", arguments_json='{"count": 1}')
            reply = await resources.CallTool(
                res_pb.CallToolRequest(session_id="s1", episode_id=episode, call=good), timeout=30
            )
            assert not reply.is_error

            status = comparable(await participant_status(resources_server.address))
            for env_json in (DEEP_OBJECT, '{"x": ' + "1" * 5000 + "}"):
                task = counter_task("count", 0, 3)
                task.env_json = env_json
                await refused(
                    resources.SeedSession(
                        res_pb.SeedSessionRequest(
                            session_id="s2", episode_id=common_pb2.EpisodeId(rollout_id="e2"), task=task
                        ),
                        timeout=30,
                    ),
                    INVALID,
                    "INVALID_REQUEST",
                    says="task.env_json",
                )
            assert comparable(await participant_status(resources_server.address)) == status

            model = model_grpc.ModelServiceStub(mch)
            for schema in (DEEP_OBJECT, '{"type": "object", "maximum": ' + "7" * 5000 + "}"):
                tools = [common_pb2.ToolDefinition(name="increment_counter", parameters_json_schema=schema)]
                error = await refused(
                    model.Generate(generate_request("schema", tools=tools), timeout=30),
                    INVALID,
                    "INVALID_REQUEST",
                    says="tools[0].parameters_json_schema",
                )
                assert len(error.details() or "") < 1000
            reply = await model.Generate(generate_request("schema"), timeout=30)  # the id was not taken
            assert reply.message.tool_calls

    asyncio.run(main())


def test_attempt_out_of_range_is_refused_everywhere(
    tmp_path: Path, model_server: ServerProcess, resources_server: ServerProcess
) -> None:
    registry = ServerProcess(
        "gymrpc.servers.registry", "registry/main", ["--bind", f"unix:{tmp_path}/r.sock"], tmp_path / "reg"
    )

    async def register_dependencies() -> None:
        """The agent reports ready only once the names it calls resolve."""
        async with RegistryClient(f"unix:{tmp_path}/r.sock", token=TOKEN) as names:
            await names.register("resources/r", resources_server.address, ttl=600)
            await names.register("model/policy", model_server.address, ttl=600)

    asyncio.run(register_dependencies())
    agent = ServerProcess(
        "gymrpc.servers.agent",
        "agent/counter",
        ["--registry", f"unix:{tmp_path}/r.sock", "--resources", "resources/r", "--model", "model/policy"],
        tmp_path / "agent",
    )
    big = common_pb2.EpisodeId(rollout_id="e9", attempt=MAX_UINT32)

    async def main() -> None:
        async with (
            channel(agent.address) as ach,
            channel(resources_server.address) as rch,
            channel(model_server.address) as mch,
        ):
            says = "episode_id.attempt"
            agent_before = comparable(await participant_status(agent.address))
            run = agent_pb.RunRequest(episode_id=big, task=counter_task("count", 0, 3))
            await refused(agent_grpc.AgentServiceStub(ach).Run(run, timeout=30), INVALID, "INVALID_REQUEST", says=says)
            task = counter_task("count", 0, 3)
            task.env_json = DEEP_OBJECT
            deep = agent_pb.RunRequest(episode_id=common_pb2.EpisodeId(rollout_id="e8"), task=task)
            await refused(
                agent_grpc.AgentServiceStub(ach).Run(deep, timeout=30), INVALID, "INVALID_REQUEST", says="task.env_json"
            )
            seed = res_pb.SeedSessionRequest(session_id="s9", episode_id=big, task=counter_task("count", 0, 3))
            await refused(res_grpc.ResourcesServiceStub(rch).SeedSession(seed, timeout=30), INVALID, "INVALID_REQUEST")
            gen = generate_request("g9")
            gen.episode_id.CopyFrom(big)
            await refused(model_grpc.ModelServiceStub(mch).Generate(gen, timeout=30), INVALID, "INVALID_REQUEST")
            assert comparable(await participant_status(agent.address)) == agent_before
            for server in (resources_server, model_server, agent):
                async with channel(server.address) as ch:
                    before = comparable(await participant_status(server.address))
                    await refused(
                        pb_grpc.ParticipantServiceStub(ch).Restore(
                            restore_request(tmp_path, episodes=[big]), timeout=30, metadata=CONTROL
                        ),
                        INVALID,
                        "INVALID_REQUEST",
                        says="episode_ids[0].attempt",
                    )
                    assert comparable(await participant_status(server.address)) == before

    try:
        asyncio.run(main())
    finally:
        agent.stop()
        registry.stop()


def test_bounded_json_parser() -> None:
    assert safejson.loads('{"a": [1, 2.5, "[[["]}') == {"a": [1, 2.5, "[[["]}
    assert safejson.loads("[" * 100 + "]" * 100) is not None
    assert safejson.nesting_depth('"{{{{" [ ] {"x": "]]]"}') == 1
    for text, says in [
        ("[" * 101 + "]" * 101, "deeper than 100"),
        (DEEP, "deeper"),
        ("1" * 101, "digits"),
        ("1." + "0" * 100, "characters"),
        ("[Infinity]", "not JSON"),
    ]:
        with pytest.raises(safejson.JsonLimit, match=says):
            safejson.loads(text)
    with pytest.raises(json.JSONDecodeError):
        safejson.loads("{nope")
    with pytest.raises(UnicodeDecodeError):
        safejson.loads(b"\xff")
