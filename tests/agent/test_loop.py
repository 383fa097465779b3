"""The episode loop against in-process stubs: every stop reason, tool errors, text turns, phases."""

from __future__ import annotations

import asyncio
import json

import pytest

from gymrpc.errors import InvalidArgument, NotFound, Unavailable
from gymrpc.servers.agent.loop import NO_NAME_ERROR, EpisodeLoop
from gymrpc.servers.agent.state import MAX_ID_LEN, EpisodeState, Phase, session_id_for
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2
from tests.agent.fakes import (
    ASSISTANT,
    TOOL,
    USER,
    DirectStub,
    EndlessTextEnv,
    ScriptedModel,
    blackjack_resources,
    blackjack_tasks,
    counter_resources,
    counter_task,
    counter_tasks,
    fake_model,
    reply,
)

LENGTH, TOOL_CALLS = common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_TOOL_CALLS


def _loop(resources: object, model: object) -> EpisodeLoop:
    return EpisodeLoop(resources, model, resources_name="resources/counter", model_name="model/policy")


def _run(
    resources: object,
    model: object,
    task: common_pb2.Task,
    *,
    max_steps: int = 8,
    text_turns: bool = False,
    rollout_id: str = "r1",
) -> agent_pb.Trajectory:
    state = EpisodeState(rollout_id, 0, task, max_steps, text_turns=text_turns)
    return asyncio.run(_loop(resources, model).run(state))


def _sessions(stub: DirectStub) -> int:
    return len(stub.servicer.host)


def test_counter_task_walks_every_boundary_and_earns_the_reward() -> None:
    resources, model = counter_resources(), fake_model()
    state = EpisodeState("r1", 0, counter_tasks()[0], 8)

    async def walk() -> list[tuple[Phase, int, int]]:
        return [(state.phase, state.step, state.next_tool_index) async for _ in _loop(resources, model).steps(state)]

    seen = asyncio.run(walk())
    model_step, tool_step = Phase.READY_FOR_TOOL, Phase.READY_FOR_MODEL
    assert seen == [
        (Phase.READY_FOR_MODEL, 0, 0),
        (model_step, 1, 0),
        (tool_step, 1, 0),
        (model_step, 2, 0),
        (tool_step, 2, 0),
        (model_step, 3, 0),
        (tool_step, 3, 0),
        (Phase.READY_FOR_VERIFY, 4, 0),
        (Phase.COMPLETED, 4, 0),
    ]
    t = state.trajectory()
    assert (t.reward, t.stop_reason, t.steps, t.task_id) == (1.0, agent_pb.STOP_REASON_FINAL_ANSWER, 4, "0")
    assert json.loads(t.verify_details_json) == {"count": 6, "expected_count": 6}
    assert [m.role for m in t.messages] == [
        USER,
        ASSISTANT,
        TOOL,
        ASSISTANT,
        TOOL,
        ASSISTANT,
        TOOL,
        ASSISTANT,
    ]
    assert [r.step for r in t.model_calls] == [0, 1, 2, 3]
    assert [(r.step, r.call.name, r.is_error) for r in t.tool_calls] == [
        (0, "increment_counter", False),
        (1, "increment_counter", False),
        (2, "get_counter_value", False),
    ]
    assert t.tool_calls[2].output == '{"count": 6}'
    into = agent_pb.Trajectory()
    assert state.trajectory(into=into) is into  # filled in place (a durable record's final_result)
    assert into.SerializeToString(deterministic=True) == t.SerializeToString(deterministic=True)
    tool_message = t.messages[6]
    assert (tool_message.tool_call_id, tool_message.name, tool_message.content) == (
        "fake_2",
        "get_counter_value",
        '{"count": 6}',
    )
    assert [r.request_id for _, r in model.calls] == [f"r1/a0/step{k}" for k in range(4)]
    assert all(r.episode_id.rollout_id == "r1" and len(r.tools) == 2 for _, r in model.calls)
    assert t.model_calls[0].tokens.completion_token_ids
    assert t.model_calls[0].weight_version == "fake:0"
    assert t.usage.input_tokens == sum(len(r.tokens.prompt_token_ids) for r in t.model_calls)
    assert t.timing.total.ToNanoseconds() > 0
    assert t.policy_version == "fake:0"
    assert resources.methods()[0] == "SeedSession"
    assert resources.methods()[-2:] == ["Verify", "CloseSession"]
    assert _sessions(resources) == 0


