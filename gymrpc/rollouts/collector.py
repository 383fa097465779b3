"""The collector: run tasks through an agent by name, many at once, reporting each episode as it ends.

A trainer calls `collect` directly; `gymrpc rollouts` is a thin layer over it. Every
episode ends as an `EpisodeResult`, failed ones included, so nothing is silently
dropped. Calls go through `gymrpc.Client`, so an agent, model or resources server that
restarts mid-run costs time, not episodes.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.json_format import MessageToDict

from gymrpc.client import Client
from gymrpc.errors import GymrpcError, UnknownError
from gymrpc.pbtime import seconds
from gymrpc.rollouts.tasks import RolloutTask, check_prefix
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2

DEFAULT_TIMEOUT = 3600.0
"""Seconds one episode may take from the collector's side, retries after a restart included."""


@dataclass
class EpisodeResult:
    """One finished episode: its trajectory, or the error it ended with."""

    task: RolloutTask
    repeat: int
    agent: str
    policy_version: str
    started_at: float
    """Unix time the collector sent `Run`."""
    latency_s: float
    """Seconds from sending `Run` to its reply, as the collector saw them (restarts included)."""
    trajectory: agent_pb.Trajectory | None = None
    error: GymrpcError | None = None
    policy_lag: int | None = None
    """Versions the episode's oldest token is behind the weights serving when it finished; None
    unless measured (`collect(max_policy_lag=...)`) or when the versions cannot be compared."""
    stale: bool = False
    """Its policy lag is beyond `max_policy_lag` (kept, flagged; after `stale="restart"`, the last try)."""
    stale_restarts: int = 0
    """Times it was retired as stale and run again as the next attempt (`stale="restart"`)."""
    reruns: int = 0
    """Times the `rerun` check of `collect` sent it back and it ran again as the next attempt."""
    attempt: int = 0
    """The attempt the trajectory is of (the first one's, plus `stale_restarts` and `reruns`)."""

    @property
    def oldest_weight_version(self) -> str:
        return self.trajectory.oldest_weight_version if self.trajectory is not None else ""

    @property
    def newest_weight_version(self) -> str:
        return self.trajectory.newest_weight_version if self.trajectory is not None else ""

    checkpoint: str | None = None
    """After `--resume` from a checkpoint: `continued` (from its checkpointed boundary), `restarted`
    (in the checkpoint, but only restartable), or `not_in_checkpoint` (run from the start: it had
    not started, or started after the last checkpoint). None when no checkpoint was restored."""

    @property
    def episode_id(self) -> str:
        return self.task.episode_id(self.repeat)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def reward(self) -> float | None:
        return self.trajectory.reward if self.trajectory is not None else None

    def to_json(self) -> dict[str, Any]:
        """The results-file line: summary fields first, then the whole trajectory."""
        out: dict[str, Any] = {
            "episode_id": self.episode_id,
            **({"id": self.task.row_id} if self.task.row_id is not None else {}),
            "task_index": self.task.index,
            "task_id": self.task.task.task_id,
            "repeat": self.repeat,
            "agent": self.agent,
            "policy_version": self.policy_version,
            "ok": self.ok,
            "started_at": round(self.started_at, 6),
            "finished_at": round(self.started_at + self.latency_s, 6),
        }
        t = self.trajectory
        if t is not None:
            out |= {
                "reward": t.reward,
                "steps": t.steps,
                "stop_reason": agent_pb.StopReason.Name(t.stop_reason).removeprefix("STOP_REASON_").lower(),
                "resume_count": t.resume_count,
                "restart_count": t.restart_count,
                "failovers": t.failovers,
                "session_recoveries": t.session_recoveries,
                "tokens": {"input": t.usage.input_tokens, "output": t.usage.output_tokens},
                "timings": {
                    "latency_s": round(self.latency_s, 6),
                    "server_total_s": round(seconds(t.timing.total), 6),
                    "parked_s": round(seconds(t.timing.parked), 6),
                    "model_s": round(sum(seconds(c.latency) for c in t.model_calls), 6),
                    "tools_s": round(sum(seconds(c.latency) for c in t.tool_calls), 6),
                },
                "model_calls": len(t.model_calls),
                "tool_calls": len(t.tool_calls),
                "weights": {
                    "oldest": t.oldest_weight_version,
                    "newest": t.newest_weight_version,
                    "policy_lag": self.policy_lag,
                    "stale": self.stale,
                    "stale_restarts": self.stale_restarts,
                },
            }
        else:
            out |= {"reward": None, "timings": {"latency_s": round(self.latency_s, 6)}}
        if self.checkpoint is not None:
            out["checkpoint"] = self.checkpoint
        if self.error is not None:
            out["error"] = error_json(self.error)
        if t is not None:
            out["trajectory"] = MessageToDict(t, preserving_proto_field_name=True)
        return out


def error_json(err: GymrpcError) -> dict[str, str]:
    return {"code": err.code.name, "reason": err.reason, "message": err.message}


OnResult = Callable[[EpisodeResult], Awaitable[None] | None]
OnStart = Callable[[RolloutTask, int], None]
Rerun = Callable[[EpisodeResult], Awaitable[bool] | bool]


