"""Agent functions for the agent-kit tests, served with `--entrypoint tests.frontdoor.agents:NAME`."""

from __future__ import annotations

import os
import random
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
