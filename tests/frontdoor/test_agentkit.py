"""Agent functions served by `gymrpc.agentkit`, SIGKILLed at every boundary kind, replayed to the same result.

One stack: resources/counter, the real model server (scripted counter policy) with its
OpenAI front door and a durable replay folder, and one kit agent per crash point, each with
its own fault injection (`gymrpc.servers.agent.faults`): the agent kills itself once at that
boundary; the supervisor restarts it; the trainer's pending `Client.run` follows the name
and the restarted agent runs the function again from the start. The model role answers the
recorded prefix from its record (counted per episode by the front door: nothing is
generated twice) and the resources role returns the recorded result of every known call id
(the counter's final count would be off if an increment ran twice).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from gymrpc import auth
from gymrpc.channels import bearer_interceptors
from gymrpc.client import Client
from gymrpc.errors import FailedPrecondition
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import agent_service_pb2_grpc as agent_grpc
from tests.agent.fakes import counter_task
from tests.resume.helpers import crash_env, expected_count, task

REACT = "gymrpc.agentkit.examples.react:solve"
CRASHES = {
    "agent/after-model": "after_model:0",  # the two increments were generated; none applied
    "agent/after-tool": "after_tool:0",  # one increment applied, the function went on to the next call
    "agent/during-tool": "during_tool:1",  # the second increment applied, its result never seen
    "agent/after-read": "after_tool:2",  # the read done, before the final answer
}
REPLAYED = {"agent/after-model": 1, "agent/after-tool": 1, "agent/during-tool": 1, "agent/after-read": 2}
"""Model calls the retried run gets from the record (the rest go live)."""


def kit(name: str, entrypoint: str = REACT, env: dict[str, str] | None = None, **args: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": name,
        "role": "agent",
        "args": {"entrypoint": entrypoint, "resources": "resources/counter", "model": "model/policy", **args},
    }
    if env:
        spec["env"] = env
    return spec


def config(run_dir: Path, *agents: dict[str, Any]) -> dict[str, Any]:
    model_args = {"policy": "counter", "openai_port": 0, "replay_dir": str(run_dir / "replay")}
    return {
        "restart": {"max_restarts": 5, "window_seconds": 60, "backoff_seconds": 0.05},
        "servers": [
            {"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}},
            {"name": "model/policy", "role": "model", "args": model_args},
            *agents,
        ],
    }


def outcome(t: agent_pb.Trajectory) -> dict[str, Any]:
    """What must not depend on a crash: reward, state, every message, tool result and token."""
    return {
        "reward": t.reward,
        "details": json.loads(t.verify_details_json),
        "messages": [m.SerializeToString(deterministic=True) for m in t.messages],
        "tool_calls": [(c.call.id, c.call.name, c.call.arguments_json, c.output, c.is_error) for c in t.tool_calls],
        "steps": t.steps,
        "tokens": [(list(c.tokens.prompt_token_ids), list(c.tokens.completion_token_ids)) for c in t.model_calls],
    }


async def episode_stats(client: Client, rollout_id: str) -> dict[str, int]:
    (endpoint,) = await client.registry.resolve("model/policy")
    async with httpx.AsyncClient(headers=dict(client._metadata)) as http:  # with the stack token
        reply = await http.get(
            f"{endpoint.labels['openai_url'][:-3]}/gymrpc/stats", params={"episode": f"{rollout_id}/0"}
        )
        return reply.json()


def test_killed_at_every_boundary_kind_the_retried_run_replays_to_the_same_result(
    start_stack: Any, run_dir: Path
) -> None:
    agents = [kit("agent/plain"), kit("agent/responses", "gymrpc.agentkit.examples.react:solve_responses")]
    agents += [kit(name, env=crash_env(at, run_dir / f"{name[6:]}.crashed")) for name, at in CRASHES.items()]
    stack = start_stack(config(run_dir, *agents))
    t = task(1)  # add 4 then add 5 then get the count: 6 -> 15
    names = ["agent/plain", "agent/responses", *CRASHES]

    async def scenario() -> tuple[dict[str, agent_pb.Trajectory], dict[str, dict[str, int]]]:
        async with Client(run_dir=run_dir) as client:
            results = await asyncio.gather(
                *(
                    client.run(t, episode_id=f"ep-{i}", policy_version="p", agent=name, timeout=120)
                    for i, name in enumerate(names)
                )
            )
            stats = {name: await episode_stats(client, f"ep-{i}") for i, name in enumerate(names)}
            every = await asyncio.gather(
                *(client.run(task(k), episode_id=f"all-{k}", policy_version="p", agent="agent/plain") for k in range(5))
            )
            assert [t.reward for t in every] == [1.0] * 5  # the example solves every counter task
            return dict(zip(names, results, strict=True)), stats

    results, stats = asyncio.run(scenario())
    baseline = results["agent/plain"]
    assert baseline.reward == 1.0
    assert json.loads(baseline.verify_details_json)["count"] == expected_count(t)
    assert [c.call.name for c in baseline.tool_calls] == ["increment_counter"] * 2 + ["get_counter_value"]
    assert stats["agent/plain"] == {"generated": 3, "replayed": 0, "recorded": 3}
    assert len(baseline.model_calls) == 3
    assert all(c.tokens.prompt_token_ids and c.tokens.completion_token_ids for c in baseline.model_calls)
    # The Responses API flavour of the same agent: same calls, same reward, same tokens.
    responses = results["agent/responses"]
    assert responses.reward == 1.0
    assert outcome(responses)["tool_calls"] == outcome(baseline)["tool_calls"]
    assert outcome(responses)["tokens"] == outcome(baseline)["tokens"]
    for name, at in CRASHES.items():
        assert (run_dir / f"{name[6:]}.crashed").exists(), f"{name} never crashed at {at}"
        assert stack.server(name)["restarts"] == 1, name
        assert "SIGKILL" in (stack.server(name)["last_exit"] or ""), name
        assert outcome(results[name]) == outcome(baseline), f"{name} ({at}) differs from the uninterrupted run"
        # Nothing regenerated: 3 model calls in all, the prefix answered from the record.
        assert stats[name] == {"generated": 3, "replayed": REPLAYED[name], "recorded": 3}, name


def fail_and_go_live(
    start_stack: Any, run_dir: Path, name: str, entrypoint: str, at: str, t: Any
) -> tuple[FailedPrecondition, agent_pb.Trajectory, dict[str, int]]:
    """Two kit agents running `entrypoint`, each SIGKILLed once at `at` (markers `<name>.crashed` and
    `live.crashed`): the retried run of the default one fails, `go_live`'s completes (with its model stats)."""
    agents = [
        kit(f"agent/{name}", entrypoint, env=crash_env(at, run_dir / f"{name}.crashed")),
        kit(f"agent/{name}-live", entrypoint, env=crash_env(at, run_dir / "live.crashed"), divergence="go_live"),
    ]
    start_stack(config(run_dir, *agents))

    async def scenario() -> tuple[FailedPrecondition, agent_pb.Trajectory, dict[str, int]]:
        async with Client(run_dir=run_dir) as client:
            with pytest.raises(FailedPrecondition) as caught:
                await client.run(t, episode_id=name, policy_version="p", agent=f"agent/{name}", timeout=120)
            live = await client.run(
                t, episode_id=f"{name}-live", policy_version="p", agent=f"agent/{name}-live", timeout=120
            )
            return caught.value, live, await episode_stats(client, f"{name}-live")

    return asyncio.run(scenario())


