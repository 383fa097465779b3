"""Episodes per second with 1, 2 and 4 agent and resources replicas behind one name each, on Ray.

Each level starts a stack with the Ray launcher (agent/bench x R, resources/counter x R, one
scripted model), runs the same counter episodes through `gymrpc.rollouts.collect`, and stops it.
The collector balances episodes over the agent replicas and every agent keeps each session on
its resources replica (`gymrpc.balancing`). On a machine with few cores more replicas cannot
add throughput: what the curve shows is the cost of the balancing and affinity path against a
single replica measured in the same run. A micro-benchmark of the per-call choice
(`affinity_key` + `Balancer.pick`) isolates that path from the servers.

    .venv/bin/python bench/replicas.py --address 127.0.0.2:PORT [--replicas 1,2,4] [-n 200] [-c 32]

Without `--address` the launcher starts a private single-node Ray instance on loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # runnable as `python bench/replicas.py` from anywhere
    sys.path.insert(0, str(ROOT))

import gymrpc.envs.counter  # noqa: E402
from gymrpc.balancing import Balancer, affinity_key  # noqa: E402
from gymrpc.client import Client  # noqa: E402
from gymrpc.launch.ray import RayLauncher  # noqa: E402
from gymrpc.launch.spec import parse_stack_spec  # noqa: E402
from gymrpc.rollouts import RolloutTask, collect, load_tasks  # noqa: E402
from gymrpc.rollouts.report import percentile  # noqa: E402
from gymrpc.v1 import common_pb2  # noqa: E402
from gymrpc.v1 import resources_service_pb2 as resources_pb  # noqa: E402

AGENT = "agent/bench"


def stack(replicas: int, address: str | None, cpus: float, run_dir: Path) -> dict[str, Any]:
    small = {"num_cpus": cpus}
    counter = {"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}}
    agent_args = {"resources": "resources/counter", "model": "model/policy"}
    return {
        "launcher": "ray",
        "ray": {"address": address, "namespace": f"bench-{os.getpid()}", "log_dir": str(run_dir / "logs")},
        "servers": [
            counter | small | {"replicas": replicas},
            {"name": "model/policy", "role": "model", "args": {"policy": "counter"}} | small,
            {"name": AGENT, "role": "agent", "args": agent_args} | small | {"replicas": replicas},
        ],
    }


async def run_level(
    replicas: int, address: str | None, base: list[RolloutTask], episodes: int, concurrency: int, rounds: int
) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix="gymrpc-bench-", dir="/tmp"))
    launcher = RayLauncher(parse_stack_spec(stack(replicas, address, 0.25, run_dir), "<bench>"), run_dir)
    started = time.perf_counter()
    await launcher.start()
    up_s = time.perf_counter() - started
    try:
        async with Client(run_dir=run_dir) as client:
            warm = [RolloutTask(i, base[i % len(base)].task, f"warm-{replicas}") for i in range(concurrency)]
            await collect(client, warm, agent=AGENT, concurrency=concurrency)
            runs = []
            for r in range(rounds):
                tasks = [RolloutTask(i, base[i % len(base)].task, f"r{replicas}-{r}") for i in range(episodes)]
                t0 = time.perf_counter()
                results = await collect(client, tasks, agent=AGENT, concurrency=concurrency)
                wall = time.perf_counter() - t0
                failed = [x for x in results if not x.ok]
                if failed:
                    raise RuntimeError(f"{len(failed)} episodes failed, first: {failed[0].error}")
                latencies = [x.latency_s for x in results]
                runs.append(
                    {
                        "episodes_per_s": len(results) / wall,
                        "p50_ms": percentile(latencies, 50) * 1e3,
                        "p95_ms": percentile(latencies, 95) * 1e3,
                    }
                )
            per_agent = _spread(client, AGENT, [f"r{replicas}-{r}" for r in range(rounds)])
    finally:
        await launcher.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    median = sorted(runs, key=lambda x: x["episodes_per_s"])[len(runs) // 2]
    return {"replicas": replicas, "stack_up_s": up_s, "median": median, "rounds": runs, "episodes_per_agent": per_agent}


def _spread(client: Client, name: str, prefixes: list[str]) -> dict[str, int]:
    """How many timed episodes each agent replica took (from the collector's own affinity table)."""
    counts: dict[str, int] = {}
    for key, endpoint_id in client.balancer.placements(name).items():
        if any(key.startswith(p) for p in prefixes):
            counts[endpoint_id] = counts.get(endpoint_id, 0) + 1
    return dict(sorted(counts.items()))


def choice_cost(replicas: int, calls: int = 200_000) -> float:
    """Nanoseconds per call of `affinity_key` + `Balancer.pick` over `replicas` endpoints, 1000 live sessions."""

    class Ep:
        def __init__(self, i: int) -> None:
            self.endpoint_id, self.address = str(i), f"10.0.0.{i}:1"

    balancer = Balancer()
    balancer.update("resources/counter", [Ep(i) for i in range(replicas)])
    requests = [
        resources_pb.CallToolRequest(session_id=f"s{i}", episode_id=common_pb2.EpisodeId(rollout_id=f"e{i}"))
        for i in range(1000)
    ]
    t0 = time.perf_counter()
    for i in range(calls):
        balancer.pick("resources/counter", affinity_key(requests[i % 1000]))
    return (time.perf_counter() - t0) / calls * 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", help="Ray cluster address (default: a private local instance)")
    parser.add_argument("--replicas", default="1,2,4", help="comma-separated replica counts (default %(default)s)")
    parser.add_argument("-n", "--episodes", type=int, default=200, help="timed episodes per round")
    parser.add_argument("-c", "--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per level; the median is shown")
    parser.add_argument("--json", type=Path, help="write all results here")
    args = parser.parse_args(argv)
    base = load_tasks(gymrpc.envs.counter.example_tasks_path())
    levels = [int(r) for r in args.replicas.split(",")]
    print(
        f"episodes through Ray-launched replicas (scripted model, counter, concurrency {args.concurrency}); "
        f"python {platform.python_version()}, {os.cpu_count()} cpus"
    )
    print(f"{'replicas':>8} {'episodes/s':>10} {'vs 1':>6} {'p50 ms':>8} {'p95 ms':>8} {'up s':>6}  episodes per agent")
    results = []
    for replicas in levels:
        level = asyncio.run(run_level(replicas, args.address, base, args.episodes, args.concurrency, args.rounds))
        results.append(level)
        m, first = level["median"], results[0]["median"]["episodes_per_s"]
        print(
            f"{replicas:>8} {m['episodes_per_s']:>10.1f} {m['episodes_per_s'] / first:>6.2f} {m['p50_ms']:>8.1f}"
            f" {m['p95_ms']:>8.1f} {level['stack_up_s']:>6.1f}  {level['episodes_per_agent']}",
            flush=True,
        )
    choice_cost(2, 50_000)  # warm up
    costs = {r: min(choice_cost(r) for _ in range(5)) for r in (1, 2, 4, 8)}
    print(
        "replica choice per call (affinity_key + Balancer.pick): "
        + ", ".join(f"{r}: {ns:.0f} ns" for r, ns in costs.items())
    )
    if args.json:
        meta = {"python": platform.python_version(), "cpus": os.cpu_count(), **vars(args) | {"json": str(args.json)}}
        args.json.write_text(json.dumps({"meta": meta, "levels": results, "choice_ns": costs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
