"""Session snapshots in the replies of `SeedSession`, `CallTool` and `Step` (`return_snapshot`).

The durable agent saves the session's snapshot at the seed and after every tool call or text turn.
A resources server that advertises `snapshot_in_replies` returns it in the call's own reply, so the
agent makes no `CheckpointSession` calls; one that does not (an older server) is asked separately.
Either way the saved snapshot is exactly the session's state right after its call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gymrpc.errors import FailedPrecondition
from gymrpc.servers.agent.durable import ResumeConfig
from gymrpc.servers.agent.service import AgentConfig, AgentServicer
from gymrpc.servers.resources.service import ResourcesServicer
from gymrpc.store import FilesystemEpisodeStore
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2
from gymrpc.v1 import resources_service_pb2 as resources_pb
from tests.agent.fakes import DirectStub, blackjack_resources, blackjack_tasks, counter_resources, fake_model
from tests.resume.helpers import POLICY, task
from tests.resume.nosnap_env import NoSnapshotEnvironment

SNAPSHOTTING = ("SeedSession", "CallTool", "Step")


class OldServer:
    """A resources server from before `snapshot_in_replies`: it neither advertises nor returns snapshots.

    `advertise=True` models a server that says it does but whose reply carries none (a replica of
    another version behind the same name): the agent must fall back all the same.
    """

    def __init__(self, target: DirectStub, *, advertise: bool = False) -> None:
        self.target, self.advertise = target, advertise

    def __getattr__(self, method: str) -> Callable[..., Any]:
        async def call(request: Any, *, timeout: float | None = None) -> Any:
            reply = await getattr(self.target, method)(request, timeout=timeout)
            if method == "GetSessionCheckpointing":
                reply.snapshot_in_replies = self.advertise
            elif method in SNAPSHOTTING:
                reply = type(reply).FromString(reply.SerializeToString())  # never touch a cached reply
                reply.ClearField("snapshot")
            return reply

        return call


def _agent(root: Path, resources: Any) -> AgentServicer:
    return AgentServicer(
        AgentConfig(resume=ResumeConfig()), resources, fake_model(), store=FilesystemEpisodeStore(root)
    )


def _request(t: common_pb2.Task, rollout_id: str = "ep") -> agent_pb.RunRequest:
    return agent_pb.RunRequest(task=t, policy_version=POLICY, episode_id=common_pb2.EpisodeId(rollout_id=rollout_id))


class Checked:
    """Forwards to `target` and, after each reply that carries a snapshot, exports the session directly
    (not through the counted stub) to check the snapshot is the session's state right then."""

    def __init__(self, target: DirectStub) -> None:
        self.target, self.checked = target, 0

    def __getattr__(self, method: str) -> Callable[..., Any]:
        async def call(request: Any, *, timeout: float | None = None) -> Any:
            reply = await getattr(self.target, method)(request, timeout=timeout)
            if method in SNAPSHOTTING and reply.HasField("snapshot"):
                now = await self.target.servicer.CheckpointSession(
                    resources_pb.CheckpointSessionRequest(session_id=request.session_id, episode_id=request.episode_id),
                    None,
                )
                assert reply.snapshot == now.snapshot
                self.checked += 1
            return reply

        return call


@pytest.mark.parametrize(
    ("resources", "tasks"),
    [(counter_resources, lambda: [task(i) for i in range(5)]), (blackjack_resources, blackjack_tasks)],
)
def test_a_new_resources_server_returns_the_snapshots_and_the_agent_makes_no_checkpoint_session_calls(
    tmp_path: Path, resources: Callable[[], DirectStub], tasks: Callable[[], list[common_pb2.Task]]
) -> None:
    stub = resources()
    checked = Checked(stub)
    agent = _agent(tmp_path, checked)

    async def main() -> list[agent_pb.Trajectory]:
        return [(await agent.Run(_request(t, f"ep{i}"), None)).trajectory for i, t in enumerate(tasks())]  # type: ignore[arg-type]

    trajectories = asyncio.run(main())
    methods = stub.methods()
    assert "CheckpointSession" not in methods
    asked = [request for name, request in stub.calls if name in SNAPSHOTTING]
    assert asked
    assert all(request.return_snapshot for request in asked)
    assert checked.checked == len(asked)  # every reply carried the state right after its call
    if resources is counter_resources:
        assert [t.reward for t in trajectories] == [1.0] * 5


@pytest.mark.parametrize("advertise", [False, True])
def test_the_agent_falls_back_to_checkpoint_session_against_a_server_without_snapshots_in_replies(
    tmp_path: Path, advertise: bool
) -> None:
    stub = counter_resources()
    agent = _agent(tmp_path, OldServer(stub, advertise=advertise))
    trajectory = asyncio.run(agent.Run(_request(task(0)), None)).trajectory  # type: ignore[arg-type]
    assert trajectory.reward == 1.0
    methods = stub.methods()
    boundaries = methods.count("SeedSession") + methods.count("CallTool")
    assert methods.count("CheckpointSession") == boundaries > 1  # one per seed and tool call, as before
    asked = [request.return_snapshot for name, request in stub.calls if name in SNAPSHOTTING]
    assert asked == [advertise] * len(asked)  # an old server is not even asked


