"""Where one unary gRPC call spends its time on gymrpc's own path.

1. In-process wrapper costs, no network: `gymrpc.Client`'s NamedStub over a fake transport
   against calling the transport directly; `gymrpc.servers.guard` around a servicer method against
   the bare method; the `SessionHost` thread-pool hop against an inline call.
2. Server CPU per call split by thread (/proc), gRPC resources server against the FastAPI twin.
3. cProfile of the bench (client) process driving `CallTool` through the raw grpc.aio stub
   and through `gymrpc.Client`.
4. cProfile of a resources server process run under `python -m cProfile`.

    .venv/bin/python bench/profile_grpc_path.py [--calls 3000] [--top 12]

cProfile slows Python code several-fold and sees only the main thread, so read its
output as shares, not as absolute costs; section 1 gives the absolute ones.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import itertools
import os
import pstats
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from unary_rpc import CLK_TCK, GRPC, HTTP, ROLLOUT, SEED_ENV, SERVICE_NAME, Clients, Stack, grpc_request

from gymrpc.client import Client
from gymrpc.envs.counter import CounterEnvironment
from gymrpc.servers.guard import guard_servicer
from gymrpc.servers.resources.service import ResourcesServicer
from gymrpc.v1 import common_pb2
from gymrpc.v1 import resources_service_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
DESCRIPTOR = pb.DESCRIPTOR.services_by_name["ResourcesService"]
REPLY = pb.CallToolResponse(output='{"success": true}')


async def _per_call_ns(fn: Callable[[], Awaitable[Any]], n: int, reps: int = 5) -> tuple[float, float]:
    """Median wall and CPU ns per call of `await fn()` over `reps` runs of `n` calls."""
    for _ in range(min(n, 2000)):
        await fn()
    walls, cpus = [], []
    for _ in range(reps):
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter_ns()
        for _ in range(n):
            await fn()
        t1, r1 = time.perf_counter_ns(), resource.getrusage(resource.RUSAGE_SELF)
        walls.append((t1 - t0) / n)
        cpus.append(((r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)) * 1e9 / n)
    return statistics.median(walls), statistics.median(cpus)


class _FakeTransportStub:
    """Stands in for the generated stub: every method answers at once, no channel is used."""

    CallTool: Callable[..., Awaitable[Any]]

    def __init__(self, channel: Any) -> None:
        async def answer(request: Any, **options: Any) -> Any:  # accepts timeout= and metadata=
            return REPLY

        self.answer = answer
        for method in DESCRIPTOR.methods:
            setattr(self, method.name, answer)


async def wrapper_costs(stack: Stack, folder: Path) -> None:
    """Section 1: absolute costs of each wrapper layer, in-process."""
    print("== 1. wrapper costs in-process (ns per call, median of 5 runs; wall / CPU)")
    client = Client(registry=stack.registry.address, token=stack.token, run_dir=folder)
    try:
        named = client.stub(SERVICE_NAME, _FakeTransportStub, DESCRIPTOR)
        await named.CallTool(pb.CallToolRequest())  # resolves once through the registry, then cached
        direct = _FakeTransportStub(None).CallTool
        request = grpc_request("s", itertools.count())
        metadata = (("authorization", "Bearer " + stack.token),)
        n = 100_000
        base = await _per_call_ns(lambda: direct(request, timeout=60.0, metadata=metadata), n)
        wrapped = await _per_call_ns(lambda: named.CallTool(request), n)
        wrapped_t = await _per_call_ns(lambda: named.CallTool(request, timeout=30.0), n)
        _row("fake transport, called directly", base)
        _row("gymrpc.Client NamedStub.CallTool", wrapped, base)
        _row("NamedStub.CallTool(timeout=30)", wrapped_t, base)
    finally:
        await client.close()

    servicer = ResourcesServicer(CounterEnvironment(), workers=8)
    guarded: Any = guard_servicer(servicer, DESCRIPTOR, token=None)
    list_tools = pb.ListToolsRequest()
    bare = await _per_call_ns(lambda: servicer.ListTools(list_tools, None), 50_000)
    with_guard = await _per_call_ns(lambda: guarded.ListTools(list_tools, None), 50_000)
    _row("servicer.ListTools, bare", bare)
    _row("servicer.ListTools, guarded", with_guard, bare)

    episode = common_pb2.EpisodeId(rollout_id=ROLLOUT)
    task = common_pb2.Task(env_json=SEED_ENV)
    await servicer.SeedSession(pb.SeedSessionRequest(session_id="s", episode_id=episode, task=task), None)
    ids = itertools.count()
    pooled = await _per_call_ns(lambda: guarded.CallTool(grpc_request("s", ids), None), 20_000)
    host: Any = servicer.host
    pool_run = host.run

    async def inline_run(fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    host.run = inline_run
    inline = await _per_call_ns(lambda: guarded.CallTool(grpc_request("s", ids), None), 20_000)
    host.run = pool_run
    _row("guarded CallTool, env in thread pool", pooled)
    _row("guarded CallTool, env inline", inline, pooled)
    servicer.host.shutdown()

    pool, loop = ThreadPoolExecutor(8), asyncio.get_running_loop()
    hop = await _per_call_ns(lambda: loop.run_in_executor(pool, int), 20_000)
    _row("run_in_executor(pool, trivial fn)", hop)
    pool.shutdown()
    print()


def _row(label: str, value: tuple[float, float], base: tuple[float, float] | None = None) -> None:
    extra = f"   ({value[0] - base[0]:+.0f} wall, {value[1] - base[1]:+.0f} CPU)" if base else ""
    print(f"  {label:<40} {value[0]:>8.0f} / {value[1]:>8.0f}{extra}")


def _thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread group of a process: the main (event loop) thread, other Python
    threads (the environment pool; Python 3.11 leaves them named `python`), and native threads
    by name (grpc's `event_engine`)."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        if int(tid) == pid:
            group = "main thread (event loop)"
        elif comm == "python":
            group = "other Python threads (env pool)"
        else:
            group = comm.rstrip("0123456789_-") + " threads"
        out[group] = out.get(group, 0.0) + (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def thread_breakdown(runner: asyncio.Runner, clients: Clients, stack: Stack, calls: int) -> None:
    """Section 2: server CPU per call split by thread, gRPC server against the FastAPI twin."""
    print("== 2. server CPU per call by thread (us, from /proc/<pid>/task/*/stat; sequential calls)")
    for kind, make in ((GRPC, clients.aio_stub_call), (HTTP, clients.httpx_async_call)):
        session = f"threads-{kind}"
        runner.run(clients.seed(kind, session))
        call, server = make(session), stack.server(kind)
        runner.run(_drive(call, 300))
        before = _thread_cpu(server.proc.pid)
        runner.run(_drive(call, calls))
        after = _thread_cpu(server.proc.pid)
        used = {k: (v - before.get(k, 0.0)) / calls * 1e6 for k, v in after.items()}
        parts = ", ".join(f"{k} {v:.0f}" for k, v in sorted(used.items(), key=lambda kv: -kv[1]) if v > 0)
        print(f"  {server.label:<10} total {sum(used.values()):>4.0f}: {parts}")
    print()


def _print_stats(stats: pstats.Stats, calls: int, top: int, title: str, focus: tuple[str, ...]) -> None:
    """Top functions by own time and the inclusive time of gymrpc's layers, as shares of busy time.

    Busy time leaves out the event loop's `epoll.poll`, which is waiting, not work. A coroutine
    is counted once per resumption, so entries per call are not calls per call.
    """
    rows = stats.stats  # type: ignore[attr-defined]
    idle = sum(v[2] for (_, _, func), v in rows.items() if func == "<method 'poll' of 'select.epoll' objects>")
    busy = stats.total_tt - idle  # type: ignore[attr-defined]
    print(f"-- {title}: {busy / calls * 1e6:.0f} us busy (profiled) per call, {calls} calls")
    print(f"  {'own %':>6} {'incl %':>7} {'own us':>7}  function")
    own = sorted(rows.items(), key=lambda kv: kv[1][2], reverse=True)
    shown = 0
    for (file, line, func), (_, _, tt, ct, _) in own:
        if func == "<method 'poll' of 'select.epoll' objects>":
            continue
        print(f"  {tt / busy:>6.1%} {ct / busy:>7.1%} {tt / calls * 1e6:>7.1f}  {_where(file, line, func)}")
        shown += 1
        if shown == top:
            break
    print("  inclusive time of gymrpc's own layers:")
    print(f"  {'':>6} {'incl %':>7} {'incl us':>7}")
    for (file, line, func), (_, ncalls, _, ct, _) in sorted(rows.items(), key=lambda kv: -kv[1][3]):
        if any(f in file for f in focus) and ncalls >= calls * 0.9 and ct / busy >= 0.001:
            print(f"  {'':>6} {ct / busy:>7.1%} {ct / calls * 1e6:>7.1f}  {_where(file, line, func)}")
    print()


def _where(file: str, line: int, func: str) -> str:
    for marker in (f"{ROOT}/", "site-packages/", "lib/python3.11/"):
        if marker in file:
            file = file.split(marker, 1)[1]
    return f"{func}  ({file}:{line})" if line else func


async def _drive(call: Callable[[], Awaitable[None]], n: int) -> None:
    for _ in range(n):
        await call()


def client_profile(runner: asyncio.Runner, clients: Clients, calls: int, top: int) -> None:
    """Section 3: cProfile the bench process, raw grpc.aio stub against gymrpc.Client."""
    print("== 3. client process (cProfile)")
    for key, make in (("raw grpc.aio stub", clients.aio_stub_call), ("gymrpc.Client", clients.named_call)):
        session = "profile-" + key.split()[0].replace(".", "-")
        runner.run(clients.seed(GRPC, session))
        call = make(session)
        runner.run(_drive(call, 300))
        profiler = cProfile.Profile()
        profiler.enable()
        runner.run(_drive(call, calls))
        profiler.disable()
        stats = pstats.Stats(profiler, stream=io.StringIO())
        _print_stats(stats, calls, top, key, ("gymrpc/",))


def server_profile(stack: Stack, profile: Path, calls: int, top: int) -> None:
    """Section 4: the resources server run under cProfile, serving `calls` after 300 warm-up calls."""
    print("== 4. resources server process (cProfile, main thread; startup and warm-up included)")
    with asyncio.Runner() as runner:
        clients = runner.run(_clients(stack, profile.parent))
        try:
            runner.run(clients.seed(GRPC, "profiled"))
            runner.run(_drive(clients.aio_stub_call("profiled"), calls + 300))
        finally:
            runner.run(clients.close())
    stack.grpc.stop()  # SIGTERM: serve() returns and cProfile writes its file
    stats = pstats.Stats(str(profile), stream=io.StringIO())
    _print_stats(stats, calls + 300, top, "resources server", ("servers/", "gymrpc/", "envs/"))


async def wire_costs(clients: Clients, stack: Stack, calls: int, rounds: int) -> None:
    """Section 5: what gymrpc.Client adds on the wire (deadline, bearer token), end to end, A/B."""
    print(f"== 5. per-call options end to end (raw grpc.aio stub; medians of {rounds} interleaved rounds)")
    print("  (gymrpc.Client sends both: the retry deadline as timeout, the bearer token on every call)")
    token_md = (("authorization", "Bearer " + stack.token),)
    variants: dict[str, dict[str, Any]] = {
        "no options": {},
        "timeout=60": {"timeout": 60.0},
        "bearer metadata": {"metadata": token_md},
        "timeout=60 + bearer metadata": {"timeout": 60.0, "metadata": token_md},
    }
    labels = [*variants, "gymrpc.Client"]
    results: dict[str, list[tuple[float, float, float]]] = {k: [] for k in labels}
    await clients.seed(GRPC, "wire")
    ids = itertools.count()
    for _ in range(rounds):
        for label in labels:
            options = variants.get(label, {})
            call: Any = clients.named.CallTool if label == "gymrpc.Client" else clients.aio_stub.CallTool
            for _ in range(200):
                await call(grpc_request("wire", ids), **options)
            cpu0, srv0, t0 = _own_cpu(), stack.grpc.cpu_seconds(), time.perf_counter()
            for _ in range(calls):
                await call(grpc_request("wire", ids), **options)
            wall = time.perf_counter() - t0
            client_us = (_own_cpu() - cpu0) / calls * 1e6
            server_us = (stack.grpc.cpu_seconds() - srv0) / calls * 1e6
            results[label].append((calls / wall, server_us, client_us))
    base = statistics.median(r[0] for r in results["no options"])
    for label, rows in results.items():
        rate, srv, cli = (statistics.median(r[i] for r in rows) for i in range(3))
        print(
            f"  {label:<30} {rate:>6.0f} calls/s ({rate / base:.3f}x)  CPU us/call: server {srv:>4.0f}, "
            f"client {cli:>4.0f}"
        )
    print()


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=3000, help="measured calls per section")
    parser.add_argument("--top", type=int, default=12, help="functions listed per profile")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of section 5")
    parser.add_argument("--sections", default="1,2,3,4,5", help="comma-separated sections to run")
    args = parser.parse_args()
    run = {int(x) for x in args.sections.split(",")}
    with tempfile.TemporaryDirectory(prefix="gymrpc-profile-") as tmp:
        folder = Path(tmp)
        (folder / "profiled").mkdir()
        # Both stacks start before this process uses gRPC: forking later makes grpc log warnings.
        stack = Stack.start(folder, data_plane_credentials=False)  # section 5 measures the token's own cost
        profile = folder / "profiled" / "resources.prof"
        try:
            profiled = Stack.start(folder / "profiled", profile=profile, data_plane_credentials=False)
        except BaseException:
            stack.stop()
            raise
        try:
            with asyncio.Runner() as runner:
                if 1 in run:
                    runner.run(wrapper_costs(stack, folder))
                clients = runner.run(_clients(stack, folder))
                try:
                    if 2 in run:
                        thread_breakdown(runner, clients, stack, args.calls)
                    if 3 in run:
                        client_profile(runner, clients, args.calls, args.top)
                    if 4 in run:
                        server_profile(profiled, profile, args.calls, args.top)
                    if 5 in run:
                        runner.run(wire_costs(clients, stack, args.calls // 2, args.rounds))
                finally:
                    runner.run(clients.close())
        finally:
            profiled.stop()
            stack.stop()
    return 0


async def _clients(stack: Stack, folder: Path) -> Clients:
    return Clients(stack, folder)


if __name__ == "__main__":
    sys.exit(main())
