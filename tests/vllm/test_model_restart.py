"""The reference trainer over real vLLM when the model server alone is SIGKILLed between iterations.

Its supervisor restarts it; the engine comes back with the weights it started from (`vllm:...`).
The trainer pushes its current weights again (read from the folder it saved, into the real engine)
and runs again the episodes those start weights made tokens for: no step trains on them. The
policy is a stand-in that pushes the model's own tensors under each new version (the loop is under
test here; `test_trainer.py` trains for real).
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from gymrpc.client import Client
from gymrpc.envs.counter import example_tasks_path
from gymrpc.rollouts.tasks import load_tasks
from gymrpc.train.loop import Progress, TrainConfig, Trainer
from gymrpc.weights import served_by_replica
from tests.train.test_restarts import AGENT, MODEL, StandInPolicy, stack_config
from tests.vllm.helpers import START_TIMEOUT, TEST_TIMEOUT, VllmStack, descendants, model_server_args

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT)]


def test_a_restarted_vllm_model_server_is_given_the_trainers_weights_again(counter_model: Path) -> None:
    config = stack_config(counter_model)
    model = next(s for s in config["servers"] if s["name"] == MODEL)
    model["args"] = model_server_args(counter_model)
    model["start_timeout"] = START_TIMEOUT
    stack = VllmStack(config)
    lines: list[str] = []

    def after_iteration(row: dict[str, Any]) -> None:
        if row["iteration"] == 0:  # the server and its engine process, as a crash of its container would
            pid = stack.server(MODEL)["pid"]
            for victim in [pid, *descendants(pid)]:
                os.kill(victim, signal.SIGKILL)
            stack.wait_until(lambda s: s["pid"] != pid and s["state"] == "serving", START_TIMEOUT, name=MODEL)

    trainer_config = TrainConfig(
        out=stack.run_dir / "out",
        iterations=3,
        tasks_per_batch=1,
        group_size=4,
        concurrency=4,
        max_lag=0,
        max_steps=8,
        agent=AGENT,
    )
    policy = StandInPolicy(counter_model)

    async def scenario() -> Trainer:
        async with Client(run_dir=stack.run_dir) as client:
            progress = Progress(lines.append, after_iteration)
            trainer = Trainer(trainer_config, client, policy, load_tasks(example_tasks_path())[:1], progress)
            outcome = await trainer.run()
            assert outcome.state.iteration == 3
            assert set((await served_by_replica(client, MODEL)).values()) == {"grpo:3"}
            return trainer

    try:
        trainer = asyncio.run(scenario())
    finally:
        logs = stack.logs()
        stack.stop()
    assert [len(batch) for batch in policy.trained] == [4, 4, 4], logs
    versions = {v for batch in policy.trained for sample in batch for v in sample.versions}
    assert versions
    assert all(v.startswith("grpo:") for v in versions), versions
    assert trainer.restores == 1
    restored = [line for line in lines if "pushing grpo:1 again" in line]
    assert len(restored) == 1, lines
    assert "serves 'vllm:" in restored[0]
