"""`python -m tests.train.stand_in_trainer RUN_DIR OUT START [--resume]`: the reference trainer with the
stand-in policy of `test_restarts.py`, as a process a test can SIGKILL (6 iterations, a joint
checkpoint after each)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from gymrpc.client import Client
from gymrpc.envs.counter import example_tasks_path
from gymrpc.rollouts.tasks import load_tasks
from gymrpc.train.loop import Progress, TrainConfig, Trainer
from tests.train.test_restarts import AGENT, CheckpointedPolicy

ITERATIONS = 6


def config(out: Path) -> TrainConfig:
    return TrainConfig(
        out=out, iterations=ITERATIONS, tasks_per_batch=2, group_size=2, concurrency=4, checkpoint_every=1, agent=AGENT
    )


async def main(run_dir: Path, out: Path, start: Path, resume: bool) -> Trainer:
    async with Client(run_dir=run_dir) as client:
        policy = CheckpointedPolicy(start)
        trainer = Trainer(config(out), client, policy, load_tasks(example_tasks_path()), Progress(print))
        outcome = await trainer.run(resume=resume)
        assert outcome.state.iteration == ITERATIONS
        return trainer


if __name__ == "__main__":
    run_dir, out, start = (Path(a) for a in sys.argv[1:4])
    asyncio.run(main(run_dir, out, start, "--resume" in sys.argv[4:]))
