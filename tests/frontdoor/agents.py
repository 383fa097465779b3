"""Agent functions for the agent-kit tests, served with `--entrypoint tests.frontdoor.agents:NAME`."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path
from typing import Any

from gymrpc.agentkit import Episode
from gymrpc.agentkit.examples.react import solve


async def not_deterministic(episode: Episode) -> list[dict[str, Any]]:
    """The ReAct agent with its process id in a system message: a retried run asks something else."""
    episode.messages = [{"role": "system", "content": f"You run in process {os.getpid()}."}, *episode.messages]
    return await solve(episode)


async def picks_its_own_arguments(episode: Episode) -> str:
    """Increments by an amount it draws itself: a retried run sends another call under the same id (`kit_0`)."""
    await episode.call_tool("increment_counter", {"count": random.randint(1, 10**9)})
    return await episode.call_tool("get_counter_value", {})


_GATES_PASSED: set[str] = set()


async def waits_at_a_gate(episode: Episode) -> str:
    """Adds 2, then meets the test at two FIFOs of `$GYMRPC_TEST_GATE`: writes `reached` (the session
    holds 2) and reads `gate` (the test writes it once it has restarted the resources server); then
    adds 3 and reads the count. A second run of the episode in this process passes straight on."""
    folder = Path(os.environ["GYMRPC_TEST_GATE"])
    await episode.call_tool("increment_counter", {"count": 2})
    if episode.episode_id not in _GATES_PASSED:
        _GATES_PASSED.add(episode.episode_id)
        await asyncio.to_thread((folder / "reached").write_bytes, b"1")  # opens once the test reads
        await asyncio.to_thread((folder / "gate").read_bytes)  # returns once the test has written
    await episode.call_tool("increment_counter", {"count": 3})
    return await episode.call_tool("get_counter_value", {})