def test_a_non_deterministic_agent_gets_the_divergence_error_naming_the_position(
    start_stack: Any, run_dir: Path
) -> None:
    flaky = "tests.frontdoor.agents:not_deterministic"
    error, live, stats = fail_and_go_live(start_stack, run_dir, "flaky", flaky, "after_model:0", task(2))
    assert error.reason == "REPLAY_DIVERGENCE"
    assert error.metadata["position"] == "0"
    assert error.metadata["field"] == "messages[0].content"
    assert "model call 0" in error.message
    assert (run_dir / "flaky.crashed").exists()
    # Opted into go_live: the run goes on live from the divergence and finishes.
    assert live.reward == 1.0
    assert stats["recorded"] == 3


def test_a_retried_run_that_sends_another_call_under_a_recorded_id_fails_or_goes_live_in_a_fresh_session(
    start_stack: Any, run_dir: Path
) -> None:
    # The function draws its increment itself, so its retried run sends another call as `kit_0`.
    own = "tests.frontdoor.agents:picks_its_own_arguments"
    t = task(2)
    error, live, _ = fail_and_go_live(start_stack, run_dir, "own", own, "after_tool:0", t)
    assert (run_dir / "own.crashed").exists()  # the first run applied its increment, then died
    assert error.reason == "REPLAY_DIVERGENCE"
    assert error.metadata["id"] == "kit_0"
    assert "another tool name or arguments" in error.message
    # go_live: the function ran again in a fresh session, which holds its own increment only.
    assert (run_dir / "live.crashed").exists()
    assert live.restart_count == 1
    increment, read = live.tool_calls
    added = json.loads(increment.call.arguments_json)["count"]
    assert json.loads(read.output)["count"] == json.loads(t.env_json)["initial_count"] + added


