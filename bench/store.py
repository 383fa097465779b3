"""Episode store micro-bench: durable boundaries per second and CPU per boundary, log store against file store.

In one process, `--episodes` episodes are in flight at once; each takes its lease, saves
`--boundaries` boundaries of a counter-like record (a growing conversation, a tool call
record per step, a ~1 KB session snapshot replaced at every tool boundary), releases, and
starts the next episode, until `--total` boundaries were saved. Every save returns only once
durable. Rounds alternate the stores on the same filesystem: `log` (LogEpisodeStore, field
deltas), `log-whole` (every boundary written whole: `full_every=0`) and `files`
(FilesystemEpisodeStore); the median is reported. The disk's ceiling is measured in the same run: the same number of
batches of the log's average batch bytes written and `fdatasync`ed by one thread, written over a
file zeroed beforehand (as the log writes: no size change for the journal) and appended.

The harness is measured apart: a `harness` round runs the same episodes against a store that
keeps nothing (the record mutations only, from prebuilt messages and snapshots), and each
store's CPU per boundary is reported with and without it. `--procs N` (default: the core
count; 1 turns it off) then runs N processes at once, each an agent with its own log in one
shared folder (replicas) and `--episodes` in flight, and reports their aggregate.

Last, the record itself: the CPU per boundary of bringing an RL episode's record (model calls
with 16k-token prompts) up to date and serialising it, held as messages against the
`EncodedCheckpoint` the agent keeps (gymrpc/store/encoded.py), back to back in this process;
then the event loop's CPU per `LogEpisodeStore.save` of those records, the delta frame's CRC of
the record kept per field (the C diff's sums) against computed over the whole record each time.

    .venv/bin/python bench/store.py [--quick] [--episodes N] [--total N] [--rounds R] [--procs N] [--dir PATH]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gymrpc.store import (  # noqa: E402
    SCHEMA_VERSION,
    EpisodeCheckpoint,
    EpisodeLease,
    EpisodeStore,
    FilesystemEpisodeStore,
    LogEpisodeStore,
    fields,
)
from gymrpc.store.base import IO_THREADS  # noqa: E402
from gymrpc.store.encoded import encoded  # noqa: E402
from gymrpc.store.log import COMMIT_THREAD  # noqa: E402
from gymrpc.v1 import agent_service_pb2 as agent_pb  # noqa: E402
from gymrpc.v1 import common_pb2  # noqa: E402

KINDS = ("log", "log-whole", "files")
SNAPSHOTS = [bytes([i]) * 16 + bytes(1008) for i in range(64)]
"""Session snapshots a boundary cycles through (prebuilt: the harness is not what is measured)."""
REPLIES = [
    common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, content=f"step {step}: " + "x" * 120) for step in range(256)
]
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
    record.messages.append(REPLIES[step % len(REPLIES)])
    if step % 2:
        record.phase = agent_pb.EPISODE_PHASE_READY_FOR_TOOL
        record.resource_snapshot.format_name = "counter"
        record.resource_snapshot.payload = SNAPSHOTS[(step + len(record.episode_id.rollout_id)) % len(SNAPSHOTS)]
    else:
        record.phase = agent_pb.EPISODE_PHASE_READY_FOR_MODEL
    record.elapsed.FromMilliseconds(step * 40)


class _NoLease(EpisodeLease):
    def __init__(self, rollout_id: str) -> None:
        self.rollout_id = rollout_id

    @property
    def held(self) -> bool:
        return True

    async def release(self) -> None:
        return None


class HarnessStore(EpisodeStore):
    """Keeps nothing: a round against it costs what the bench itself costs (records, tasks, the loop)."""

    stats = None

    async def acquire(self, rollout_id: str) -> EpisodeLease:
        return _NoLease(rollout_id)

    @contextlib.asynccontextmanager
    async def lease(self, rollout_id: str) -> AsyncIterator[EpisodeLease]:
        yield _NoLease(rollout_id)

    async def load(self, lease: EpisodeLease) -> EpisodeCheckpoint | None:
        return None

    async def save(self, lease: EpisodeLease, record: EpisodeCheckpoint) -> None:
        record.revision += 1

    async def archive(self, lease: EpisodeLease, reason: str) -> str | None:
        return None

    async def delete(self, lease: EpisodeLease) -> bool:
        return False

    async def delete_expired(self, now: float | None = None) -> int:
        return 0

    async def close(self) -> None:
        return None


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

    threads, cpu, wall = thread_cpu(), time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.episodes)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = thread_cpu()
    split = {name: 1e6 * (after[name] - threads.get(name, 0.0)) / saved for name in after}
    return {"boundaries_per_s": saved / wall, "cpu_us_per_boundary": 1e6 * cpu / saved, "boundaries": saved} | {
        f"{name}_cpu_us_per_boundary": us for name, us in split.items()
    }


THREADS = {"MainThread": "loop", COMMIT_THREAD: "commit", IO_THREADS: "io"}
"""Thread name prefixes whose CPU is reported apart: the event loop, the log's commit thread, its I/O pool."""


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of this process's threads, summed per `THREADS` role (Linux: per-thread clocks)."""
    out = dict.fromkeys(THREADS.values(), 0.0)
    for thread in threading.enumerate():
        role = next((r for prefix, r in THREADS.items() if thread.name.startswith(prefix)), None)
        if role is None or thread.ident is None:
            continue
        with contextlib.suppress(OSError, AttributeError):
            out[role] += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return out


