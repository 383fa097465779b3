"""The durable agent's CPU in one process: what per-episode resume adds, without the stack's noise.

`bench/resume.py` measures durable resume through a stack of processes sharing two cores, where
other jobs move a single run's on / off ratio by a tenth. Here everything runs in this process:
the agent's loop (`EpisodeLoop`, `DurableEpisodes`), the real counter resources servicer and the
real scripted model servicer (counter policy), called directly (no gRPC), and the real
`LogEpisodeStore` on `--dir`. Only CPU is measured (the process's, its event-loop thread's and
its stores' commit threads'), so the figure is what durability costs the agent, per episode and
per boundary, within a few percent from run to run. The same counter episodes run at a fixed
concurrency in four modes, in many short rounds alternating (the order reversed every round);
each mode's CPU is the median of its rounds, and what it adds to `off` the median of its rounds'
differences to the `off` round beside them (the machine's slow swings cancel out):

- `off`: `EpisodeLoop.run`, no checkpoints;
- `on`: `DurableEpisodes` with a `LogEpisodeStore` (the agent's default store);
- `no-writes`: `DurableEpisodes` with a store that writes nothing (a save only bumps the record's
  revision): the durable path's own work (records, leases, snapshots in replies);
- `no-commit`: a `LogEpisodeStore` that builds every frame but hands none to its commit thread:
  the save's encoding (serialisation, field diff, CRC, frame) without the hand-over and the sync.

`on` minus `off` is split into those three parts.

`--only MODE` runs one mode alone (a warm-up round, then the rounds): a run to count under
`valgrind --tool=callgrind`, whose instruction counts do not move with the machine's load
(`bench/README.md`, "A record writer that touches only what moved").

    .venv/bin/python bench/durable_cpu.py [--quick] [--episodes N] [--concurrency C] [--rounds R] [--dir PATH]
        [--only MODE] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from store import thread_cpu  # noqa: E402  (bench/store.py, beside this script)

from gymrpc.chat import default_tokenizer  # noqa: E402
from gymrpc.envs.counter import CounterEnvironment, example_tasks_path  # noqa: E402
from gymrpc.messages import task_from_row  # noqa: E402
from gymrpc.servers.agent.durable import DurableEpisodes, ResumeConfig  # noqa: E402
from gymrpc.servers.agent.loop import EpisodeLoop  # noqa: E402
from gymrpc.servers.agent.state import EpisodeState  # noqa: E402
from gymrpc.servers.bootstrap import settle_heap  # noqa: E402
from gymrpc.servers.model.backends.scripted import ScriptedBackend  # noqa: E402
from gymrpc.servers.model.backends.sources import CounterSolver  # noqa: E402
from gymrpc.servers.model.service import ModelServicer  # noqa: E402
from gymrpc.servers.resources.service import ResourcesServicer  # noqa: E402
from gymrpc.store import EpisodeCheckpoint, EpisodeLease, EpisodeStore, LogEpisodeStore  # noqa: E402
from gymrpc.store import log as log_store  # noqa: E402
from gymrpc.v1 import common_pb2  # noqa: E402

MODES = ("off", "on", "no-writes", "no-commit")
ROUND_FIGURES = ("cpu_ms", "main_ms", "commit_ms")
"""CPU ms per episode: the process's, its event loop thread's, the stores' commit threads'."""
POLICY = "bench:0"


class Direct:
    """A servicer called as the agent calls a generated stub (`await stub.Method(request, timeout=...)`),
    without gRPC: what is measured is the agent's work, and the servers' work it asks for."""

    def __init__(self, servicer: Any) -> None:
        self._servicer = servicer

    def __getattr__(self, method: str) -> Callable[..., Any]:
        impl = getattr(self._servicer, method)

        async def call(request: Any, *, timeout: float | None = None) -> Any:
            return await impl(request, None)

        setattr(self, method, call)  # built once per method
        return call


class NoWrites(LogEpisodeStore):
    """Leases as the log store takes them; a save only bumps the record's revision."""

    async def save(self, lease: EpisodeLease, record: EpisodeCheckpoint) -> None:
        self._check(lease)
        record.revision += 1

    begin_save = EpisodeStore.begin_save  # saves at once (the log store's own would encode a frame)


class NoCommit(LogEpisodeStore):
    """Every frame built as the log store builds it, none handed to the commit thread."""

    def _append_nowait(self, held: Any, *frame: Any) -> Any:
        written = asyncio.get_running_loop().create_future()
        written.set_result(None)
        return log_store._Append(held.rollout_id, *frame, loop=None, future=written)  # type: ignore[arg-type]


def tasks() -> list[common_pb2.Task]:
    rows = [json.loads(line) for line in example_tasks_path().read_text().splitlines() if line.strip()]
    return [task_from_row(row, str(i)) for i, row in enumerate(rows)]


