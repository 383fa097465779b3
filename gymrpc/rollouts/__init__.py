"""Collecting rollouts: tasks in, one result per episode out, as they finish.

A trainer uses the library directly::

    async with gymrpc.Client() as client:
        tasks = load_tasks(Path("tasks.jsonl"))
        results = await collect(client, tasks, agent="agent/counter", concurrency=32, repeats=4,
                                on_result=lambda r: print(r.episode_id, r.reward))

`gymrpc rollouts` is the same thing as a command (`gymrpc.rollouts.command`).
"""

from gymrpc.rollouts.collector import DEFAULT_TIMEOUT, EpisodeResult, collect
from gymrpc.rollouts.report import Progress, ResultWriter, Summary, done_ids
from gymrpc.rollouts.tasks import RolloutTask, TaskFileError, load_tasks, tasks_from_rows

__all__ = [
    "DEFAULT_TIMEOUT",
    "EpisodeResult",
    "Progress",
    "ResultWriter",
    "RolloutTask",
    "Summary",
    "TaskFileError",
    "collect",
    "done_ids",
    "load_tasks",
    "tasks_from_rows",
]