async def lease_cost(store: EpisodeStore, label: str, episodes: int, concurrency: int) -> float:
    """CPU per new episode of taking its lease, loading (nothing) and releasing it, with no save."""
    todo = iter(range(episodes))

    async def worker() -> None:
        for i in todo:
            async with store.lease(f"{label}-{i}") as lease:
                await store.load(lease)

    cpu = time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return 1e6 * (time.process_time() - cpu) / episodes


def disk_ceiling(folder: Path, batches: int, batch_bytes: int) -> dict[str, float]:
    """One thread writing `batches` batches of `batch_bytes`, each `fdatasync`ed: batches/s and the thread's
    CPU per batch, appending (as the log does) and overwriting a file zeroed and synced beforehand."""
    path = folder / "ceiling.bin"
    data = os.urandom(batch_bytes)
    out: dict[str, float] = {}
    for way in ("append", "prezeroed"):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if way == "prezeroed":
                # The file's size and blocks are settled before the timed writes: an fdatasync then has
                # no metadata to journal, only the data blocks to flush.
                os.write(fd, bytes(batch_bytes * batches))
                os.fsync(fd)
            started, cpu = time.perf_counter(), time.thread_time()
            for i in range(batches):
                if way == "append":
                    os.write(fd, data)
                else:
                    os.pwrite(fd, data, i * batch_bytes)
                os.fdatasync(fd)
            out[f"{way}_cpu_us_per_batch"] = 1e6 * (time.thread_time() - cpu) / batches
            out[f"{way}_batches_per_s"] = batches / (time.perf_counter() - started)
        finally:
            os.close(fd)
            path.unlink()
    return out


