"""Counter sessions driven straight against a replicated resources name, and the affinity checks on them.

A resources replica keeps its sessions in memory, so a call that reached any replica but the
one holding its session fails with NOT_FOUND ("does not exist on this server"). Sessions that
end with the right count therefore saw every call reach their replica; a session whose replica
was killed must show a failover *before* its NOT_FOUND.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from gymrpc.client import Client
from gymrpc.errors import GymrpcError, NotFound
from gymrpc.v1 import common_pb2
from gymrpc.v1 import resources_service_pb2 as pb
from tests.resume.helpers import task


@dataclass
class Outcome:
    session: str
    first: str
    """Endpoint id the session was placed on."""
    last: str | None
    failovers: int
    count: int | None = None
    expected: int | None = None
    error: GymrpcError | None = None


async def drive(
    client: Client,
    name: str,
    sessions: int,
    *,
    increments: int = 4,
    pause: float = 0.2,
    after_first: Callable[[], Awaitable[None]] | None = None,
) -> list[Outcome]:
    """Run `sessions` counter sessions concurrently; `after_first` runs once every session made its first call."""
    stub: Any = client.resources(name)
    barrier = asyncio.Barrier(sessions + 1)

    async def one(i: int) -> Outcome:
        session = f"sess-{i}"
        episode = common_pb2.EpisodeId(rollout_id=f"ep-{i}")
        await stub.SeedSession(pb.SeedSessionRequest(session_id=session, episode_id=episode, task=task(i)))
        outcome = Outcome(session, client.balancer.endpoint_of(name, session) or "?", None, 0)
        start = await _value(stub, session, episode, "call_start")
        try:
            for j in range(increments):
                call = common_pb2.ToolCall(id=f"call_{j}", name="increment_counter", arguments_json='{"count": 1}')
                await stub.CallTool(pb.CallToolRequest(session_id=session, episode_id=episode, call=call), timeout=30)
                if j == 0:
                    await barrier.wait()
                await asyncio.sleep(pause)
            outcome.count, outcome.expected = await _value(stub, session, episode, "call_end"), start + increments
            await stub.CloseSession(pb.CloseSessionRequest(session_id=session, episode_id=episode))
        except NotFound as exc:
            outcome.error = exc
            if j == 0:  # never reached the barrier: let the others go on
                await barrier.wait()
        outcome.last = client.balancer.endpoint_of(name, session)
        outcome.failovers = client.balancer.failovers(name, session)
        return outcome

    async def trigger() -> None:
        await barrier.wait()
        if after_first is not None:
            await after_first()

    *outcomes, _ = await asyncio.gather(*(one(i) for i in range(sessions)), trigger())
    return outcomes


async def _value(stub: Any, session: str, episode: common_pb2.EpisodeId, call_id: str) -> int:
    call = common_pb2.ToolCall(id=call_id, name="get_counter_value", arguments_json="{}")
    reply = await stub.CallTool(pb.CallToolRequest(session_id=session, episode_id=episode, call=call), timeout=30)
    return int(json.loads(reply.output)["count"])


def check_affinity(outcomes: list[Outcome], replicas: int, killed: str | None) -> None:
    """Every session stayed on its replica; only sessions of the killed one moved, once, and then
    found their state gone on the replica they moved to (not on the one they came from)."""
    assert {o.first for o in outcomes} == {str(i) for i in range(replicas)}, "sessions did not spread"
    for o in outcomes:
        if o.first != killed:
            assert (o.error, o.failovers, o.last, o.count) == (None, 0, o.first, o.expected), o
        else:
            assert o.failovers == 1, o
            assert o.last not in (None, killed), o
            assert isinstance(o.error, NotFound), o
            assert "does not exist on this server" in o.error.message, o
