"""Coordinated checkpoints with many episodes in flight: Prepare latency, Commit and Restore wall time, bytes.

Participants are real gRPC servers (`grpc.aio` on 127.0.0.1, token check and error mapping as
`gymrpc up` serves them) running in this one process (`tests/control/deployment.py`): an agent-kind
participant, models and counter resources servers. One process keeps the figures about the
control plane itself (no scheduler noise from a dozen processes); the cost of a process hop is
the same loopback gRPC call either way. But one event loop also serialises what a stack does side
by side: a pause holds the sum of every participant's handling. `--processes` serves each
participant from a process of its own (this script with `--serve NAME`), as a stack does; the
participants' own capture timings are then not read. Every episode in flight has a live resources session
(exported snapshot), a model ledger row per delivered call, and agent state at a boundary.

Measured, with `--episodes` in flight:
- Prepare: each participant's `Prepare` RPC (p50, p99 over participants x rounds) and the whole
  staged prepare as the controller runs it (environment, model, agent, resources), each round
  followed by a resume; 200 rounds by default, so the p99 is a p99 (of 30 it is the maximum,
  which is printed too);
- Commit: the controller's commit of every episode (all participants at once, records then
  manifest, fsync), wall time per round, into a fresh folder each round; in two modes, rounds
  alternating. Stop-the-world (`Controller.commit`, then resume): the episodes stay parked for
  the write. Non-stop (`Controller.capture`, resume, `Controller.publish`): they are parked only
  for the in-memory capture, and each member resumes as soon as it and its callers captured
  (`Controller.capture(resume=True)`, as `Controller.checkpoint` does). For each: the time
  parked (commit's start to the end of the resume; the prepare before it is the figure above)
  and the time from commit's start to the published index; for non-stop, also the
  participants' captures alone (each plane's own timing, summed:
  they share this process's event loop, so the pause holds their sum). Non-stop runs twice: with
  the packed scope controllers send, and with one `EpisodeId` message per episode (what an older
  participant gets, and what every controller sent before), rounds alternating, so the ratio of
  the two is measured under one load;
- Restore: into freshly started participants, all or nothing, wall time; then resume;
- bytes per episode: the records files' size (manifests' `size_bytes`) over the episodes, per kind;
- incremental commits: one full checkpoint, then `--changed` episodes take one more step (a model
  call and a tool call), then an incremental checkpoint (`Controller.checkpoint(incremental=True)`,
  which refers to the unchanged records of the first) and a full one of the same state, in this
  run: the bytes each wrote (every file in its folder: records, manifests, index) and the ratio of
  incremental over full, and the time from commit to publish of each.

The reference (NeMo Gym, HTTP) reports prepare in 4-8 ms with 40-80 episodes in flight.

    .venv/bin/python bench/control.py [--quick] [--episodes N] [--rounds R] [--resources K] [--changed C]
        [--processes] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gymrpc.control import EpisodeKey  # noqa: E402
from tests.control.deployment import Deployment, DirectClient, start_node  # noqa: E402

REFERENCE = "reference (NeMo Gym): prepare 4-8 ms with 40-80 episodes in flight"
MODES = ("stop", "nonstop", "nonstop-messages")
"""Commit rounds cycle through these: stop-the-world; non-stop with the packed scope (what controllers
send); non-stop with one `EpisodeId` message per episode (what they send a participant that does not
say it reads the packed form, and what every controller sent before), so both scope forms are
measured in one run, under the same load."""
ORDER = ("stop", "nonstop", "nonstop-messages", "stop", "nonstop-messages", "nonstop")
"""Each non-stop mode follows stop-the-world (whose records are built in the pause, leaving the most
garbage) as often as the other does."""


class _Timed:
    """A participant stub whose `Prepare` and `Commit` calls are timed; other methods pass through."""

    def __init__(self, stub: Any, timings: dict[str, dict[str, list[float]]], name: str) -> None:
        self._stub = stub
        self.Prepare = self._timed(stub.Prepare, timings["prepare"], name)
        self.Commit = self._timed(stub.Commit, timings["commit"], name)

    @staticmethod
    def _timed(call: Any, timings: dict[str, list[float]], name: str) -> Any:
        async def timed(request: Any, *, timeout: float | None = None) -> Any:
            started = time.perf_counter()
            try:
                return await call(request, timeout=timeout)
            finally:
                timings[name].append((time.perf_counter() - started) * 1000)

        return timed

    def __getattr__(self, method: str) -> Any:
        return getattr(self._stub, method)


class TimedClient(DirectClient):
    """Records the latency of every `Prepare` and `Commit` RPC, per participant (one wrapper per stub)."""

    def __init__(self, base: DirectClient) -> None:
        super().__init__(base.nodes)
        self.prepare_ms: dict[str, list[float]] = defaultdict(list)
        self.commit_ms: dict[str, list[float]] = defaultdict(list)
        self._timed: dict[str, _Timed] = {}

    def participant(self, name: str) -> Any:
        stub = super().participant(name)
        timed = self._timed.get(name)
        if timed is None or timed._stub is not stub:
            timed = self._timed[name] = _Timed(stub, {"prepare": self.prepare_ms, "commit": self.commit_ms}, name)
        return timed


@dataclasses.dataclass
class ProcessNode:
    """A participant served by a process of its own (`--processes`), as `Deployment` sees a node."""

    name: str
    address: str
    process: asyncio.subprocess.Process
    alive: bool = True

    async def kill(self) -> None:
        if self.alive:
            self.alive = False
            assert self.process.stdin is not None
            self.process.stdin.close()  # the child stops its server and exits
            await self.process.wait()


async def spawn(participants: list[str], episodes: int) -> Deployment:
    """Each participant in its own process (`--serve`), as in a stack; the agent tracks its episodes itself."""
    nodes: dict[str, Any] = {}
    for name in participants:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--serve",
            name,
            "--episodes",
            str(episodes),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert process.stdout is not None
        address = (await process.stdout.readline()).decode().strip()
        assert address, f"{name} did not start"
        nodes[name] = ProcessNode(name, address, process)
    deployment = Deployment(nodes)
    await deployment.controller.discover()
    return deployment


async def serve(name: str, episodes: int) -> None:
    """One participant for `--processes`: print its address, serve until stdin closes."""
    node = await start_node(name)
    if name.startswith("agent/"):
        for key in keys_of(episodes):
            node.participant.track(key)
    print(node.address, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await node.kill()


def keys_of(episodes: int) -> list[EpisodeKey]:
    return [EpisodeKey(f"e{i:05d}", 0) for i in range(episodes)]


def names(resources: int, models: int) -> list[str]:
    return ["agent/a", *(f"model/m{i}" for i in range(models)), *(f"resources/r{i}" for i in range(resources))]


async def load(deployment: Deployment, episodes: int, resources: int, models: int) -> list[EpisodeKey]:
    """Put `episodes` in flight: a seeded session, one delivered model call, one tool call, agent state."""
    keys = keys_of(episodes)
    agent = getattr(deployment.nodes["agent/a"], "participant", None)  # None: its own process tracks them
    gate = asyncio.Semaphore(64)

    async def one(i: int, key: EpisodeKey) -> None:
        async with gate:
            res, model = f"resources/r{i % resources}", f"model/m{i % models}"
            await deployment.seed(res, key)
            await deployment.generate(model, key, 0)
            await deployment.increment(res, key, "call-0")
            if agent is not None:
                agent.track(key)

    await asyncio.gather(*(one(i, k) for i, k in enumerate(keys)))
    return keys


def folder_bytes(folder: Path) -> int:
    """Every byte a checkpoint wrote into its folder: records files, manifests, index."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


