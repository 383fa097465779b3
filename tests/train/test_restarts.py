"""The reference trainer through SIGKILLs of the servers it drives. A model server SIGKILLed mid-run
comes back with the weights it started from: the trainer notices (its episodes' tokens name weights
it never pushed), pushes its current weights to that replica again, and runs those episodes again,
so no step trains on another policy's tokens.

Real processes (`gymrpc up`: counter resources, scripted model, the built-in agent; the launcher
restarts what dies); the trainer runs in this process with a stand-in policy (no torch: the loop's
bookkeeping is under test, not the arithmetic).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from gymrpc.client import Client
from gymrpc.envs.counter import example_tasks_path
from gymrpc.rollouts.tasks import load_tasks
from gymrpc.testing.safetensors_files import write_safetensors
from gymrpc.train.loop import Progress, TrainConfig, Trainer
from gymrpc.train.policy import StepStats
from gymrpc.train.samples import Sample
from gymrpc.weights import served_by_replica
from tests.model.test_weights import TENSORS

ROOT = Path(__file__).resolve().parents[2]
MODEL = "model/policy"
AGENT = "agent/simple"


def stack_config(weights: Path) -> dict[str, Any]:
    return {
        "restart": {"max_restarts": 5, "window_seconds": 60, "backoff_seconds": 0.05},
        "servers": [
            {"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}},
            {"name": MODEL, "role": "model", "args": {"policy": "counter", "weights": str(weights)}},
            {"name": AGENT, "role": "agent", "args": {"resources": "resources/counter", "model": MODEL}},
        ],
    }


def start_weights(run_dir: Path) -> Path:
    """The scripted model server's `--weights` (the tensors every pushed folder must match)."""
    folder = run_dir / "start"
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", TENSORS)
    return folder


