"""Episode store micro-bench: durable boundaries per second and CPU per boundary, log store against file store.

In one process, `--episodes` episodes are in flight at once; each takes its lease, saves
`--boundaries` boundaries of a counter-like record (a growing conversation, a tool call
record per step, a ~1 KB session snapshot replaced at every tool boundary), releases, and
starts the next episode, until `--total` boundaries were saved. Every save returns only once
durable. Rounds alternate the stores on the same filesystem: `log` (LogEpisodeStore, field
deltas), `log-whole` (every boundary written whole: `full_every=0`) and `files`
(FilesystemEpisodeStore); the median is reported. The disk's ceiling is measured in the same run: the same number of
batches of the log's average batch bytes written and `fdatasync`ed by one thread.

    .venv/bin/python bench/store.py [--quick] [--episodes N] [--total N] [--rounds R] [--dir PATH] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gymrpc.store import (  # noqa: E402
    SCHEMA_VERSION,
    EpisodeCheckpoint,
    EpisodeStore,
    FilesystemEpisodeStore,
    LogEpisodeStore,
    fields,
)
from gymrpc.v1 import agent_service_pb2 as agent_pb  # noqa: E402
from gymrpc.v1 import common_pb2  # noqa: E402

KINDS = ("log", "log-whole", "files")
TOOLS = [
    common_pb2.ToolDefinition(
        name=name, description=f"{name} the counter", parameters_json_schema='{"type":"object","properties":{}}'
    )
    for name in ("increment_counter", "get_counter_value")
]


def fresh(rollout_id: str) -> EpisodeCheckpoint:
    return EpisodeCheckpoint(
        schema_version=SCHEMA_VERSION,
        episode_id=common_pb2.EpisodeId(rollout_id=rollout_id),
        request_fingerprint="f" * 64,
        policy_version="bench:0",
        phase=agent_pb.EPISODE_PHASE_READY_FOR_MODEL,
        max_steps=8,
        session_id=f"session-{rollout_id}",
        tools=TOOLS,
        messages=[
            common_pb2.Message(role=common_pb2.ROLE_SYSTEM, content="You are a careful agent. " * 4),
            common_pb2.Message(role=common_pb2.ROLE_USER, content="Add 4 then 5 to the counter, then read it."),
        ],
    )


def boundary(record: EpisodeCheckpoint, step: int) -> None:
    """What one boundary of a counter episode changes: a turn, and at tool boundaries the session snapshot."""
    record.step = step
    record.messages.append(common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, content=f"step {step}: " + "x" * 120))
    if step % 2:
        record.phase = agent_pb.EPISODE_PHASE_READY_FOR_TOOL
        record.resource_snapshot.format_name = "counter"
        record.resource_snapshot.payload = os.urandom(16) + bytes(1008)
    else:
        record.phase = agent_pb.EPISODE_PHASE_READY_FOR_MODEL
    record.elapsed.FromMilliseconds(step * 40)


async def run_round(store: EpisodeStore, label: str, args: argparse.Namespace) -> dict[str, float]:
    saved = 0
    next_id = 0

    async def worker() -> None:
        nonlocal saved, next_id
        while saved < args.total:
            rollout_id = f"{label}-{next_id}"
            next_id += 1
            record = fresh(rollout_id)
            async with store.lease(rollout_id) as lease:
                await store.load(lease)
                for step in range(args.boundaries):
                    boundary(record, step)
                    await store.save(lease, record)
                    saved += 1

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.episodes)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"boundaries_per_s": saved / wall, "cpu_us_per_boundary": 1e6 * cpu / saved, "boundaries": saved}


def disk_ceiling(folder: Path, batches: int, batch_bytes: int) -> float:
    """Batches/s of one thread appending `batch_bytes` and fdatasync-ing, `batches` times."""
    path = folder / "ceiling.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    data = os.urandom(batch_bytes)
    started = time.perf_counter()
    try:
        for _ in range(batches):
            os.write(fd, data)
            os.fdatasync(fd)
    finally:
        os.close(fd)
        path.unlink()
    return batches / (time.perf_counter() - started)


async def measure(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    kinds = KINDS
    results: dict[str, dict[str, Any]] = {kind: {"rounds": []} for kind in kinds}
    stats: dict[str, Any] = {}
    for r in range(args.rounds):
        for kind in kinds if r % 2 == 0 else reversed(kinds):
            root = folder / f"{kind}-{r}"
            store: EpisodeStore
            if kind == "files":
                store = FilesystemEpisodeStore(root)
            else:
                store = LogEpisodeStore(root, full_every=32 if kind == "log" else 0)
            total = args.total if kind != "files" else max(args.total // 8, args.episodes * args.boundaries)
            round_args = argparse.Namespace(**{**vars(args), "total": total})
            got = await run_round(store, f"r{r}", round_args)
            await store.close()
            s = store.stats  # type: ignore[attr-defined]
            got |= {"writes_per_batch": s.writes / s.batches, "fsyncs_per_boundary": s.fsyncs / s.writes}
            got["bytes_per_boundary"] = s.bytes / s.writes
            results[kind]["rounds"].append(got)
            if kind == "log":
                stats = {"batches": s.batches, "batch_bytes": s.bytes // s.batches}
            print(
                f"  round {r} {kind:9s} {got['boundaries_per_s']:9.0f} durable boundaries/s  "
                f"{got['cpu_us_per_boundary']:6.1f} us CPU/boundary  {got['bytes_per_boundary']:6.0f} B/boundary  "
                f"{got['writes_per_batch']:6.1f} saves/batch",
                flush=True,
            )
    for r in results.values():
        for key in ("boundaries_per_s", "cpu_us_per_boundary", "bytes_per_boundary", "writes_per_batch"):
            r[key] = statistics.median(x[key] for x in r["rounds"])
    batches = min(stats["batches"], 2000)
    ceiling = disk_ceiling(folder, batches, stats["batch_bytes"])
    results["disk"] = {"batches_per_s": ceiling, "batch_bytes": stats["batch_bytes"]}
    return results


def split_cost(steps: int, repeats: int = 200) -> dict[str, float]:
    """CPU per boundary of the field split + diff of an episode of `steps` boundaries: every
    record split from scratch against split reusing the previous boundary's split (what
    LogEpisodeStore.save does), measured back to back in this process."""
    record, revisions = fresh("split"), []
    for step in range(steps):
        boundary(record, step)
        record.revision, _ = step, record.updated_at.FromNanoseconds(10**18 + step)
        revisions.append(record.SerializeToString(deterministic=True))

    def run(reuse: bool) -> float:
        started = time.process_time()
        for _ in range(repeats):
            base: fields.Fields | None = None
            for data in revisions:
                state = fields.split(data, base if reuse else None)
                if base is not None:
                    fields.diff(base, state)
                base = state
        return (time.process_time() - started) / (repeats * steps) * 1e6

    plain, reusing = run(False), run(True)
    return {"steps": steps, "plain_us": plain, "reusing_us": reusing, "record_bytes": len(revisions[-1])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short run (smoke tests)")
    parser.add_argument("--episodes", type=int, default=512, help="episodes in flight (default %(default)s)")
    parser.add_argument("--boundaries", type=int, default=8, help="boundaries per episode (default %(default)s)")
    parser.add_argument("--total", type=int, help="boundaries per log round (default 60,000; quick 4,000)")
    parser.add_argument("--rounds", type=int, help="rounds per store (default 3; quick 1)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp"), help="folder on the filesystem to measure")
    parser.add_argument("--json", type=Path, help="also write the results as JSON")
    args = parser.parse_args(argv)
    args.total = args.total or (4000 if args.quick else 60000)
    args.rounds = args.rounds or (1 if args.quick else 3)
    if args.quick:
        args.episodes = min(args.episodes, 128)
    with tempfile.TemporaryDirectory(prefix="gymrpc-store-bench-", dir=args.dir) as tmp:
        results = asyncio.run(measure(args, Path(tmp)))
    log, files, disk = results["log"], results["files"], results["disk"]
    print(f"\n{args.episodes} episodes in flight, {args.boundaries} boundaries each, {args.rounds} rounds (median)")
    for name in KINDS:
        r = results[name]
        print(
            f"{name:9s} {r['boundaries_per_s']:9.0f} durable boundaries/s  {r['cpu_us_per_boundary']:6.1f} us CPU per "
            f"boundary  {r['bytes_per_boundary']:6.0f} B per boundary  {r['writes_per_batch']:6.1f} saves per batch"
        )
    print(f"disk      {disk['batches_per_s']:9.0f} batches/s of {disk['batch_bytes']} B + fdatasync (one thread)")
    print(
        f"RATIO log / files: {log['boundaries_per_s'] / files['boundaries_per_s']:.1f}x durable boundaries/s "
        f"(log-whole {results['log-whole']['boundaries_per_s'] / files['boundaries_per_s']:.1f}x); "
        f"log at {log['boundaries_per_s'] / log['writes_per_batch'] / disk['batches_per_s']:.2f}x the disk's batch rate"
    )
    results["split"] = [split_cost(steps) for steps in (args.boundaries, 64)]
    for r in results["split"]:
        print(
            f"split+diff over {r['steps']:3d} boundaries (last record {r['record_bytes']} B): "
            f"{r['plain_us']:.1f} us per boundary from scratch, {r['reusing_us']:.1f} us reusing the previous split "
            f"(RATIO {r['plain_us'] / r['reusing_us']:.2f}x)"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": {**vars(args), "dir": str(args.dir), "json": str(args.json)}, "results": results}, indent=2
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
