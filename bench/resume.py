"""Durable resume on vs off: the cost of checkpointing every boundary, measured in one run.

One stack (`gymrpc up`, real processes): resources/counter, the real model server (scripted
counter policy), and agents that differ only in resume: `agent/off` (no checkpoints),
`agent/on` (`--resume-dir`, the default store: one group-committed log per agent) and,
unless `--quick`, `agent/files` (`--resume-store files`: one file per episode, fsync per
file, group commit) and `agent/syncfs` (`--resume-store files --resume-sync filesystem`).
They share the resources and model servers, and rounds interleave the agents (order
reversed every round), so load and noise hit all of them alike. Each round runs the same
counter tasks through `gymrpc.Client.run` at a fixed concurrency; episodes/s is the median
over the timed rounds.

Durability cost is reported three ways:
- episodes/s ratio on/off, of the medians and, for its spread, round by round (a round of
  `on` and `off`'s round of the same number run back to back); agent CPU seconds per episode,
  from /proc, and its main thread's share (the event loop; the rest is the store's and
  gRPC's threads); the CPU a boundary adds is the difference to `agent/off` divided by the
  boundaries per episode, over all timed rounds and round by round; the stack's CPU per
  episode: the agent's plus, during its rounds, each shared server's (resources, model) and
  this client's; and how busy the whole machine was during its rounds: near 100 %, the
  stack is CPU-bound and its episodes/s follows its CPU per episode;
- bytes per boundary: the store's own count of record bytes written (header + payload)
  divided by the saves it made, and saves (boundaries) and fsyncs per episode; the agent
  logs these counters when it stops gracefully, which the bench parses;
- bytes the agent process made the kernel write to storage (/proc/PID/io `write_bytes`),
  per episode: records plus filesystem overhead as the kernel attributes it.

    .venv/bin/python bench/resume.py [--quick] [--episodes N] [--concurrency C] [--rounds R] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gymrpc.client import Client  # noqa: E402
from gymrpc.messages import task_from_row  # noqa: E402
from gymrpc.v1 import common_pb2  # noqa: E402

POLICY = "bench:0"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def tasks() -> list[common_pb2.Task]:
    from gymrpc.envs.counter import example_tasks_path

    rows = [json.loads(line) for line in example_tasks_path().read_text().splitlines() if line.strip()]
    return [task_from_row(row, str(i)) for i, row in enumerate(rows)]


def stack_config(store: Path, agents: list[str]) -> dict[str, Any]:
    servers: list[dict[str, Any]] = [
        {"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}},
        {"name": "model/policy", "role": "model", "args": {"backend": "scripted", "policy": "counter"}},
    ]
    for name in agents:
        args: dict[str, Any] = {"resources": "resources/counter", "model": "model/policy", "max_steps": 8}
        if name != "agent/off":
            args["resume_dir"] = str(store / name.replace("/", "-"))
        if name in ("agent/files", "agent/syncfs"):
            args["resume_store"] = "files"
        if name == "agent/syncfs":
            args["resume_sync"] = "filesystem"
        servers.append({"name": name, "role": "agent", "args": args})
    return {"servers": servers}


class Stack:
    """`gymrpc up` in a subprocess; `stop` is a graceful `SIGTERM` so the agents log their store counters."""

    def __init__(self, run_dir: Path, config: dict[str, Any]) -> None:
        self.run_dir = run_dir
        (run_dir / "stack.yaml").write_text(yaml.safe_dump(config))
        self.log = open(run_dir / "up.log", "wb")  # noqa: SIM115 - closed in stop()
        argv = [sys.executable, "-m", "gymrpc.cli", "up", "--run-dir", str(run_dir), str(run_dir / "stack.yaml")]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=self.log, env=env, cwd=ROOT)
        deadline = time.monotonic() + 120
        while (state := self.state()) is None or state["state"] != "serving":
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the stack did not start:\n{(run_dir / 'up.log').read_text()[-3000:]}")
            time.sleep(0.1)

    def state(self) -> dict[str, Any] | None:
        try:
            state = json.loads((self.run_dir / "stack.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return state if state.get("launcher_pid") == self.process.pid else None

    def pid(self, name: str) -> int:
        state = self.state()
        assert state is not None
        return int(next(s["pid"] for s in state["servers"] if s["name"] == name))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()


def _cpu_s(stat: str) -> float:
    """User + system CPU seconds from a /proc `stat` file (of a process or of one of its threads)."""
    fields = Path(stat).read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def main_thread_cpu_s(pid: int) -> float:
    """CPU seconds of a process's main thread (the event loop; the rest is the store's and gRPC's threads)."""
    return _cpu_s(f"/proc/{pid}/task/{pid}/stat")


