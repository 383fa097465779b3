"""Token fields of real trajectories: every model call's prompt extends the previous prompt and completion."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import gymrpc.envs.counter
from gymrpc.client import Client
from gymrpc.rollouts import collect, load_tasks

STACK = {
    "servers": [
        {"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}},
        {"name": "model/policy", "role": "model", "args": {"policy": "counter"}},
        {"name": "agent/simple", "role": "agent", "args": {"resources": "resources/counter", "model": "model/policy"}},
    ]
}


def test_each_prompt_begins_with_the_previous_prompt_and_completion(start_stack: Any) -> None:
    stack = start_stack(STACK)

    async def main() -> list[Any]:
        async with Client(run_dir=stack.run_dir) as client:
            return await collect(client, load_tasks(gymrpc.envs.counter.example_tasks_path()), agent="agent/simple")

    results = asyncio.run(main())
    assert results
    for result in results:
        calls = result.trajectory.model_calls
        assert len(calls) >= 3  # increments, read, answer: several turns to compare
        for before, after in itertools.pairwise(calls):
            prefix = [*before.tokens.prompt_token_ids, *before.tokens.completion_token_ids]
            assert list(after.tokens.prompt_token_ids[: len(prefix)]) == prefix
            assert len(after.tokens.prompt_token_ids) > len(prefix)  # the tool results were appended
        for call in calls:
            assert call.tokens.completion_token_ids
            assert len(call.tokens.completion_logprobs) == len(call.tokens.completion_token_ids)
            assert call.weight_version