def test_max_steps_stops_after_the_last_steps_tools_ran() -> None:
    resources = counter_resources()
    t = _run(resources, fake_model(), counter_tasks()[0], max_steps=2)
    assert (t.stop_reason, t.steps, len(t.tool_calls)) == (agent_pb.STOP_REASON_MAX_STEPS, 2, 2)
    assert t.reward == 1.0  # both increments ran; the counter grades the state, not the answer
    assert t.messages[-1].role == TOOL
    assert _sessions(resources) == 0


def test_length_stops_without_running_the_cut_off_tool_calls() -> None:
    model = ScriptedModel(reply(calls=[("c1", "increment_counter", '{"count": 3}')], finish=LENGTH))
    t = _run(counter_resources(), model, counter_tasks()[0])
    assert (t.stop_reason, t.steps, len(t.tool_calls)) == (agent_pb.STOP_REASON_LENGTH, 1, 0)
    assert t.messages[-1].tool_calls[0].name == "increment_counter"
    assert t.model_calls[0].finish_reason == LENGTH


@pytest.mark.parametrize("response", [reply(""), reply("  \n"), reply(reasoning="thinking only")])
def test_empty_output_stops_the_loop(response: object) -> None:
    t = _run(counter_resources(), ScriptedModel(response), counter_tasks()[0])  # type: ignore[arg-type]
    assert (t.stop_reason, t.steps, t.reward) == (agent_pb.STOP_REASON_EMPTY_OUTPUT, 1, 0.0)


def test_final_answer_without_tool_calls() -> None:
    t = _run(counter_resources(), ScriptedModel(reply("no tools needed")), counter_tasks()[0])
    assert (t.stop_reason, t.steps, t.messages[-1].content) == (
        agent_pb.STOP_REASON_FINAL_ANSWER,
        1,
        "no tools needed",
    )


def test_tool_errors_go_back_to_the_model_and_the_episode_goes_on() -> None:
    task = counter_task("[fake:unknown-tool] [fake:bad-args] [fake:nameless] add 2 then get the count", 1, 3)
    resources = counter_resources()
    t = _run(resources, fake_model(), task)
    errors = [(r.call.name, r.is_error) for r in t.tool_calls]
    assert errors[:3] == [("no_such_tool", True), ("increment_counter", True), ("", True)]
    assert "unknown tool 'no_such_tool'" in t.tool_calls[0].output
    assert "not valid JSON" in t.tool_calls[1].output
    assert t.tool_calls[2].output == NO_NAME_ERROR
    assert [m.content for m in t.messages if m.role == TOOL][:3] == [r.output for r in t.tool_calls[:3]]
    assert (t.reward, t.stop_reason) == (1.0, agent_pb.STOP_REASON_FINAL_ANSWER)
    assert "CallTool" in resources.methods()


def test_parallel_tool_calls_run_in_order_with_next_tool_index() -> None:
    both = reply(calls=[("a", "increment_counter", '{"count": 1}'), ("b", "increment_counter", '{"count": 2}')])
    model = ScriptedModel(both, reply("done"))
    state = EpisodeState("r1", 0, counter_tasks()[0], 8)

    async def walk() -> list[tuple[Phase, int]]:
        return [(state.phase, state.next_tool_index) async for _ in _loop(counter_resources(), model).steps(state)]

    assert asyncio.run(walk())[1:4] == [
        (Phase.READY_FOR_TOOL, 0),
        (Phase.READY_FOR_TOOL, 1),
        (Phase.READY_FOR_MODEL, 0),
    ]
    assert state.trajectory().reward == 1.0