class Bench:
    def __init__(self, folder: Path, concurrency: int) -> None:
        self.concurrency, self.tasks, self.started = concurrency, tasks(), 0
        tokenizer = default_tokenizer()
        model = ModelServicer(ScriptedBackend(tokenizer, [CounterSolver()], weight_version=POLICY), tokenizer)
        self.loop = EpisodeLoop(Direct(ResourcesServicer(CounterEnvironment(), workers=2)), Direct(model))
        self.stores = {
            "on": LogEpisodeStore(folder / "on"),
            "no-writes": NoWrites(folder / "no-writes"),
            "no-commit": NoCommit(folder / "no-commit"),
        }
        self.durable = {mode: DurableEpisodes(self.loop, store, ResumeConfig()) for mode, store in self.stores.items()}

    async def round(self, mode: str, episodes: int) -> dict[str, float]:
        """`episodes` episodes, `concurrency` at a time; CPU ms per episode of the process and its main thread."""
        gate = asyncio.Semaphore(self.concurrency)
        first, self.started = self.started, self.started + episodes
        durable = self.durable.get(mode)

        async def one(i: int) -> None:
            state = EpisodeState(f"{mode}-{i}", 0, self.tasks[i % len(self.tasks)], 8, policy_version=POLICY)
            async with gate:
                if durable is None:
                    trajectory = await self.loop.run(state)
                else:
                    async for event in durable.run(state, progress=False):
                        trajectory = event
            if trajectory.reward != 1.0:
                raise RuntimeError(f"episode {state.label} ({mode}) earned {trajectory.reward}")

        process, threads = time.process_time(), thread_cpu()  # in a mode, only its own store's commit thread works
        await asyncio.gather(*(one(i) for i in range(first, first + episodes)))
        after = thread_cpu()
        return {
            "cpu_ms": (time.process_time() - process) / episodes * 1e3,
            "main_ms": (after["loop"] - threads["loop"]) / episodes * 1e3,
            "commit_ms": (after["commit"] - threads["commit"]) / episodes * 1e3,
        }

    async def close(self) -> None:
        for store in self.stores.values():
            await store.close()


async def measure(args: argparse.Namespace, folder: Path, modes: tuple[str, ...] = MODES) -> dict[str, Any]:
    bench = Bench(folder, args.concurrency)
    rounds: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    try:
        for mode in modes:  # warm-up: imports, the servicers' caches, the stores' first folders
            await bench.round(mode, args.concurrency)
        saves = bench.stores["on"].stats.writes  # the only store that counts its saves: the boundaries
        for r in range(args.rounds):
            for mode in modes if r % 2 == 0 else reversed(modes):
                rounds[mode].append(await bench.round(mode, args.episodes))
                print(f"  round {r} {mode:9s} {rounds[mode][-1]['cpu_ms']:6.3f} ms CPU per episode", flush=True)
        boundaries = (bench.stores["on"].stats.writes - saves) / (args.rounds * args.episodes)
    finally:
        await bench.close()
    result: dict[str, Any] = {"boundaries_per_episode": boundaries} if "on" in modes else {}
    for mode in modes:
        result[mode] = {key: statistics.median(r[key] for r in rounds[mode]) for key in ROUND_FIGURES}
        if "off" in rounds:
            result[mode]["added_us"] = statistics.median(
                (r["cpu_ms"] - off["cpu_ms"]) * 1e3 for r, off in zip(rounds[mode], rounds["off"], strict=True)
            )
    return result


def _cpu(r: dict[str, float]) -> str:
    return (
        f"{r['cpu_ms']:6.3f} ms CPU per episode (event loop thread {r['main_ms']:6.3f}, commit thread "
        f"{r['commit_ms']:6.3f})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short run (smoke tests)")
    parser.add_argument("--episodes", type=int, help="episodes per round (default 500; quick 100)")
    parser.add_argument("--concurrency", type=int, default=64, help="episodes in flight (default %(default)s)")
    parser.add_argument("--rounds", type=int, help="rounds per mode (default 15; quick 1)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp"), help="folder on the filesystem of the store")
    parser.add_argument("--only", choices=MODES, help="run this mode alone (to count its instructions)")
    parser.add_argument("--json", type=Path, help="also write the results as JSON")
    args = parser.parse_args(argv)
    args.episodes = args.episodes or (100 if args.quick else 500)
    args.rounds = args.rounds or (1 if args.quick else 15)
    settle_heap()  # as every server process does before it serves
    with tempfile.TemporaryDirectory(prefix="gymrpc-durable-cpu-", dir=args.dir) as tmp:
        results = asyncio.run(measure(args, Path(tmp), (args.only,) if args.only else MODES))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": {**vars(args), "dir": str(args.dir), "json": str(args.json)}, "results": results}, indent=2
            )
        )
    if args.only:
        r = results[args.only]
        print(f"{args.only}: {_cpu(r)}")
        return 0
    off, on = results["off"], results["on"]
    per = results["boundaries_per_episode"]
    print(
        f"\n{args.episodes} counter episodes per round, concurrency {args.concurrency}, {args.rounds} rounds (median)"
    )
    for mode in MODES:
        r = results[mode]
        print(f"{mode:9s} {_cpu(r)}  {r['added_us']:+6.0f} us against off")
    added, path = on["added_us"], results["no-writes"]["added_us"]
    encoding = results["no-commit"]["added_us"] - path
    print(
        f"durable resume adds {added:.0f} us CPU per episode, {added / per:.1f} us per boundary ({per:.1f} "
        f"boundaries per episode): the durable path {path:.0f} us, the saves' encoding {encoding:.0f} us, the "
        f"commit (hand-over, commit thread, sync) {added - path - encoding:.0f} us, of which the commit thread's "
        f"own CPU {on['commit_ms'] * 1e3:.0f} us"
    )
    print(
        f"RATIO on / off: {on['cpu_ms'] / off['cpu_ms']:.3f}x CPU per episode in this process (the agent and the "
        "servers' own work; a stack adds gRPC and its processes to both, so its ratio is nearer 1)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
