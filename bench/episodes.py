"""Episodes per second through a whole stack: registry, counter resources, scripted model, agent.

Every server is a real process started by the local launcher (as `gymrpc up` starts them);
this process is the collector (`gymrpc.rollouts.collect` over `gymrpc.Client`). Each
counter episode is 3 model calls, 3 tool calls, seed, verify and close: about 9 RPCs
behind the agent plus the `Run` itself. The scripted model costs no compute, so the
figures are the protocol, the servers and the event loops, not a policy.

    cd /work/main && .venv/bin/python bench/episodes.py [--quick] [--concurrency 1,8,32,128] [--json out.json]

Per concurrency level: `rounds` timed runs of `episodes` each, after one untimed warm-up;
the table shows the median round. CPU columns are milliseconds of CPU per episode for each
process (utime + stime from /proc), so the busiest one is the bottleneck.

`--env workplace` runs WorkBench tasks from the repo's data instead (`bench/workplace_episodes.py`):
resources with the workplace environment, the scripted model replaying recorded rollouts and
ground-truth scripts, at concurrency 16, in one of two A/B modes whose rounds alternate sides:

    .venv/bin/python bench/episodes.py --env workplace --compare incremental [-n 128] [--rounds 3]
    .venv/bin/python bench/episodes.py --env workplace --checkpoint-every 5 [-n 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # runnable as `python bench/episodes.py` from anywhere
    sys.path.insert(0, str(ROOT))

import gymrpc.envs.counter  # noqa: E402
from gymrpc.client import Client  # noqa: E402
from gymrpc.launch.local import LocalLauncher  # noqa: E402
from gymrpc.launch.spec import parse_stack_spec  # noqa: E402
from gymrpc.rollouts import RolloutTask, collect, load_tasks  # noqa: E402
from gymrpc.rollouts.report import percentile  # noqa: E402

AGENT = "agent/bench"
SERVERS = {"agent": AGENT, "model": "model/policy", "resources": "resources/counter", "registry": "registry/main"}
CLK_TCK = os.sysconf("SC_CLK_TCK")
STACK = {
    "servers": [
        {"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}},
        {"name": "model/policy", "role": "model", "args": {"policy": "counter"}},
        {"name": AGENT, "role": "agent", "args": {"resources": "resources/counter", "model": "model/policy"}},
    ]
}


def cpu_seconds(pid: int) -> float:
    """utime + stime of all the process's threads (fields 14 and 15 of /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def self_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def episode_tasks(base: list[RolloutTask], count: int, prefix: str) -> list[RolloutTask]:
    """`count` tasks cycling through the example tasks, each with its own episode id."""
    return [RolloutTask(i, base[i % len(base)].task, prefix) for i in range(count)]


async def run_level(
    client: Client, base: list[RolloutTask], pids: dict[str, int], concurrency: int, episodes: int, tag: str
) -> dict[str, Any]:
    tasks = episode_tasks(base, episodes, tag)
    cpu_before = {k: cpu_seconds(pid) for k, pid in pids.items()}
    client_before = self_cpu_seconds()
    started = time.perf_counter()
    results = await collect(client, tasks, agent=AGENT, concurrency=concurrency)
    wall = time.perf_counter() - started
    cpu = {k: cpu_seconds(pid) - cpu_before[k] for k, pid in pids.items()}
    cpu["client"] = self_cpu_seconds() - client_before
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} episodes failed, first: {failed[0].error}")
    latencies = [r.latency_s for r in results]
    return {
        "episodes": len(results),
        "wall_s": wall,
        "episodes_per_s": len(results) / wall,
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p95_ms": percentile(latencies, 95) * 1e3,
        "mean_reward": statistics.fmean(r.reward or 0.0 for r in results),
        "cpu_ms_per_episode": {k: v * 1e3 / len(results) for k, v in cpu.items()},
    }