def test_a_resumed_episode_saves_the_snapshots_of_the_replies_and_ends_as_an_uninterrupted_one(tmp_path: Path) -> None:
    """A run that died after its first tool call resumes from the snapshot that call's reply carried."""
    stub = counter_resources()

    class DieAfterFirstTool:
        def __init__(self) -> None:
            self.tools = 0

        def __getattr__(self, method: str) -> Callable[..., Any]:
            async def call(request: Any, *, timeout: float | None = None) -> Any:
                if method == "CallTool":
                    self.tools += 1
                    if self.tools == 2:
                        raise FailedPrecondition("the agent dies here", reason="SESSION_CLOSED")
                return await getattr(stub, method)(request, timeout=timeout)

            return call

    async def main() -> agent_pb.Trajectory:
        with pytest.raises(FailedPrecondition):
            await _agent(tmp_path, DieAfterFirstTool()).Run(_request(task(0)), None)  # type: ignore[arg-type]
        return (await _agent(tmp_path, stub).Run(_request(task(0)), None)).trajectory  # type: ignore[arg-type]

    trajectory = asyncio.run(main())
    assert (trajectory.resume_count, trajectory.reward) == (1, 1.0)
    assert "CheckpointSession" not in stub.methods()


# -- the resources server's side ---------------------------------------------------------------------


def _seed(servicer: ResourcesServicer, *, snapshot: bool) -> resources_pb.SeedSessionResponse:
    request = resources_pb.SeedSessionRequest(
        session_id="s", episode_id=common_pb2.EpisodeId(rollout_id="ep"), task=task(0), return_snapshot=snapshot
    )
    return asyncio.run(servicer.SeedSession(request, None))  # type: ignore[arg-type]


def _call(servicer: ResourcesServicer, call_id: str, count: int, *, snapshot: bool = True) -> Any:
    call = common_pb2.ToolCall(id=call_id, name="increment_counter", arguments_json=f'{{"count": {count}}}')
    request = resources_pb.CallToolRequest(
        session_id="s", episode_id=common_pb2.EpisodeId(rollout_id="ep"), call=call, return_snapshot=snapshot
    )
    return asyncio.run(servicer.CallTool(request, None))  # type: ignore[arg-type]


def _state(servicer: ResourcesServicer) -> common_pb2.SessionSnapshot:
    request = resources_pb.CheckpointSessionRequest(session_id="s", episode_id=common_pb2.EpisodeId(rollout_id="ep"))
    return asyncio.run(servicer.CheckpointSession(request, None)).snapshot  # type: ignore[arg-type]


def test_a_retried_call_gets_the_state_after_it_or_a_clear_refusal_never_a_later_state() -> None:
    servicer = counter_resources().servicer
    seeded = _seed(servicer, snapshot=True)
    assert seeded.snapshot == _state(servicer)
    assert _seed(servicer, snapshot=True) == seeded  # a retried seed: the same reply, the same state
    assert not _seed(servicer, snapshot=False).HasField("snapshot")

    first = _call(servicer, "c1", 2)
    assert first.snapshot == _state(servicer) != seeded.snapshot
    assert _call(servicer, "c1", 2) == first  # de-duplicated: nothing ran again, the same snapshot
    assert not _call(servicer, "c1", 2, snapshot=False).HasField("snapshot")

    second = _call(servicer, "c2", 3)
    assert second.snapshot == _state(servicer) != first.snapshot
    with pytest.raises(FailedPrecondition, match="changed after call 'c1'"):
        _call(servicer, "c1", 2)  # the state right after c1 is gone: refused, not answered with c2's
    with pytest.raises(FailedPrecondition, match="changed after its seed"):
        _seed(servicer, snapshot=True)
    assert _state(servicer) == second.snapshot  # the refusals changed nothing


def test_a_text_turn_returns_the_state_after_it() -> None:
    servicer = blackjack_resources().servicer
    episode = common_pb2.EpisodeId(rollout_id="bj")
    seed = resources_pb.SeedSessionRequest(
        session_id="s", episode_id=episode, task=blackjack_tasks()[0], return_snapshot=True
    )
    turn = resources_pb.StepRequest(
        session_id="s",
        episode_id=episode,
        turn_id="turn_0",
        message=common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, content="stand"),
        return_snapshot=True,
    )
    export = resources_pb.CheckpointSessionRequest(session_id="s", episode_id=episode)

    async def main() -> tuple[Any, ...]:
        seeded = await servicer.SeedSession(seed, None)  # type: ignore[arg-type]
        stepped = await servicer.Step(turn, None)  # type: ignore[arg-type]
        now = await servicer.CheckpointSession(export, None)  # type: ignore[arg-type]
        again = await servicer.Step(turn, None)  # type: ignore[arg-type]
        return seeded, stepped, now, again

    seeded, stepped, now, again = asyncio.run(main())
    assert stepped.snapshot == now.snapshot != seeded.snapshot
    assert again == stepped


def test_return_snapshot_on_an_environment_without_snapshots_is_refused_before_the_call_runs() -> None:
    servicer = ResourcesServicer(NoSnapshotEnvironment(), workers=1)
    episode = common_pb2.EpisodeId(rollout_id="ep")
    seed = resources_pb.SeedSessionRequest(session_id="s", episode_id=episode, task=task(0))
    call = common_pb2.ToolCall(id="c1", name="tally", arguments_json="{}")

    async def main() -> str:
        await servicer.SeedSession(seed, None)  # type: ignore[arg-type]
        asked = resources_pb.CallToolRequest(session_id="s", episode_id=episode, call=call, return_snapshot=True)
        with pytest.raises(FailedPrecondition) as caught:
            await servicer.CallTool(asked, None)  # type: ignore[arg-type]
        assert caught.value.reason == "SNAPSHOT_UNSUPPORTED"
        plain = resources_pb.CallToolRequest(session_id="s", episode_id=episode, call=call)
        return (await servicer.CallTool(plain, None)).output  # type: ignore[arg-type]

    assert asyncio.run(main()) == "1"  # the refused call never ran
    probe = asyncio.run(servicer.GetSessionCheckpointing(resources_pb.GetSessionCheckpointingRequest(), None))  # type: ignore[arg-type]
    assert not probe.snapshot_in_replies