def test_a_kit_agent_whose_resources_server_restarts_mid_run_runs_again_in_a_fresh_session(
    start_stack: Any, run_dir: Path
) -> None:
    folder = run_dir / "fifos"
    folder.mkdir()
    os.mkfifo(folder / "reached")
    os.mkfifo(folder / "gate")
    agent = kit("agent/gated", "tests.frontdoor.agents:waits_at_a_gate", env={"GYMRPC_TEST_GATE": str(folder)})
    stack = start_stack(config(run_dir, agent))

    async def scenario() -> agent_pb.Trajectory:
        async with Client(run_dir=run_dir) as client:
            t = counter_task("add 2 then add 3 then get the count", 0, 5)
            run = asyncio.ensure_future(client.run(t, episode_id="gated", policy_version="p", agent="agent/gated"))
            await asyncio.to_thread((folder / "reached").read_bytes)  # 2 added: the session holds 2
            killed = stack.kill("resources/counter")
            await asyncio.to_thread(
                stack.wait_for, "resources/counter", lambda s: s["pid"] != killed and s["state"] == "serving"
            )
            await asyncio.to_thread((folder / "gate").write_bytes, b"1")
            return await run

    t = asyncio.run(scenario())
    assert (t.reward, t.restart_count) == (1.0, 1)  # the function ran again, in a fresh session: 2 + 3
    assert [json.loads(c.output) for c in t.tool_calls] == [{"success": True}, {"success": True}, {"count": 5}]


def test_the_model_server_killed_mid_episode_still_answers_from_its_record(start_stack: Any, run_dir: Path) -> None:
    marker = run_dir / "agent.crashed"
    stack = start_stack(config(run_dir, kit("agent/plain"), kit("agent/kit", env=crash_env("after_model:1", marker))))
    t = task(3)

    async def first_run() -> None:
        """A plain channel, not `gymrpc.Client` (which would follow the restarted agent and finish the run)."""
        async with Client(run_dir=run_dir) as client:
            address = await client.resolve("agent/kit")
        token = auth.read_token_file(run_dir / "token")
        async with grpc.aio.insecure_channel(address, interceptors=bearer_interceptors(token)) as channel:
            request = agent_pb.RunRequest(task=t, episode_id={"rollout_id": "mk"}, policy_version="p")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await agent_grpc.AgentServiceStub(channel).Run(request, timeout=120)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # the agent died mid-episode

    asyncio.run(first_run())
    assert marker.exists()
    model_pid = stack.kill("model/policy")
    stack.wait_for("model/policy", lambda s: s["pid"] not in (None, model_pid) and s["state"] == "serving")
    stack.wait_for("agent/kit", lambda s: s["state"] == "serving")

    async def retried() -> tuple[agent_pb.Trajectory, agent_pb.Trajectory, dict[str, int]]:
        async with Client(run_dir=run_dir) as client:
            got = await client.run(t, episode_id="mk", policy_version="p", agent="agent/kit", timeout=120)
            baseline = await client.run(t, episode_id="mk-plain", policy_version="p", agent="agent/plain", timeout=120)
            return got, baseline, await episode_stats(client, "mk")

    got, baseline, stats = asyncio.run(retried())
    assert stats == {"generated": 1, "replayed": 2, "recorded": 3}  # counted by the restarted model server
    assert got.reward == baseline.reward == 1.0
    assert outcome(got)["tool_calls"] == outcome(baseline)["tool_calls"]
    assert outcome(got)["tokens"] == outcome(baseline)["tokens"]