def test_missing_or_repeated_tool_call_ids_are_made_unique() -> None:
    same = reply(calls=[("call_0", "increment_counter", '{"count": 1}'), ("", "increment_counter", '{"count": 1}')])
    model = ScriptedModel(same, reply(calls=[("call_0", "increment_counter", '{"count": 1}')]), reply("done"))
    t = _run(counter_resources(), model, counter_task("x", 0, 3))
    assert [r.call.id for r in t.tool_calls] == ["call_0", "call_0_1", "call_1_0"]
    assert [m.tool_call_id for m in t.messages if m.role == TOOL] == ["call_0", "call_0_1", "call_1_0"]
    assert t.reward == 1.0  # the third increment ran instead of replaying the first one's result


def test_a_retried_run_that_replays_repeats_the_earlier_runs_calls_and_goes_on() -> None:
    resources, task = counter_resources(), counter_task("x", 0, 3)
    add = reply(calls=[("a", "increment_counter", '{"count": 3}')])
    first = EpisodeState("r1", 0, task, 8)

    async def main() -> agent_pb.Trajectory:
        loop = _loop(resources, ScriptedModel(add))
        for _ in range(3):  # seed, model call, tool call: then the process dies (nothing is closed)
            await loop.advance(first)
        return await _loop(resources, ScriptedModel(add, reply("done"))).run(EpisodeState("r1", 0, task, 8))

    t = asyncio.run(main())
    assert (t.reward, t.restart_count) == (1.0, 0)  # the increment ran once
    assert "DiscardSession" not in resources.methods()


def test_a_retried_run_that_goes_another_way_starts_over_in_a_fresh_session() -> None:
    resources, task = counter_resources(), counter_task("x", 0, 3)
    first = EpisodeState("r1", 0, task, 8)
    add = reply(calls=[("b", "increment_counter", '{"count": 3}')])
    retried = ScriptedModel(add, add, reply("done"))  # the earlier run's generation is gone: another one

    async def main() -> agent_pb.Trajectory:
        loop = _loop(resources, ScriptedModel(reply(calls=[("a", "increment_counter", '{"count": 2}')])))
        for _ in range(3):  # seed, model call, tool call (+2): then the process dies
            await loop.advance(first)
        return await _loop(resources, retried).run(EpisodeState("r1", 0, task, 8))

    t = asyncio.run(main())
    assert (t.reward, t.restart_count) == (1.0, 1)  # 3, not 2 + 3: the earlier run's session was dropped
    assert [r.call.id for r in t.tool_calls] == ["b"]
    assert resources.methods().count("DiscardSession") == 1
    ids = [r.request_id for r in retried.requests]
    assert ids[0] == "r1/a0/step0"
    assert ids[1].startswith("r1/a0/step0/")  # the fresh run's own request ids
    assert ids[2] == ids[1].replace("step0", "step1")


def restarted(resources: DirectStub) -> None:
    """The resources server behind `resources` restarted: every session it held is gone."""
    resources.servicer = counter_resources().servicer


def test_a_session_lost_mid_episode_starts_the_episode_over_once() -> None:
    resources, task = counter_resources(), counter_task("x", 0, 5)
    add, more = (
        reply(calls=[("a", "increment_counter", '{"count": 2}')]),
        reply(calls=[("b", "increment_counter", '{"count": 3}')]),
    )
    model = ScriptedModel(add, more, add, more, reply("done"))
    state = EpisodeState("r1", 0, task, 8)

    async def main() -> agent_pb.Trajectory:
        loop = _loop(resources, model)
        for _ in range(4):  # seed, model call, tool call (+2), model call: then the server restarts
            await loop.advance(state)
        restarted(resources)
        return await loop.run(state)  # its next tool call finds no session

    t = asyncio.run(main())
    assert (t.reward, t.restart_count) == (1.0, 1)  # 2 + 3 in the fresh session, nothing of the lost one
    assert [r.call.id for r in t.tool_calls] == ["a", "b"]
    assert resources.methods().count("SeedSession") == 2
    assert model.requests[2].request_id.startswith("r1/a0/step0/")  # the fresh run's own request ids

    lost_twice = ScriptedModel(add, add, add, add)
    state = EpisodeState("r2", 0, task, 8)

    async def again() -> None:
        loop = _loop(resources, lost_twice)
        for _ in range(3):
            await loop.advance(state)
        restarted(resources)
        async for _ in loop.steps(state):
            if state.restart_count and state.phase is Phase.READY_FOR_TOOL:
                restarted(resources)  # and once more, in the fresh run: a crash loop

    with pytest.raises(NotFound) as caught:
        asyncio.run(again())
    assert caught.value.metadata["session_id"] == state.session_id