class StandInPolicy:
    """What the loop asks of a policy: a step (which keeps what it was given) and weights to push,
    the safetensors files of `source` (the model server's own: they pass its tensor check)."""

    def __init__(self, source: Path) -> None:
        self.source = source
        self.trained: list[list[Sample]] = []

    def step(self, samples: Sequence[Sample]) -> StepStats:
        self.trained.append(list(samples))
        tokens = sum(s.trained_tokens for s in samples)
        return StepStats(loss=0.0, trained_tokens=tokens, clipped=0.0, kl=0.0, grad_norm=0.0)

    def save_weights(self, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        for file in self.source.glob("*.safetensors"):
            shutil.copyfile(file, folder / file.name)
        return folder


def test_a_restarted_model_server_gets_the_weights_again_and_no_step_trains_on_its_start_weights(
    start_stack: Any, run_dir: Path
) -> None:
    weights = start_weights(run_dir)
    stack = start_stack(stack_config(weights))
    lines: list[str] = []

    def after_iteration(row: dict[str, Any]) -> None:
        # Strictly on-policy (max_lag 0): the next batch starts after this returns, so every one of
        # its episodes runs on the restarted server, which serves its start weights.
        if row["iteration"] == 0:
            killed = stack.kill(MODEL)
            stack.wait_for(MODEL, lambda s: s["pid"] != killed and s["state"] == "serving")

    config = TrainConfig(
        out=run_dir / "out", iterations=3, tasks_per_batch=2, group_size=2, concurrency=4, max_lag=0, agent=AGENT
    )
    policy = StandInPolicy(weights)

    async def scenario() -> Trainer:
        async with Client(run_dir=run_dir) as client:
            progress = Progress(lines.append, after_iteration)
            trainer = Trainer(config, client, policy, load_tasks(example_tasks_path()), progress)
            outcome = await trainer.run()
            assert outcome.state.iteration == 3
            served = await served_by_replica(client, MODEL)
            assert set(served.values()) == {outcome.state.weight_version} == {"grpo:3"}
            return trainer

    trainer = asyncio.run(scenario())
    versions = {v for batch in policy.trained for sample in batch for v in sample.versions}
    assert versions
    assert all(v.startswith("grpo:") for v in versions), versions
    assert [len(batch) for batch in policy.trained] == [4, 4, 4]  # every member, once, none failed
    assert trainer.restores == 1
    restored = [line for line in lines if "pushing grpo:1 again" in line]
    assert len(restored) == 1, lines
    assert "serves 'scripted:0'" in restored[0]
    rows = (run_dir / "out" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    reruns = [int(row.split(",")[header.index("reruns")]) for row in rows[1:]]
    assert reruns[1] >= 1, reruns  # the batch that ran on the restarted server
    assert reruns[0] == reruns[2] == 0, reruns


@pytest.mark.parametrize("server", [MODEL, AGENT, "resources/counter"])
def test_a_server_killed_during_a_step_while_the_next_batch_runs_costs_no_episode(
    start_stack: Any, run_dir: Path, server: str
) -> None:
    """The next batch's episodes are running (max_lag 1) when a server dies. Killed model server: the
    push after the step waits for it to be back, and what its start weights made is run again.
    Killed agent: the retried `Run`s replay. Killed resources server: the episodes start over."""
    weights = start_weights(run_dir)
    config = stack_config(weights)
    config["servers"][1]["args"]["token_delay"] = 0.005  # the next batch is still running during the step
    stack = start_stack(config)

    class KilledDuringStep(StandInPolicy):
        def step(self, samples: Sequence[Sample]) -> StepStats:
            if len(self.trained) == 1:
                stack.kill(server)
            return super().step(samples)

    config = TrainConfig(out=run_dir / "out", iterations=3, tasks_per_batch=2, group_size=2, concurrency=4, agent=AGENT)
    policy = KilledDuringStep(weights)

    async def scenario() -> None:
        async with Client(run_dir=run_dir) as client:
            outcome = await Trainer(config, client, policy, load_tasks(example_tasks_path()), Progress(print)).run()
            assert outcome.state.iteration == 3
            assert set((await served_by_replica(client, MODEL)).values()) == {"grpo:3"}

    asyncio.run(scenario())
    assert [len(batch) for batch in policy.trained] == [4, 4, 4]
    assert all(sample.reward == 1.0 for batch in policy.trained for sample in batch)
    versions = {v for batch in policy.trained for sample in batch for v in sample.versions}
    assert all(v.startswith("grpo:") for v in versions), versions


class CheckpointedPolicy(StandInPolicy):
    """Its state in a joint checkpoint is its weights (`weights/`, which a resume gives the model server)."""

    def save_state(self, folder: Path) -> None:
        self.save_weights(folder / "weights")

    def load_state(self, folder: Path) -> None:
        assert (folder / "weights").is_dir()


def test_a_resumed_trainer_gives_a_restarted_model_server_the_checkpoints_weights(
    start_stack: Any, run_dir: Path
) -> None:
    """After `--resume`, the weights served are the checkpoint's own folder: the numbered folder of that
    version was pruned as the first run went on, and a restore must not need it."""
    weights = start_weights(run_dir)
    tasks = load_tasks(example_tasks_path())
    out = run_dir / "out"
    config = TrainConfig(out=out, iterations=4, tasks_per_batch=2, group_size=2, concurrency=4, max_lag=0, agent=AGENT)
    config = dataclasses.replace(config, checkpoint_every=2)

    async def train(policy: StandInPolicy, progress: Progress, resume: bool) -> Trainer:
        async with Client(run_dir=run_dir) as client:
            trainer = Trainer(config, client, policy, tasks, progress)
            outcome = await trainer.run(resume=resume)
            assert outcome.state.iteration == 4
            return trainer

    stack = start_stack(stack_config(weights))
    asyncio.run(train(CheckpointedPolicy(weights), Progress(print), resume=False))
    assert not (out / "weights" / "00002").exists()  # pruned: grpo:2, the checkpoint's, is served from it
    stack.stop()

    stack = start_stack(stack_config(weights))  # a fresh stack, as after a crash of everything
    lines: list[str] = []

    def line(text: str) -> None:
        lines.append(text)
        if text.startswith("resumed from"):  # the resumed batch runs on the restarted server
            killed = stack.kill(MODEL)
            stack.wait_for(MODEL, lambda s: s["pid"] != killed and s["state"] == "serving")

    policy = CheckpointedPolicy(weights)
    trainer = asyncio.run(train(policy, Progress(line), resume=True))
    assert trainer.restores == 1
    assert [line for line in lines if "pushing grpo:2 again" in line], lines
    versions = {v for batch in policy.trained for sample in batch for v in sample.versions}
    assert all(v.startswith("grpo:") for v in versions), versions
    assert [len(batch) for batch in policy.trained] == [4, 4]


def test_a_trainer_sigkilled_alone_resumes_on_the_stack_that_outlived_it(
    start_stack: Any, run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The stack served on, so it cannot restore the checkpoint: the episodes it held in flight start
    over as new attempts, and every batch is still trained whole, each of its episodes once."""
    from tests.train import stand_in_trainer

    weights = start_weights(run_dir)
    config = stack_config(weights)
    config["servers"][1]["args"]["token_delay"] = 0.005  # episodes are in flight at each checkpoint
    start_stack(config)
    out = run_dir / "out"
    argv = [sys.executable, "-m", "tests.train.stand_in_trainer", str(run_dir), str(out), str(weights)]
    trainer = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE)
    assert trainer.stdout is not None
    for line in trainer.stdout:  # killed right after a joint checkpoint, mid-iteration
        if line.startswith(b"checkpoint "):
            trainer.kill()
            break
    assert trainer.wait(30) == -signal.SIGKILL

    resumed = asyncio.run(stand_in_trainer.main(run_dir, out, weights, resume=True))
    assert "the stack has served work since it started" in capsys.readouterr().err
    assert not resumed.joint.continued  # the checkpoint's episodes in flight start over, as attempt 1
    batches = [json.loads(line) for line in (out / "batches.jsonl").read_text().splitlines()]
    assert [b["iteration"] for b in batches] == list(range(stand_in_trainer.ITERATIONS))
    for batch in batches:
        ids = [e["episode_id"] for e in batch["episodes"]]
        assert len(ids) == len(set(ids)) == 4, batch
        assert not batch["failed"]
        assert all(e["reward"] == 1.0 for e in batch["episodes"])
    attempts = {e["episode_id"]: e["attempt"] for batch in batches for e in batch["episodes"]}
    assert all(attempts[rollout_id] == 1 for rollout_id in resumed.joint.restarted)