async def incremental(deployment: Deployment, root: Path, keys: list[EpisodeKey], args: argparse.Namespace) -> dict:
    """Bytes written by an incremental commit after `args.changed` episodes moved, against a full one."""
    controller = deployment.controller
    base = await controller.checkpoint(root, episode_ids=keys, checkpoint_id="inc-base", timeout=120, incremental=True)
    assert base.committed
    for i, key in enumerate(keys[: args.changed]):
        await deployment.generate(f"model/m{i % args.models}", key, 1)
        await deployment.increment(f"resources/r{i % args.resources}", key, "call-1")
    figures: dict[str, Any] = {"changed": min(args.changed, len(keys))}
    for mode, incremental in (("incremental", True), ("full", False)):
        result = await controller.checkpoint(
            root, episode_ids=keys, checkpoint_id=f"inc-{mode}", timeout=120, incremental=incremental
        )
        assert result.committed
        figures[mode] = {
            "bytes": folder_bytes(result.checkpoint_dir),
            "commit_to_publish_ms": result.timings["commit_to_publish"] * 1000,
        }
    figures["ratio"] = figures["incremental"]["bytes"] / figures["full"]["bytes"]
    return figures


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    participants = names(args.resources, args.models)

    async def start(episodes: int = 0) -> Deployment:
        """`episodes`: how many the agent process tracks from its start (a restore needs a fresh one)."""
        return await (spawn(participants, episodes) if args.processes else Deployment.start(participants))

    deployment = await start(args.episodes)
    timed = TimedClient(deployment.client)
    deployment.client = timed
    deployment.controller.client = timed  # type: ignore[assignment]
    root = Path(tempfile.mkdtemp(prefix="gymrpc-bench-control-"))
    try:
        started = time.perf_counter()
        keys = await load(deployment, args.episodes, args.resources, args.models)
        load_s = time.perf_counter() - started
        for warm in range(2):
            await deployment.controller.prepare(f"warm-{warm}", timeout=30)
            await deployment.controller.resume(f"warm-{warm}")
        timed.prepare_ms.clear()
        staged_ms: list[float] = []
        parked_ms: dict[str, list[float]] = {mode: [] for mode in MODES}
        publish_ms: dict[str, list[float]] = {mode: [] for mode in MODES}
        capture_ms: dict[str, list[float]] = {mode: [] for mode in MODES[1:]}
        slowest_commit_ms: dict[str, list[float]] = {mode: [] for mode in MODES[1:]}
        resume_ms: dict[str, list[float]] = {mode: [] for mode in MODES[1:]}
        manifests: dict[str, Any] = {}
        controller = deployment.controller
        members = await controller.discover()
        as_messages = [dataclasses.replace(m, packed_scope=False) for m in members]  # as an older participant
        for round_ in range(args.rounds):
            checkpoint_id = f"c{round_}"
            started = time.perf_counter()
            result = await controller.prepare(checkpoint_id, timeout=30)
            staged_ms.append((time.perf_counter() - started) * 1000)
            assert result.prepared, result.blockers()
            if round_ >= len(MODES) * args.commits:
                await controller.resume(checkpoint_id)
                continue
            folder = root / checkpoint_id
            mode = ORDER[round_ % len(ORDER)]
            controller.members = as_messages if mode == "nonstop-messages" else members
            timed.commit_ms.clear()
            started = time.perf_counter()
            if mode == "stop":  # stop-the-world: parked until every member wrote
                manifests = await controller.commit(checkpoint_id, folder, keys, timeout=120)
                published = time.perf_counter()
                await controller.resume(checkpoint_id)
                resumed = time.perf_counter()
            else:  # non-stop: parked for the capture only; each member resumes once it and its callers captured
                captured = await controller.capture(checkpoint_id, folder, keys, timeout=120, resume=True)
                resumed = time.perf_counter()
                slowest = max(max(v) for v in timed.commit_ms.values())
                slowest_commit_ms[mode].append(slowest)
                resume_ms[mode].append((resumed - started) * 1000 - slowest)
                if not args.processes:  # each plane's own timing, read in this process
                    captures = [node.plane.capture_seconds(checkpoint_id) for node in deployment.nodes.values()]
                    capture_ms[mode].append(sum(s or 0.0 for s in captures) * 1000)
                manifests, _ = await controller.publish(captured)
                published = time.perf_counter()
            parked_ms[mode].append((resumed - started) * 1000)
            publish_ms[mode].append((published - started) * 1000)
        controller.members = members
        increments = await incremental(deployment, root / "incremental", keys, args)
        per_rpc = [ms for values in timed.prepare_ms.values() for ms in values]
        bytes_by_kind: dict[str, int] = defaultdict(int)
        for name, manifest in manifests.items():
            bytes_by_kind[name.partition("/")[0]] += manifest.size_bytes
        fresh = await start()
        try:
            started = time.perf_counter()
            restored = await fresh.controller.restore("restore-1", root / "c1", keys, timeout=300)
            restore_ms = (time.perf_counter() - started) * 1000
            await fresh.controller.resume("restore-1")
            assert len(restored["agent/a"].restored) == len(keys)
        finally:
            await fresh.close()
        total_bytes = sum(bytes_by_kind.values())
        return {
            "episodes": args.episodes,
            "participants": len(participants),
            "rounds": args.rounds,
            "load_s": round(load_s, 2),
            "prepare_rpc_ms": {"p50": pct(per_rpc, 50), "p99": pct(per_rpc, 99), "n": len(per_rpc)},
            "prepare_staged_ms": {
                "p50": pct(staged_ms, 50),
                "p99": pct(staged_ms, 99),
                "max": max(staged_ms),
                "n": len(staged_ms),
            },
            "commit_ms": {
                mode: {
                    "parked_median": statistics.median(parked_ms[mode]),
                    "parked_max": max(parked_ms[mode]),
                    "publish_median": statistics.median(publish_ms[mode]),
                    "publish_max": max(publish_ms[mode]),
                    "n": len(parked_ms[mode]),
                }
                for mode in MODES
            },
            "processes": args.processes,
            "nonstop_parts_ms": {
                mode: {
                    "slowest_commit_rpc_median": statistics.median(slowest_commit_ms[mode]),
                    "resume_median": statistics.median(resume_ms[mode]),
                }
                for mode in MODES[1:]
            },
            "capture_ms_summed": {
                mode: {"median": statistics.median(values), "max": max(values)}
                for mode, values in capture_ms.items()
                if values
            },
            "restore_ms": restore_ms,
            "bytes_per_episode": total_bytes / args.episodes,
            "bytes_per_episode_by_kind": {k: v / args.episodes for k, v in sorted(bytes_by_kind.items())},
            "incremental": increments,
        }
    finally:
        await deployment.close()
        gc.collect()  # stopped grpc.aio servers are collected while their loop still runs
        shutil.rmtree(root, ignore_errors=True)  # the checkpoints written: hundreds of MB at 5,000 episodes


