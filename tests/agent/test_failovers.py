"""`Trajectory.failovers` counts the moves of every process that ran the episode, across checkpoints.

An agent learns its moves from its own client's balancer, which a crash takes with it: the count
travels in the episode's checkpointed state (`EpisodeCheckpoint.failovers`), for a run resumed from
its per-episode store (`--resume-dir`) and for a coordinated checkpoint restored elsewhere alike.
Here a scripted "client" decides which calls moved; everything else is the real agent code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gymrpc.errors import Unavailable
from gymrpc.servers.agent.checkpoint import fingerprint, restore_state
from gymrpc.servers.agent.durable import ResumeConfig
from gymrpc.servers.agent.loop import EpisodeLoop
from gymrpc.servers.agent.participant import boundary_record
from gymrpc.servers.agent.service import AgentConfig, AgentServicer
from gymrpc.servers.agent.state import EpisodeState, Phase
from gymrpc.store import EpisodeCheckpoint, FilesystemEpisodeStore
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2
from tests.agent.fakes import counter_resources, fake_model
from tests.resume.helpers import POLICY, task


class ProcessClient:
    """One agent process's client: which calls it moved to another replica, and its count of them.

    `moves` lists methods whose next call moves (each entry once), as the balancer counts it.
    """

    def __init__(self, *moves: str) -> None:
        self.moves, self.count = list(moves), 0

    def stub(self, target: Any) -> Any:
        client = self

        class Stub:
            def __getattr__(self, method: str) -> Callable[..., Any]:
                async def call(request: Any, *, timeout: float | None = None) -> Any:
                    if method in client.moves:
                        client.moves.remove(method)
                        client.count += 1
                    return await getattr(target, method)(request, timeout=timeout)

                return call

        return Stub()

    def failovers(self, state: EpisodeState) -> int:
        return self.count


class FailOnCall:
    """A stub whose `n`th call of `method` fails with UNAVAILABLE (every replica died mid-call)."""

    def __init__(self, target: Any, method: str, n: int) -> None:
        self.target, self.method, self.n, self.calls = target, method, n, 0

    def __getattr__(self, method: str) -> Callable[..., Any]:
        async def call(request: Any, *, timeout: float | None = None) -> Any:
            if method == self.method:
                self.calls += 1
                if self.calls == self.n:
                    raise Unavailable(f"{method}: every replica is gone")
            return await getattr(self.target, method)(request, timeout=timeout)

        return call


def servicer(root: Path, client: ProcessClient, resources: Any, model: Any) -> AgentServicer:
    return AgentServicer(
        AgentConfig(resume=ResumeConfig()),
        client.stub(resources),
        client.stub(model),
        store=FilesystemEpisodeStore(root),
        failovers=client.failovers,
    )


def request() -> agent_pb.RunRequest:
    return agent_pb.RunRequest(
        task=task(0), policy_version=POLICY, episode_id=common_pb2.EpisodeId(rollout_id="ep", attempt=0)
    )


@pytest.mark.parametrize("same_process", [False, True])
def test_a_run_resumed_from_its_store_reports_the_moves_before_and_after_the_crash(
    tmp_path: Path, same_process: bool
) -> None:
    """The seed and the first model call moved, the second model call failed; the next run moves its
    `RestoreSession` and a model call. A later run in the same process must not count the first
    run's moves twice (its client still holds them)."""
    resources, model = counter_resources(), fake_model()
    first = ProcessClient("SeedSession", "Generate")

    async def main() -> tuple[agent_pb.Trajectory, agent_pb.Trajectory]:
        crashed = servicer(tmp_path, first, resources, FailOnCall(model, "Generate", 2))
        with pytest.raises(Unavailable):
            await crashed.Run(request(), None)  # type: ignore[arg-type]
        assert first.count == 2
        second = first if same_process else ProcessClient()
        second.moves = ["RestoreSession", "Generate"]
        resumed = servicer(tmp_path, second, resources, model)
        trajectory = (await resumed.Run(request(), None)).trajectory  # type: ignore[arg-type]
        again = (await resumed.Run(request(), None)).trajectory  # type: ignore[arg-type]
        return trajectory, again

    trajectory, cached = asyncio.run(main())
    assert (trajectory.resume_count, trajectory.reward) == (1, 1.0)
    assert trajectory.failovers == 4
    assert cached == trajectory  # the completed record keeps the count


def test_a_coordinated_checkpoint_carries_the_moves_to_the_restored_attempt() -> None:
    """The agent participant exports `EpisodeState` at its boundary; the restored attempt, in another
    process with a client that counted nothing yet, adds its own moves to those."""
    resources, model = counter_resources(), fake_model()
    before, after = ProcessClient("SeedSession", "Generate"), ProcessClient("Generate", "CallTool")

    async def main() -> agent_pb.Trajectory:
        state = EpisodeState("ep", 0, task(0), 8)
        loop = EpisodeLoop(before.stub(resources), before.stub(model), failovers=before.failovers)
        while not (state.phase is Phase.READY_FOR_MODEL and state.step == 1):
            await loop.advance(state)
        assert state.failovers == 2
        record = EpisodeCheckpoint.FromString(boundary_record(state, fingerprint(state.task)).SerializeToString())
        assert record.failovers == 2

        # Attempt 0 again: the resources servicer (the same one, its session still live) is not
        # restored, so the session still belongs to attempt 0; the count is what is under test.
        restored = EpisodeState("ep", 0, task(0), 8)
        restore_state(restored, record, snapshot=False)
        assert (restored.failovers, restored.failovers_seen) == (2, None)
        again = EpisodeLoop(after.stub(resources), after.stub(model), failovers=after.failovers)
        return await again.run(restored)

    trajectory = asyncio.run(main())
    assert trajectory.reward == 1.0
    assert trajectory.failovers == 4
