"""`bench/episodes.py --env workplace`: WorkBench episodes through a whole stack, two sides in alternating rounds.

Every server is a real process started by the local launcher: resources with the workplace
environment, the scripted model server, the agent (`--max-steps 6`). The tasks are the repo's
WorkBench data: the five recorded rollouts' tasks (`rollout_tasks.jsonl`, the model replays the
recorded model outputs) and the five example tasks (`example.jsonl`, the model replays a
ground-truth script: every call, then an answer), cycled, each episode with its own id. The
scripted model costs no compute, so the model server's CPU is the protocol, rendering and
tokenising the prompt (the system prompt, 27 tool schemas and the growing conversation) and
parsing the reply: what incremental prompts change.

Two modes, each an A/B in one run: rounds alternate the sides (A B, then B A, ...) after one
untimed warm-up round per side, so load from the rest of the machine hits both; figures are
pooled over each side's rounds and printed as a ratio against the other side of the same run.

- `--compare incremental`: one stack with two model servers, one with incremental prompts
  (`PromptTokenizer`) and one with `--no-incremental-prompts`, each behind its own agent; a
  round drives one agent. Figure: the model server's CPU per episode (utime + stime from /proc).
- `--checkpoint-every SECONDS`: one stack; in the checkpoint rounds a `gymrpc.Controller` takes
  a coordinated non-stop checkpoint of every episode in flight every SECONDS (as `gymrpc rollouts
  --checkpoint-every` does: published, the last two kept). Figures: episodes/s of each side, and
  per checkpoint how long the episodes were parked (prepare's start to the resume).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from bench.episodes import cpu_seconds, self_cpu_seconds
from gymrpc.client import Client
from gymrpc.control.types import EpisodeKey
from gymrpc.controller import Controller, CoordinationError
from gymrpc.envs.workplace_assistant import example_tasks_path, rollout_tasks_path
from gymrpc.errors import GymrpcError
from gymrpc.launch.local import LocalLauncher
from gymrpc.launch.spec import parse_stack_spec
from gymrpc.rollouts import RolloutTask, collect, load_tasks
from gymrpc.rollouts.checkpointing import CheckpointKeeper

RESOURCES = "resources/workplace"
MODEL_ARGS = {"backend": "scripted", "recorded": "env:workplace_assistant", "default_max_tokens": 4096}


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_ground_truth_script(path: Path) -> None:
    """The example tasks' script (as tests/workplace/test_stack.py): every ground-truth call, then an answer."""
    lines = []
    for row in _rows(example_tasks_path()):
        first_user = next(m["content"] for m in row["responses_create_params"]["input"] if m["role"] == "user")
        calls = [{"name": c["name"], "arguments": c["arguments"]} for c in row["ground_truth"]]
        lines.append({"first_user": first_user, "replies": [{"tool_calls": calls}, {"content": "Done."}]})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")


def workplace_tasks(count: int) -> list[RolloutTask]:
    """The first `count` of the recorded rollouts' tasks then the example tasks (10 in all)."""
    return [*load_tasks(rollout_tasks_path()), *load_tasks(example_tasks_path())][:count]