async def measure(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    kinds = ("harness", *KINDS)
    results: dict[str, dict[str, Any]] = {kind: {"rounds": []} for kind in kinds}
    stats: dict[str, Any] = {}
    for r in range(args.rounds):
        for kind in kinds if r % 2 == 0 else reversed(kinds):
            root = folder / f"{kind}-{r}"
            store: EpisodeStore
            if kind == "harness":
                store = HarnessStore()
            elif kind == "files":
                store = FilesystemEpisodeStore(root)
            else:
                store = LogEpisodeStore(root, full_every=32 if kind == "log" else 0)
            total = args.total if kind != "files" else max(args.total // 8, args.episodes * args.boundaries)
            round_args = argparse.Namespace(**{**vars(args), "total": total})
            got = await run_round(store, f"r{r}", round_args)
            if kind == "log":
                got["lease_cpu_us_per_episode"] = await lease_cost(store, f"lease{r}", 2000, args.episodes)
            await store.close()
            results[kind]["rounds"].append(got)
            if kind == "harness":
                print(f"  round {r} {kind:9s} {got['cpu_us_per_boundary']:6.1f} us CPU/boundary", flush=True)
                continue
            s = store.stats  # type: ignore[attr-defined]
            got |= {"writes_per_batch": s.writes / s.batches, "fsyncs_per_boundary": s.fsyncs / s.writes}
            got["bytes_per_boundary"] = s.bytes / s.writes
            if kind == "log":
                stats = {"batches": s.batches, "batch_bytes": s.bytes // s.batches}
                print(
                    f"  round {r} log: CPU per boundary in the loop thread {got['loop_cpu_us_per_boundary']:.1f} us, "
                    f"commit thread {got['commit_cpu_us_per_boundary']:.1f} us, I/O threads "
                    f"{got['io_cpu_us_per_boundary']:.1f} us; a new episode's lease (take, load, release) "
                    f"{got['lease_cpu_us_per_episode']:.1f} us",
                    flush=True,
                )
            print(
                f"  round {r} {kind:9s} {got['boundaries_per_s']:9.0f} durable boundaries/s  "
                f"{got['cpu_us_per_boundary']:6.1f} us CPU/boundary  {got['bytes_per_boundary']:6.0f} B/boundary  "
                f"{got['writes_per_batch']:6.1f} saves/batch",
                flush=True,
            )
    harness = statistics.median(x["cpu_us_per_boundary"] for x in results["harness"]["rounds"])
    results["harness"]["cpu_us_per_boundary"] = harness
    for kind in KINDS:
        r = results[kind]
        keys = [k for k in r["rounds"][0] if k.endswith(("_per_s", "_per_boundary", "_per_episode", "_per_batch"))]
        for key in keys:
            r[key] = statistics.median(x[key] for x in r["rounds"])
        r["store_cpu_us_per_boundary"] = r["cpu_us_per_boundary"] - harness
    batches = min(stats["batches"], 2000)
    ceiling = disk_ceiling(folder, batches, stats["batch_bytes"])
    disk = {"batches_per_s": ceiling["prezeroed_batches_per_s"], "batch_bytes": stats["batch_bytes"]}
    results["disk"] = {**disk, **ceiling}
    return results


def _process_round(root: str, label: str, argv: dict[str, Any], barrier: Any, out: Any) -> None:
    """One agent-like process of `measure_processes`: its own log in the shared folder."""

    async def go() -> dict[str, Any]:
        store = LogEpisodeStore(root)
        barrier.wait()  # every process opened its store: start together
        started = time.time()
        got = await run_round(store, label, argparse.Namespace(**argv))
        got |= {"started": started, "ended": time.time(), "batches": store.stats.batches}
        await store.close()
        return got

    out.put(asyncio.run(go()))


def measure_processes(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """`args.procs` processes saving at once, each with `args.episodes` in flight; their aggregate."""
    context = multiprocessing.get_context("spawn")
    barrier, out = context.Barrier(args.procs), context.Queue()
    argv = {"total": args.total // args.procs, "episodes": args.episodes, "boundaries": args.boundaries}
    root = folder / "processes"
    procs = [
        context.Process(target=_process_round, args=(str(root), f"p{i}", argv, barrier, out)) for i in range(args.procs)
    ]
    for proc in procs:
        proc.start()
    rounds = [out.get() for _ in procs]
    for proc in procs:
        proc.join()
    saved = sum(r["boundaries"] for r in rounds)
    cpu_us = sum(r["cpu_us_per_boundary"] * r["boundaries"] for r in rounds)
    wall = max(r["ended"] for r in rounds) - min(r["started"] for r in rounds)
    return {
        "procs": args.procs,
        "boundaries_per_s": saved / wall,
        "cpu_us_per_boundary": cpu_us / saved,
        "writes_per_batch": saved / sum(r["batches"] for r in rounds),
        "per_process": [r["boundaries_per_s"] for r in rounds],
    }


def split_cost(steps: int, repeats: int = 200) -> dict[str, float]:
    """CPU per boundary of splitting an episode's records of `steps` boundaries into top-level fields
    and diffing each against the one before, four ways back to back in this process: Python from
    scratch, Python reusing the previous split (`fields.split(data, like)`), upb's shallow read
    (`fields.Shallow`, what LogEpisodeStore.save does without a C compiler) and the C diff
    (`fields.Native`, what it does with one; absent from the result if it was not built)."""
    record, revisions = fresh("split"), []
    for step in range(steps):
        boundary(record, step)
        record.revision, _ = step, record.updated_at.FromNanoseconds(10**18 + step)
        revisions.append(record.SerializeToString(deterministic=True))
    shallow = fields.Shallow(EpisodeCheckpoint.DESCRIPTOR)

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

    def run_shallow() -> float:
        started = time.process_time()
        for _ in range(repeats):
            base: fields.Values | None = None
            for data in revisions:
                state = shallow.values(data)
                if base is not None and state is not None:
                    shallow.diff(base, state)
                base = state
        return (time.process_time() - started) / (repeats * steps) * 1e6

    def run_native() -> float:
        native = fields.Native()
        started = time.process_time()
        for _ in range(repeats):
            base = native.values(revisions[0])
            for data in revisions[1:]:
                state = native.values(data)
                native.diff(base, state)
                base = state
        return (time.process_time() - started) / (repeats * steps) * 1e6

    plain, reusing, upb = run(False), run(True), run_shallow()
    result = {
        "steps": steps,
        "plain_us": plain,
        "reusing_us": reusing,
        "shallow_us": upb,
        "record_bytes": len(revisions[-1]),
    }
    if fields.NATIVE_BUILT:
        result["c_us"] = run_native()
    return result


def _rl_model_calls(steps: int, prompt_tokens: int) -> list[agent_pb.ModelCallRecord]:
    """An RL episode's model calls: each prompt has `prompt_tokens` token ids, 500 more each step (a
    conversation grows), and 200 sampled tokens with their logprobs."""
    rng = random.Random(7)
    calls = []
    for step in range(steps):
        call = agent_pb.ModelCallRecord(step=step, weight_version="bench:0")
        call.tokens.prompt_token_ids.extend(rng.randrange(150_000) for _ in range(prompt_tokens + 500 * step))
        call.tokens.completion_token_ids.extend(rng.randrange(150_000) for _ in range(200))
        call.tokens.completion_logprobs.extend(rng.random() for _ in range(200))
        calls.append(call)
    return calls


def history_cost(steps: int, prompt_tokens: int, repeats: int = 3) -> dict[str, float]:
    """CPU per boundary of bringing an RL episode's record up to date and serialising it, the record held
    as messages (the whole history encoded again at every save) against `EncodedCheckpoint` (what the agent
    keeps: each entry encoded once, when appended). Each boundary adds a model call and a message."""
    calls = _rl_model_calls(steps, prompt_tokens)

    def run(record: Any, encode: bool) -> tuple[float, int]:
        started, size = time.process_time(), 0
        for _ in range(repeats):
            del record.model_calls[:], record.messages[:]
            for step, call in enumerate(calls):
                reply = REPLIES[step]
                record.model_calls.append(call.SerializeToString(deterministic=True) if encode else call)
                record.messages.append(reply.SerializeToString(deterministic=True) if encode else reply)
                size = len(record.SerializeToString(deterministic=True))
        return (time.process_time() - started) / (repeats * steps) * 1e6, size

    (message_us, size), (encoded_us, _) = run(fresh("history"), False), run(encoded(fresh("history")), True)
    return {
        "steps": steps,
        "prompt_tokens": prompt_tokens,
        "record_bytes": size,
        "message_us": message_us,
        "encoded_us": encoded_us,
    }


class _WholeRecordCrc:
    """The C diff, but the delta frame's CRC of the record left to the save: `zlib.crc32` over the record's
    whole bytes at every boundary, as before the diff kept the CRC per field (the baseline)."""

    def __init__(self, inner: fields.Native) -> None:
        self.inner = inner

    def values(self, data: bytes, *, serialized: bool = False) -> fields.NativeState:
        return self.inner.values(data, serialized=serialized)

    def diff(self, old: fields.NativeState, new: fields.NativeState) -> tuple[bytes | None, None]:
        return self.inner.diff(old, new)[0], None


async def history_save_cost(
    folder: Path, steps: int, prompt_tokens: int, episodes: int, rounds: int
) -> dict[str, float] | None:
    """The event loop's CPU per `LogEpisodeStore.save` of an RL episode's `EncodedCheckpoint` (what the agent
    saves), the record's CRC kept per field against computed over its whole bytes; rounds alternate. None
    where the C diff was not built (the CRC is then always the whole record's)."""
    from gymrpc.store import log

    if not isinstance(log._DIFFER, fields.Native):
        return None
    native = log._DIFFER
    calls = [c.SerializeToString(deterministic=True) for c in _rl_model_calls(steps, prompt_tokens)]
    replies = [r.SerializeToString(deterministic=True) for r in REPLIES[:steps]]
    times: dict[str, list[float]] = {"per_field": [], "whole": []}
    store = LogEpisodeStore(folder / "history")
    try:
        for r in range(rounds):
            for way in ("per_field", "whole") if r % 2 == 0 else ("whole", "per_field"):
                log._DIFFER = native if way == "per_field" else _WholeRecordCrc(native)
                started = time.thread_time()
                for e in range(episodes):
                    rollout_id = f"history-{r}-{way}-{e}"
                    async with store.lease(rollout_id) as lease:
                        record = encoded(fresh(rollout_id))
                        for step in range(steps):
                            record.model_calls.append(calls[step])
                            record.messages.append(replies[step])
                            record.step = step
                            await store.save(lease, record)
                times[way].append((time.thread_time() - started) / (episodes * steps) * 1e6)
        size = record.ByteSize()
    finally:
        log._DIFFER = native
        await store.close()
    return {
        "steps": steps,
        "record_bytes": size,
        "per_field_us": statistics.median(times["per_field"]),
        "whole_us": statistics.median(times["whole"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short run (smoke tests)")
    parser.add_argument("--episodes", type=int, default=512, help="episodes in flight (default %(default)s)")
    parser.add_argument("--boundaries", type=int, default=8, help="boundaries per episode (default %(default)s)")
    parser.add_argument("--total", type=int, help="boundaries per log round (default 60,000; quick 4,000)")
    parser.add_argument("--rounds", type=int, help="rounds per store (default 3; quick 1)")
    parser.add_argument(
        "--procs", type=int, default=os.cpu_count() or 1, help="processes of the aggregate round (default %(default)s)"
    )
    parser.add_argument("--dir", type=Path, default=Path("/tmp"), help="folder on the filesystem to measure")
    parser.add_argument("--json", type=Path, help="also write the results as JSON")
    args = parser.parse_args(argv)
    args.total = args.total or (4000 if args.quick else 60000)
    args.rounds = args.rounds or (1 if args.quick else 3)
    if args.quick:
        args.episodes = min(args.episodes, 128)
    with tempfile.TemporaryDirectory(prefix="gymrpc-store-bench-", dir=args.dir) as tmp:
        results = asyncio.run(measure(args, Path(tmp)))
        if args.procs > 1:
            results["processes"] = measure_processes(args, Path(tmp))
    log, files, disk = results["log"], results["files"], results["disk"]
    print(f"\n{args.episodes} episodes in flight, {args.boundaries} boundaries each, {args.rounds} rounds (median)")
    harness = results["harness"]["cpu_us_per_boundary"]
    print(f"harness   {harness:6.1f} us CPU per boundary (building the records; included in the CPU below)")
    for name in KINDS:
        r = results[name]
        print(
            f"{name:9s} {r['boundaries_per_s']:9.0f} durable boundaries/s  {r['cpu_us_per_boundary']:6.1f} us CPU per "
            f"boundary ({r['store_cpu_us_per_boundary']:6.1f} us the store's)  {r['bytes_per_boundary']:6.0f} B per "
            f"boundary  {r['writes_per_batch']:6.1f} saves per batch"
        )
    print(
        f"log CPU per boundary by thread: loop {log['loop_cpu_us_per_boundary']:.1f} us (harness included), commit "
        f"{log['commit_cpu_us_per_boundary']:.1f} us, I/O pool {log['io_cpu_us_per_boundary']:.1f} us; a new "
        f"episode's lease alone {log['lease_cpu_us_per_episode']:.1f} us CPU "
        f"({log['lease_cpu_us_per_episode'] / args.boundaries:.1f} us per boundary at {args.boundaries} per episode)"
    )
    print(
        f"disk      {disk['batches_per_s']:9.0f} batches/s of {disk['batch_bytes']} B + fdatasync into zeros (one "
        f"thread, as the log writes), {disk['prezeroed_cpu_us_per_batch']:.1f} us CPU each; appended "
        f"{disk['append_batches_per_s']:.0f}/s, {disk['append_cpu_us_per_batch']:.1f} us CPU each"
    )
    print(
        f"RATIO pre-zeroed / append: {disk['prezeroed_batches_per_s'] / disk['append_batches_per_s']:.2f}x batches/s, "
        f"{disk['prezeroed_cpu_us_per_batch'] / disk['append_cpu_us_per_batch']:.2f}x CPU per fdatasync"
    )
    print(
        f"RATIO log / files: {log['boundaries_per_s'] / files['boundaries_per_s']:.1f}x durable boundaries/s "
        f"(log-whole {results['log-whole']['boundaries_per_s'] / files['boundaries_per_s']:.1f}x); "
        f"log at {log['boundaries_per_s'] / log['writes_per_batch'] / disk['batches_per_s']:.2f}x the disk's batch rate"
    )
    if "processes" in results:
        p = results["processes"]
        print(
            f"{p['procs']} processes (log, {args.episodes} episodes in flight each, one shared folder): "
            f"{p['boundaries_per_s']:.0f} durable boundaries/s together  {p['cpu_us_per_boundary']:.1f} us CPU per "
            f"boundary  {p['writes_per_batch']:.1f} saves per batch  (per process: "
            f"{', '.join(f'{x:.0f}' for x in p['per_process'])}/s)"
        )
    results["split"] = [split_cost(steps) for steps in (args.boundaries, 64)]
    for r in results["split"]:
        print(
            f"split+diff over {r['steps']:3d} boundaries (last record {r['record_bytes']} B): "
            f"{r['plain_us']:.1f} us per boundary in Python from scratch, {r['reusing_us']:.1f} us reusing the "
            f"previous split, {r['shallow_us']:.1f} us upb shallow (RATIO {r['reusing_us'] / r['shallow_us']:.2f}x)"
            + (f", {r['c_us']:.2f} us in C (RATIO C / upb {r['shallow_us'] / r['c_us']:.1f}x)" if "c_us" in r else "")
        )
    history = results["history"] = history_cost(4 if args.quick else 10, 16_000)
    print(
        f"history: {history['steps']} model calls of {history['prompt_tokens'] // 1000}k+ token prompts (last record "
        f"{history['record_bytes'] / 1024:.0f} KiB): brought up to date and serialised at each boundary, "
        f"{history['message_us']:.0f} us as messages, {history['encoded_us']:.0f} us as EncodedCheckpoint "
        f"(RATIO messages / encoded {history['message_us'] / history['encoded_us']:.1f}x)"
    )
    with tempfile.TemporaryDirectory(prefix="gymrpc-store-bench-", dir=args.dir) as tmp:
        saves = results["history_save"] = asyncio.run(
            history_save_cost(Path(tmp), history["steps"], 16_000, 4 if args.quick else 20, 2 if args.quick else 6)
        )
    if saves is not None:
        print(
            f"history saves: the same records through LogEpisodeStore.save (last {saves['record_bytes'] / 1024:.0f} "
            f"KiB), event loop CPU per save {saves['per_field_us']:.0f} us with the record's CRC kept per field, "
            f"{saves['whole_us']:.0f} us computed over its whole bytes (RATIO whole / per field "
            f"{saves['whole_us'] / saves['per_field_us']:.2f}x)"
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