async def collect(
    client: Client,
    tasks: Sequence[RolloutTask | common_pb2.Task],
    *,
    agent: str = "agent/simple",
    concurrency: int = 32,
    repeats: int = 1,
    policy_version: str = "",
    max_steps: int = 0,
    timeout: float = DEFAULT_TIMEOUT,
    skip: Collection[str] = (),
    attempts: Mapping[str, int] | None = None,
    id_prefix: str | None = None,
    on_start: OnStart | None = None,
    on_result: OnResult | None = None,
    max_policy_lag: int | None = None,
    stale: str = "flag",
    model: str = "model/policy",
    max_stale_restarts: int = 3,
    rerun: Rerun | None = None,
    max_reruns: int = 3,
) -> list[EpisodeResult]:
    """Run every task `repeats` times through `agent`, at most `concurrency` episodes at once.

    Episodes run task by task, repeats of one task next to each other (a GRPO group
    finishes together). `on_result` is called (and awaited if async) as each episode
    ends, successful or not; an exception from it stops the collection. Episode ids in
    `skip` are not run (a resumed collection); `attempts` gives the attempt an episode id runs
    as (default 0; after a restored checkpoint, attempt N continues as N+1). Bare `Task`s get
    ids `<id_prefix>-t<i>-r<repeat>`; without `id_prefix`, a random one per call, so two calls
    never share an episode id (pass one, for example the training step, to make a retried call
    recognisable). Returns the results in finishing order.
    Cancelling the call cancels the episodes in flight; results already reported stay.

    Staleness: with `max_policy_lag=K`, each episode's oldest weight version (the oldest that
    produced any of its tokens) is compared, as it finishes, with the version the model server
    `model` serves then (`gymrpc.weights.policy_lag`). More than K behind, it is stale:
    `stale="flag"` keeps it with `stale` set; `stale="restart"` runs it again as the next
    attempt (the agent starts it over), at most `max_stale_restarts` times, and reports the last
    try (still flagged if it is stale too). Each reported result is one episode, never two.

    `rerun` (awaited if async) sees each episode that ended with a trajectory, before it is
    reported; True runs it again as the next attempt (`EpisodeResult.reruns`), at most
    `max_reruns` times, and the last try is reported whatever it says. The trainer uses it for
    episodes whose tokens came from weights it did not push (a restarted model server).

    Raises `NotFound` at once when `agent` was never registered.
    """
    if concurrency < 1 or repeats < 1:
        raise ValueError(f"concurrency and repeats must be at least 1, got {concurrency} and {repeats}")
    if stale not in ("flag", "restart"):
        raise ValueError(f"stale must be 'flag' or 'restart', got {stale!r}")
    if max_reruns < 0:
        raise ValueError(f"max_reruns must be at least 0, got {max_reruns}")
    if max_policy_lag is not None and max_policy_lag < 0:
        raise ValueError(f"max_policy_lag must be at least 0, got {max_policy_lag}")
    prefix = check_prefix(id_prefix) if id_prefix is not None else f"rollout-{uuid.uuid4().hex[:12]}"
    items = [t if isinstance(t, RolloutTask) else RolloutTask(i, t, prefix) for i, t in enumerate(tasks)]
    planned = [(t, r) for t in items for r in range(repeats) if t.episode_id(r) not in skip]
    jobs = iter(planned)
    await client.resolve(agent)  # a wrong name fails here, not once per episode
    stub = client.agent(agent)
    options = agent_pb.RunOptions(max_steps=max_steps)
    results: list[EpisodeResult] = []

    async def run_one(task: RolloutTask, repeat: int) -> EpisodeResult:
        attempt = (attempts or {}).get(task.episode_id(repeat), 0)
        started_at, started = time.time(), time.perf_counter()
        result = EpisodeResult(task, repeat, agent, policy_version, started_at, 0.0, attempt=attempt)
        while True:
            request = agent_pb.RunRequest(
                task=task.task,
                episode_id=common_pb2.EpisodeId(rollout_id=task.episode_id(repeat), attempt=result.attempt),
                policy_version=policy_version,
                options=options,
            )
            try:
                result.trajectory = (await stub.Run(request, timeout=timeout)).trajectory
                if max_policy_lag is not None:
                    await _measure_lag(client, model, result, max_policy_lag)
            except GymrpcError as err:
                result.error = err
            except Exception as exc:  # not a gRPC failure: still an episode that did not finish
                result.error = UnknownError(f"{type(exc).__name__}: {exc}", reason="COLLECTOR_ERROR")
            if result.stale and stale == "restart" and result.stale_restarts < max_stale_restarts:
                result.stale_restarts += 1
            elif result.trajectory is not None and rerun is not None and result.reruns < max_reruns:
                again = rerun(result)
                if not (await again if inspect.isawaitable(again) else again):
                    break
                result.reruns += 1
            else:
                break
            result.attempt += 1
            result.trajectory, result.stale, result.policy_lag = None, False, None
        result.latency_s = time.perf_counter() - started
        return result

    async def worker() -> None:
        for task, repeat in jobs:  # one shared iterator: each job is taken exactly once
            if on_start is not None:
                on_start(task, repeat)
            result = await run_one(task, repeat)
            results.append(result)
            if on_result is not None:
                maybe = on_result(result)
                if inspect.isawaitable(maybe):
                    await maybe
            _raise_if_cancelled()

    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(min(concurrency, len(planned))):
                group.create_task(worker())
    except BaseExceptionGroup as group_error:  # a failing on_result: raise it as itself
        raise group_error.exceptions[0] from None
    return results


async def _measure_lag(client: Client, model: str, result: EpisodeResult, bound: int) -> None:
    from gymrpc.weights import policy_lag, served_versions

    current, history = await served_versions(client, model)
    result.policy_lag = policy_lag(result.oldest_weight_version, current, history)
    result.stale = result.policy_lag is not None and result.policy_lag > bound


def _raise_if_cancelled() -> None:
    """Stop a worker whose cancellation grpc swallowed.

    A cancel that lands as the reply arrives is absorbed by grpc.aio (the call returns its
    response), so without this check a cancelled worker would go on to its next episode.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