def test_text_turns_go_to_step_until_terminated() -> None:
    resources = blackjack_resources()
    t = _run(resources, fake_model(), blackjack_tasks(seed=7)[0], text_turns=True)
    assert [m.role for m in t.messages] == [common_pb2.ROLE_SYSTEM, USER, USER, ASSISTANT]
    assert t.messages[2].content.startswith("Your hand:")  # the seed's opening observation
    assert "<action>stand</action>" in t.messages[3].content
    assert (t.stop_reason, t.steps, len(t.tool_calls)) == (agent_pb.STOP_REASON_FINAL_ANSWER, 1, 0)
    assert t.reward in (-1.0, 0.0, 1.0)
    assert json.loads(t.verify_details_json)["result"] != "unfinished"
    step = next(r for m, r in resources.calls if m == "Step")
    assert (step.turn_id, step.message.role) == ("turn_0", ASSISTANT)
    assert _sessions(resources) == 0


def test_text_turns_stop_at_max_steps_and_on_truncation() -> None:
    env = EndlessTextEnv()
    t = _run(env, ScriptedModel(reply("<action>hit</action>")), counter_tasks()[0], max_steps=3, text_turns=True)
    assert (t.stop_reason, t.steps, env.turns, t.reward) == (agent_pb.STOP_REASON_MAX_STEPS, 3, 3, 0.5)
    assert t.messages[1].role == USER  # an observation without a role is treated as user text
    assert env.closed
    env = EndlessTextEnv(truncate_at=2)
    t = _run(env, ScriptedModel(reply("<action>hit</action>")), counter_tasks()[0], max_steps=8, text_turns=True)
    assert (t.stop_reason, t.steps) == (agent_pb.STOP_REASON_MAX_STEPS, 2)


def test_downstream_errors_keep_their_class_and_name_the_call() -> None:
    task = counter_tasks()[0]
    task.env_json = json.dumps({"initial_count": 1})
    with pytest.raises(InvalidArgument) as caught:
        _run(counter_resources(), fake_model(), task)
    assert caught.value.message.startswith("resources/counter SeedSession: task rejected by counter")
    assert caught.value.metadata["method"] == "SeedSession"


def test_a_failed_episode_closes_its_session_in_the_background() -> None:
    class Down:
        async def Generate(self, request: object, *, timeout: float | None = None) -> object:
            raise Unavailable("no backend", reason="BACKEND_FAILURE")

    resources = counter_resources()

    async def scenario() -> None:
        with pytest.raises(Unavailable) as caught:
            await _loop(resources, Down()).run(EpisodeState("r1", 0, counter_tasks()[0], 8))
        assert caught.value.message == "model/policy Generate: no backend"
        assert caught.value.reason == "BACKEND_FAILURE"
        await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert resources.methods() == ["SeedSession", "CloseSession"]
    assert _sessions(resources) == 0


def test_derived_ids_fit_the_id_pattern() -> None:
    assert session_id_for("r1", 2) == "r1-a2"
    long = session_id_for("x" * 128, 4294967295)
    assert len(long) <= MAX_ID_LEN
    assert long.endswith("-a4294967295")
    assert long != session_id_for("x" * 127 + "y", 4294967295)
    state = EpisodeState("r1", 3, counter_tasks()[0], 8, policy_version="iteration:7")
    assert (state.session_id, state.request_id(5), state.label) == ("r1-a3", "r1/a3/step5", "r1/a3")
    assert state.trajectory().policy_version == "iteration:7"
    with pytest.raises(ValueError, match="not a valid id"):
        EpisodeState("../etc", 0, counter_tasks()[0], 8)