def proc_counters(pid: int) -> dict[str, float]:
    """CPU seconds and storage write bytes / write syscalls of a process, from /proc."""
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return {
        "cpu_s": _cpu_s(f"/proc/{pid}/stat"),
        "write_bytes": float(io["write_bytes"]),
        "syscw": float(io["syscw"]),
    }


def store_stats(log: Path) -> dict[str, int]:
    for line in reversed(log.read_text().splitlines()):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if entry.get("msg") == "episode store stats":
            return {k: int(entry[k]) for k in ("writes", "bytes", "batches", "fsyncs", "failures")}
    raise RuntimeError(f"no store stats in {log}")


async def run_round(client: Client, agent: str, label: str, episodes: int, concurrency: int) -> float:
    """Run `episodes` episodes through `agent`, `concurrency` at a time; episodes per second."""
    work = tasks()
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            t = await client.run(work[i % len(work)], episode_id=f"{label}-{i}", policy_version=POLICY, agent=agent)
        if t.reward != 1.0:
            raise RuntimeError(f"{agent} episode {label}-{i} earned {t.reward}")

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(episodes)))
    return episodes / (time.perf_counter() - started)


SHARED = ("resources/counter", "model/policy")
"""The servers every agent shares: their CPU during an agent's rounds is counted to that agent."""
CLIENT = "client"
"""This process (the `gymrpc.Client` running the rounds), counted like the shared servers."""


async def measure(stack: Stack, agents: list[str], args: argparse.Namespace) -> dict[str, Any]:
    rates: dict[str, list[float]] = {a: [] for a in agents}
    round_cpu: dict[str, list[float]] = {a: [] for a in agents}  # the agent's CPU ms per episode, each timed round
    ran = dict.fromkeys(agents, 0)
    shared_cpu = {a: dict.fromkeys((*SHARED, CLIENT), 0.0) for a in agents}  # CPU seconds in a's timed rounds
    machine = {a: [0, 0] for a in agents}  # busy and all CPU ticks of the whole machine in a's timed rounds
    async with Client(run_dir=stack.run_dir) as client:
        for agent in agents:  # warm-up: connections, the agents' first ListTools/probe, page cache
            await run_round(client, agent, f"warm-{agent.partition('/')[2]}", args.concurrency, args.concurrency)
            ran[agent] += args.concurrency
        before = {a: proc_counters(stack.pid(a)) for a in agents}
        main_before = {a: main_thread_cpu_s(stack.pid(a)) for a in agents}
        for r in range(args.rounds):
            for agent in agents if r % 2 == 0 else reversed(agents):
                label = f"r{r}-{agent.partition('/')[2]}"
                start, own = _shared_cpu_s(stack), proc_counters(stack.pid(agent))["cpu_s"]
                ticks = machine_ticks()
                rates[agent].append(await run_round(client, agent, label, args.episodes, args.concurrency))
                for i, (now, then) in enumerate(zip(machine_ticks(), ticks, strict=True)):
                    machine[agent][i] += now - then
                round_cpu[agent].append(1e3 * (proc_counters(stack.pid(agent))["cpu_s"] - own) / args.episodes)
                for name, seconds in _shared_cpu_s(stack).items():
                    shared_cpu[agent][name] += seconds - start[name]
                ran[agent] += args.episodes
                print(f"  round {r} {agent:13s} {rates[agent][-1]:7.1f} episodes/s", flush=True)
        after = {a: proc_counters(stack.pid(a)) for a in agents}
        main_after = {a: main_thread_cpu_s(stack.pid(a)) for a in agents}
    timed = args.rounds * args.episodes
    results = {}
    for a in agents:
        cpu_ms = 1e3 * (after[a]["cpu_s"] - before[a]["cpu_s"]) / timed
        results[a] = {
            "episodes_per_s": statistics.median(rates[a]),
            "rounds": rates[a],
            "episodes": ran[a],
            "cpu_ms_per_episode": cpu_ms,
            "main_thread_cpu_ms_per_episode": 1e3 * (main_after[a] - main_before[a]) / timed,
            "machine_busy": machine[a][0] / machine[a][1],
            "round_cpu_ms_per_episode": round_cpu[a],
            "stack_cpu_ms_per_episode": cpu_ms + 1e3 * sum(shared_cpu[a].values()) / timed,
            "shared_cpu_ms_per_episode": {name: 1e3 * cpu / timed for name, cpu in shared_cpu[a].items()},
            "disk_bytes_per_episode": (after[a]["write_bytes"] - before[a]["write_bytes"]) / timed,
            "write_syscalls_per_episode": (after[a]["syscw"] - before[a]["syscw"]) / timed,
        }
    return results


def machine_ticks() -> tuple[int, int]:
    """Busy and all CPU ticks of the machine so far (/proc/stat): busy / all near 1 means CPU-bound."""
    user, nice, system, idle, iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return user + nice + system + irq + softirq + steal, user + nice + system + idle + iowait + irq + softirq + steal