def report(r: dict[str, Any]) -> str:
    rpc, staged, commit = r["prepare_rpc_ms"], r["prepare_staged_ms"], r["commit_ms"]
    kinds = ", ".join(f"{k} {v:.0f}" for k, v in r["bytes_per_episode_by_kind"].items())
    inc = r["incremental"]
    return "\n".join(
        [
            f"{r['episodes']} episodes in flight across {r['participants']} participants "
            f"({'gRPC servers, one process each' if r['processes'] else 'in-process gRPC servers'}; "
            f"loaded in {r['load_s']} s), {r['rounds']} rounds",
            f"prepare, per participant RPC: p50 {rpc['p50']:.2f} ms, p99 {rpc['p99']:.2f} ms ({rpc['n']} calls)",
            f"prepare, whole staged prepare:  p50 {staged['p50']:.2f} ms, p99 {staged['p99']:.2f} ms "
            f"(max {staged['max']:.2f} ms, {staged['n']} rounds)",
            *(
                f"commit, {label}: parked median {c['parked_median']:.1f} ms (max {c['parked_max']:.1f}), "
                f"commit to publish median {c['publish_median']:.1f} ms (max {c['publish_max']:.1f}), "
                f"{c['n']} checkpoints"
                for label, c in (
                    ("stop-the-world          ", commit["stop"]),
                    ("non-stop                ", commit["nonstop"]),
                    ("non-stop, EpisodeId scope", commit["nonstop-messages"]),
                )
            ),
            *(
                f"{label}, the participants' captures alone (summed): median {c['median']:.1f} ms (max {c['max']:.1f})"
                for label, mode in (("non-stop", "nonstop"), ("non-stop, EpisodeId scope", "nonstop-messages"))
                if (c := r["capture_ms_summed"].get(mode)) is not None
            ),
            *(
                f"{label}: of the time parked, the Commit fan-out (its slowest RPC) median "
                f"{p['slowest_commit_rpc_median']:.1f} ms, the rest (the resumes after it) "
                f"median {p['resume_median']:.1f} ms"
                for label, p in (
                    ("non-stop", r["nonstop_parts_ms"]["nonstop"]),
                    ("non-stop, EpisodeId scope", r["nonstop_parts_ms"]["nonstop-messages"]),
                )
            ),
            f"parked time, non-stop over stop-the-world: "
            f"{commit['nonstop']['parked_median'] / commit['stop']['parked_median']:.2f}x",
            f"parked time, packed scope over one EpisodeId message per episode (both non-stop): "
            f"{commit['nonstop']['parked_median'] / commit['nonstop-messages']['parked_median']:.2f}x",
            f"restore into fresh participants: {r['restore_ms']:.1f} ms",
            f"bytes per episode: {r['bytes_per_episode']:.0f} ({kinds})",
            f"incremental commit after {inc['changed']} of {r['episodes']} episodes changed: "
            f"{inc['incremental']['bytes']} bytes written, full commit of the same state {inc['full']['bytes']} bytes: "
            f"{inc['ratio']:.3f}x (commit to publish {inc['incremental']['commit_to_publish_ms']:.1f} ms vs "
            f"{inc['full']['commit_to_publish_ms']:.1f} ms)",
            REFERENCE,
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="100 episodes, 6 rounds (a smoke run)")
    parser.add_argument("--episodes", type=int, default=1000)
    parser.add_argument(
        "--rounds", type=int, default=200, help="prepare/resume rounds (a p99 needs well over 100; 30 gives the max)"
    )
    parser.add_argument("--commits", type=int, default=5, help="checkpoints of each mode (rounds that also commit)")
    parser.add_argument("--resources", type=int, default=4, help="resources servers")
    parser.add_argument("--models", type=int, default=2, help="model servers")
    parser.add_argument("--changed", type=int, default=10, help="episodes that move before the incremental commit")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--processes", action="store_true", help="each participant in its own process, as in a stack (not --quick)"
    )
    parser.add_argument("--serve", metavar="NAME", help=argparse.SUPPRESS)  # one participant of --processes
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, args.episodes))
        return 0
    if args.quick:
        args.episodes, args.rounds, args.commits = 100, 6, 2
    args.commits = max(1, min(args.commits, args.rounds // len(MODES)))
    args.rounds = max(args.rounds, len(MODES) * args.commits)
    result = asyncio.run(bench(args))
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