def stack(script: Path, sides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Workplace resources, and per side a model server (base args + the side's) and an agent on it."""
    servers: list[dict[str, Any]] = [{"name": RESOURCES, "role": "resources", "args": {"environment": "workplace"}}]
    for side, extra in sides.items():
        model = f"model/{side}"
        servers.append({"name": model, "role": "model", "args": {**MODEL_ARGS, "script": [str(script)], **extra}})
        servers.append(
            {"name": f"agent/{side}", "role": "agent", "args": {"resources": RESOURCES, "model": model, "max_steps": 6}}
        )
    return {"servers": servers}


class InFlight:
    """Episodes started and not finished (the scope of each checkpoint), fed by `collect`'s callbacks."""

    def __init__(self) -> None:
        self.episodes: dict[str, int] = {}

    def started(self, task: RolloutTask, repeat: int) -> None:
        self.episodes[task.episode_id(repeat)] = 0

    def finished(self, result: Any) -> None:
        self.episodes.pop(result.episode_id, None)

    def scope(self) -> list[EpisodeKey]:
        return [EpisodeKey(r, a) for r, a in sorted(self.episodes.items())]


async def checkpoint_every(
    controller: Controller, keeper: CheckpointKeeper, flight: InFlight, seconds: float, log: list[dict[str, Any]]
) -> None:
    """A non-stop checkpoint of every episode in flight every `seconds`, until cancelled; each logged."""
    while True:
        await asyncio.sleep(seconds)
        try:
            result = await controller.checkpoint(keeper.root, episode_ids=flight.scope(), timeout=30.0)
        except (CoordinationError, GymrpcError) as exc:
            log.append({"committed": False, "error": str(exc)})
            continue
        if result.committed:
            keeper.publish(result)
        log.append(
            {
                "committed": result.committed,
                "episodes": len(result.continued),
                "parked_ms": result.timings.get("parked", 0.0) * 1e3,
                "commit_to_publish_ms": result.timings.get("commit_to_publish", 0.0) * 1e3,
            }
        )


Beside = Callable[[Client, InFlight, list[dict[str, Any]]], Coroutine[Any, Any, None]]
"""Run beside a round (cancelled at its end): the stack's client, the episodes in flight, a log for the round."""


async def run_round(
    client: Client,
    agent: str,
    tasks: list[RolloutTask],
    concurrency: int,
    model_pid: int,
    during: Beside | None = None,
) -> dict[str, Any]:
    """One timed round on `agent`, with `during` beside it; what it logged is the round's `checkpoints`."""
    flight, log = InFlight(), list[dict[str, Any]]()
    cpu_before, client_before = cpu_seconds(model_pid), self_cpu_seconds()
    started = time.perf_counter()
    beside = asyncio.create_task(during(client, flight, log)) if during is not None else None
    try:
        results = await collect(
            client, tasks, agent=agent, concurrency=concurrency, on_start=flight.started, on_result=flight.finished
        )
    finally:
        if beside is not None:
            beside.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beside
    wall = time.perf_counter() - started
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} episodes failed, first: {failed[0].error}")
    out: dict[str, Any] = {
        "episodes": len(results),
        "wall_s": wall,
        "model_cpu_s": cpu_seconds(model_pid) - cpu_before,
        "client_cpu_s": self_cpu_seconds() - client_before,
        "mean_reward": statistics.fmean(r.reward or 0.0 for r in results),
    }
    if during is not None:
        out["checkpoints"] = log
    return out


def pooled(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A side's rounds added up: episodes/s over the total wall time, model CPU per episode over all episodes."""
    episodes = sum(r["episodes"] for r in rounds)
    wall = sum(r["wall_s"] for r in rounds)
    return {
        "episodes": episodes,
        "episodes_per_s": episodes / wall,
        "model_cpu_ms_per_episode": sum(r["model_cpu_s"] for r in rounds) * 1e3 / episodes,
        "mean_reward": statistics.fmean(r["mean_reward"] for r in rounds),
        "rounds": rounds,
    }


def order(k: int, sides: tuple[str, str]) -> tuple[str, str]:
    """A B, B A, A B, ...: neither side always runs first (after the other has warmed the machine)."""
    return sides if k % 2 == 0 else (sides[1], sides[0])


async def ab(
    args: argparse.Namespace,
    run_dir: Path,
    spec: dict[str, Any],
    sides: tuple[str, str],
    agent_of: dict[str, str],
    model_of: dict[str, str],
    during_of: dict[str, Beside | None],
) -> dict[str, dict[str, Any]]:
    """Start the stack, warm each side up, then `rounds` interleaved rounds per side; the pooled figures."""
    concurrency = int(args.concurrency.split(",")[0])
    base = workplace_tasks(args.tasks)
    launcher = LocalLauncher(parse_stack_spec(spec, "<bench>"), run_dir)
    await launcher.start()
    try:
        pids = {s.name: s.pid or 0 for s in launcher.server_states()}
        async with Client(run_dir=run_dir) as client:
            for side in sides:  # warm-up, untimed, no checkpoints
                tasks = [RolloutTask(i, base[i % len(base)].task, f"warm-{side}") for i in range(concurrency)]
                await run_round(client, agent_of[side], tasks, concurrency, pids[model_of[side]])
            rounds: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
            for k in range(args.rounds):
                for side in order(k, sides):
                    tasks = [RolloutTask(i, base[i % len(base)].task, f"{side}-r{k}") for i in range(args.episodes)]
                    r = await run_round(
                        client, agent_of[side], tasks, concurrency, pids[model_of[side]], during_of[side]
                    )
                    r["side"], r["round"] = side, k
                    rounds[side].append(r)
                    print(_round_row(r), flush=True)
        return {side: pooled(rounds[side]) for side in sides}
    finally:
        await launcher.stop()


def _round_row(r: dict[str, Any]) -> str:
    cpu = r["model_cpu_s"] * 1e3 / r["episodes"]
    extra = f" {len(r['checkpoints']):>11}" if "checkpoints" in r else ""
    rate = r["episodes"] / r["wall_s"]
    return f"{r['round']:>5} {r['side']:>12} {r['episodes']:>8} {rate:>10.2f} {cpu:>13.1f}{extra}"


async def compare_incremental(args: argparse.Namespace, run_dir: Path, script: Path) -> dict[str, Any]:
    sides = ("full", "incremental")
    spec = stack(script, {"full": {"no_incremental_prompts": True}, "incremental": {}})
    agents = {s: f"agent/{s}" for s in sides}
    models = {s: f"model/{s}" for s in sides}
    print(f"{'round':>5} {'side':>12} {'episodes':>8} {'episodes/s':>10} {'model cpu ms':>13}", flush=True)
    out = await ab(args, run_dir, spec, sides, agents, models, {s: None for s in sides})
    full, inc = out["full"]["model_cpu_ms_per_episode"], out["incremental"]["model_cpu_ms_per_episode"]
    out["ratio"] = full / inc
    print()
    print(f"{'side':>12} {'episodes':>8} {'episodes/s':>10} {'model cpu ms/episode':>21}")
    for side in sides:
        s = out[side]
        print(f"{side:>12} {s['episodes']:>8} {s['episodes_per_s']:>10.2f} {s['model_cpu_ms_per_episode']:>21.1f}")
    print(
        f"RATIO model-server CPU per episode, full / incremental: {out['ratio']:.2f}x  "
        f"(load average {os.getloadavg()[0]:.2f})"
    )
    return out


async def compare_checkpoints(args: argparse.Namespace, run_dir: Path, script: Path) -> dict[str, Any]:
    sides = ("none", "checkpoints")
    spec = stack(script, {"policy": {}})
    keeper = CheckpointKeeper(run_dir / "checkpoints", keep=2)
    controllers: dict[int, Controller] = {}

    async def during(client: Client, flight: InFlight, log: list[dict[str, Any]]) -> None:
        controller = controllers.get(id(client))
        if controller is None:
            controller = controllers[id(client)] = Controller(client)
            await controller.discover()
        await checkpoint_every(controller, keeper, flight, args.checkpoint_every, log)

    agents = dict.fromkeys(sides, "agent/policy")
    models = dict.fromkeys(sides, "model/policy")
    print(
        f"{'round':>5} {'side':>12} {'episodes':>8} {'episodes/s':>10} {'model cpu ms':>13} {'checkpoints':>11}",
        flush=True,
    )
    out: dict[str, Any] = await ab(args, run_dir, spec, sides, agents, models, {"none": None, "checkpoints": during})
    taken = [c for r in out["checkpoints"]["rounds"] for c in r["checkpoints"]]
    committed = [c for c in taken if c["committed"]]
    parked = [c["parked_ms"] for c in committed]
    out["checkpoints"]["taken"] = len(taken)
    out["checkpoints"]["committed"] = len(committed)
    out["checkpoints"]["parked_ms"] = (
        {"median": statistics.median(parked), "max": max(parked), "mean": statistics.fmean(parked)} if parked else None
    )
    wall = sum(r["wall_s"] for r in out["checkpoints"]["rounds"])
    out["checkpoints"]["parked_share"] = sum(parked) / 1e3 / wall  # of the checkpoint rounds' wall time
    in_flight = [c["episodes"] for c in committed]
    out["checkpoints"]["episodes_per_checkpoint"] = statistics.fmean(in_flight) if in_flight else None
    out["ratio"] = out["checkpoints"]["episodes_per_s"] / out["none"]["episodes_per_s"]
    print()
    print(f"{'side':>12} {'episodes':>8} {'episodes/s':>10}")
    for side in sides:
        print(f"{side:>12} {out[side]['episodes']:>8} {out[side]['episodes_per_s']:>10.2f}")
    ckpt = out["checkpoints"]
    if parked:
        print(
            f"checkpoints every {args.checkpoint_every:g} s: {len(committed)} committed of {len(taken)}, "
            f"{ckpt['episodes_per_checkpoint']:.1f} episodes in flight each, parked per checkpoint "
            f"median {ckpt['parked_ms']['median']:.0f} ms, max {ckpt['parked_ms']['max']:.0f} ms; "
            f"parked {ckpt['parked_share']:.1%} of the checkpoint rounds' wall time"
        )
    else:
        print(f"checkpoints every {args.checkpoint_every:g} s: {len(committed)} committed of {len(taken)}")
    print(f"RATIO episodes/s, checkpoints / none: {out['ratio']:.3f}  (load average {os.getloadavg()[0]:.2f})")
    return out


def run_workplace(args: argparse.Namespace) -> int:
    """`bench/episodes.py --env workplace`: one A/B mode, its figures printed (and written with `--json`)."""
    run_dir = Path(tempfile.mkdtemp(prefix="gymrpc-wp-", dir="/tmp"))  # short: unix socket paths
    script = run_dir / "ground_truth_script.jsonl"
    write_ground_truth_script(script)
    mode = "incremental" if args.compare == "incremental" else f"checkpoint every {args.checkpoint_every:g} s"
    print(
        f"workplace episodes through a local stack (scripted model), {mode}; concurrency {args.concurrency}, "
        f"{args.tasks} tasks, {args.episodes} episodes per round, {args.rounds} rounds per side; "
        f"python {platform.python_version()}, {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    try:
        compare = compare_incremental if args.compare == "incremental" else compare_checkpoints
        results = asyncio.run(compare(args, run_dir, script))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    if args.json:
        meta = {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "env": "workplace",
            "mode": "incremental" if args.compare else "checkpoint_every",
            "checkpoint_every": args.checkpoint_every,
            "concurrency": int(args.concurrency.split(",")[0]),
            "episodes": args.episodes,
            "rounds": args.rounds,
            "tasks": args.tasks,
            "load_average_end": os.getloadavg()[0],
        }
        args.json.write_text(json.dumps({"meta": meta, "sides": results}, indent=2) + "\n")
    return 0