async def bench(levels: list[int], episodes: int, rounds: int, run_dir: Path) -> dict[str, Any]:
    launcher = LocalLauncher(parse_stack_spec(STACK, "<bench>"), run_dir)
    await launcher.start()
    try:
        states = {s.name: s for s in launcher.server_states()}
        pids = {label: states[name].pid or 0 for label, name in SERVERS.items()}
        base = load_tasks(gymrpc.envs.counter.example_tasks_path())
        out: dict[str, Any] = {}
        async with Client(run_dir=run_dir) as client:
            for c in levels:
                n = max(episodes, 4 * c)
                await run_level(client, base, pids, c, min(n, 4 * c), f"warm-c{c}")
                runs = [await run_level(client, base, pids, c, n, f"bench-c{c}-r{k}") for k in range(rounds)]
                median = sorted(runs, key=lambda r: r["episodes_per_s"])[len(runs) // 2]
                out[str(c)] = {"median": median, "rounds": runs}
                print(_row(c, median), flush=True)
        return out
    finally:
        await launcher.stop()


HEADER = (
    f"{'concurrency':>11} {'episodes':>8} {'episodes/s':>10} {'p50 ms':>8} {'p95 ms':>8} {'reward':>6}"
    f"  cpu ms/episode: {'agent':>6} {'model':>6} {'resources':>9} {'registry':>8} {'client':>6}"
)


def _row(c: int, r: dict[str, Any]) -> str:
    cpu = r["cpu_ms_per_episode"]
    return (
        f"{c:>11} {r['episodes']:>8} {r['episodes_per_s']:>10.1f} {r['p50_ms']:>8.1f} {r['p95_ms']:>8.1f}"
        f" {r['mean_reward']:>6.2f}  {'':>15} {cpu['agent']:>6.2f} {cpu['model']:>6.2f} {cpu['resources']:>9.2f}"
        f" {cpu['registry']:>8.2f} {cpu['client']:>6.2f}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke-test size: levels 1,8,32, 40 episodes, 1 round")
    parser.add_argument("--env", choices=("counter", "workplace"), default="counter", help="episodes of which env")
    parser.add_argument("--concurrency", help="comma-separated levels (default 1,8,32,128; workplace: 16)")
    parser.add_argument("-n", "--episodes", type=int, help="timed episodes per round (default 400; workplace: 128)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per level (workplace: per side)")
    parser.add_argument("--json", type=Path, help="write all results here")
    workplace = parser.add_argument_group("--env workplace (A/B rounds, alternating sides)")
    workplace.add_argument(
        "--compare",
        choices=("incremental",),
        help="incremental: model servers with incremental prompts on and off; model-server CPU per episode",
    )
    workplace.add_argument(
        "--checkpoint-every",
        type=float,
        metavar="SECONDS",
        help="no checkpoints against a coordinated non-stop checkpoint every SECONDS; episodes/s",
    )
    workplace.add_argument("--tasks", type=int, default=10, help="WorkBench tasks to cycle through (at most 10)")
    args = parser.parse_args(argv)
    if args.env == "counter" and (args.compare or args.checkpoint_every is not None):
        parser.error("--compare and --checkpoint-every need --env workplace")
    if args.env == "workplace" and (args.compare is None) == (args.checkpoint_every is None):
        parser.error("--env workplace needs one of --compare incremental or --checkpoint-every SECONDS")
    if args.checkpoint_every is not None and args.checkpoint_every <= 0:
        parser.error("--checkpoint-every must be positive")
    if not 1 <= args.tasks <= 10:
        parser.error("--tasks must be between 1 and 10")
    workplace_run = args.env == "workplace"
    args.concurrency = args.concurrency or ("16" if workplace_run else "1,8,32,128")
    args.episodes = args.episodes or (128 if workplace_run else 400)
    if args.quick:
        args.concurrency, args.episodes, args.rounds = ("16", 16, 1) if workplace_run else ("1,8,32", 40, 1)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.env == "workplace":
        from bench.workplace_episodes import run_workplace

        return run_workplace(args)
    levels = [int(c) for c in args.concurrency.split(",")]
    run_dir = Path(tempfile.mkdtemp(prefix="gymrpc-bench-", dir="/tmp"))  # short: unix socket paths
    cores = os.cpu_count()
    print(f"episodes through a local stack (scripted model, counter); python {platform.python_version()}, {cores} cpus")
    print(HEADER, flush=True)
    try:
        results = asyncio.run(bench(levels, args.episodes, args.rounds, run_dir))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    if args.json:
        meta = {"python": platform.python_version(), "cpus": cores, "episodes": args.episodes, "rounds": args.rounds}
        args.json.write_text(json.dumps({"meta": meta, "levels": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