def _shared_cpu_s(stack: Stack) -> dict[str, float]:
    seconds = {name: proc_counters(stack.pid(name))["cpu_s"] for name in SHARED}
    seconds[CLIENT] = time.process_time()
    return seconds


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    off = results["agent/off"]
    print(f"\n{args.episodes} counter episodes per round, concurrency {args.concurrency}, {args.rounds} rounds")
    for agent, r in results.items():
        line = (
            f"{agent:13s} {r['episodes_per_s']:7.1f} episodes/s  agent CPU {r['cpu_ms_per_episode']:5.2f} ms/episode "
            f"(main thread {r['main_thread_cpu_ms_per_episode']:.2f})  machine busy {100 * r['machine_busy']:.0f} %  "
            f"stack CPU {r['stack_cpu_ms_per_episode']:5.2f} ms/episode "
            f"({', '.join(f'{n} {ms:.2f}' for n, ms in r['shared_cpu_ms_per_episode'].items())})  "
            f"disk {r['disk_bytes_per_episode'] / 1024:6.1f} KiB/episode"
        )
        if "store" in r:
            s = r["store"]
            line += (
                f"  | {s['bytes_per_boundary']:6.0f} B/boundary, {s['boundaries_per_episode']:.1f} boundaries "
                f"and {s['fsyncs_per_episode']:.1f} fsyncs per episode, {s['writes_per_batch']:.1f} saves per batch"
            )
            extra_ms = r["cpu_ms_per_episode"] - off["cpu_ms_per_episode"]
            s["cpu_ms_per_boundary"] = extra_ms / s["boundaries_per_episode"]
            paired = zip(r["round_cpu_ms_per_episode"], off["round_cpu_ms_per_episode"], strict=True)
            s["round_cpu_ms_per_boundary"] = [(on - o) / s["boundaries_per_episode"] for on, o in paired]
            line += (
                f", +{s['cpu_ms_per_boundary']:.3f} ms agent CPU per boundary (round by round against off: "
                f"{_spread(s['round_cpu_ms_per_boundary'])})"
            )
        print(line)
    for agent, r in results.items():
        if agent != "agent/off":
            paired = [a / b for a, b in zip(r["rounds"], off["rounds"], strict=True)]  # rounds run back to back
            print(
                f"RATIO {agent} / agent/off: {r['episodes_per_s'] / off['episodes_per_s']:.3f}x episodes/s "
                f"({r['episodes_per_s']:.1f} vs {off['episodes_per_s']:.1f}; round by round: {_spread(paired, '')})"
            )
    for agent, r in results.items():
        if "store" in r:
            s = r["store"]
            print(
                f"STORE {agent}: {s['bytes_per_boundary']:.0f} bytes per boundary, "
                f"{s['fsyncs_per_episode']:.2f} fsyncs per episode, {s['cpu_ms_per_boundary']:.3f} ms agent CPU "
                "per boundary"
            )


def _spread(values: list[float], unit: str = " ms") -> str:
    """Median and range: one tree's runs on this machine spread as much as the changes measured."""
    return f"median {statistics.median(values):.3f}, {min(values):.3f}-{max(values):.3f}{unit}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short run for smoke tests (log store on vs off only)")
    parser.add_argument("--episodes", type=int, help="timed episodes per agent per round (default 600; quick 120)")
    parser.add_argument("--concurrency", type=int, default=64, help="episodes in flight (default %(default)s)")
    parser.add_argument("--rounds", type=int, help="timed rounds (default 5; quick 2)")
    parser.add_argument("--json", type=Path, help="also write the results as JSON")
    args = parser.parse_args(argv)
    args.episodes = args.episodes or (120 if args.quick else 600)
    args.rounds = args.rounds or (2 if args.quick else 5)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    agents = ["agent/off", "agent/on"] + ([] if args.quick else ["agent/files", "agent/syncfs"])
    with tempfile.TemporaryDirectory(prefix="gymrpc-bench-", dir="/tmp") as tmp:
        run_dir = Path(tmp)
        stack = Stack(run_dir, stack_config(run_dir / "store", agents))
        try:
            results = asyncio.run(measure(stack, agents, args))
        finally:
            stack.stop()
        for agent in agents[1:]:
            stats = store_stats(run_dir / "logs" / f"{agent.replace('/', '__')}.log")
            episodes = results[agent]["episodes"]
            results[agent]["store"] = {
                **stats,
                "bytes_per_boundary": stats["bytes"] / stats["writes"],
                "boundaries_per_episode": stats["writes"] / episodes,
                "fsyncs_per_episode": stats["fsyncs"] / episodes,
                "writes_per_batch": stats["writes"] / stats["batches"],
            }
    report(results, args)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
