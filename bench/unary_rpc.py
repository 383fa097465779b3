"""Unary round trips: gymrpc's gRPC server path against an HTTP/JSON twin (FastAPI + uvicorn).

Both sides serve the counter environment's `increment_counter` tool on a seeded session,
through the same `SessionHost` (id checks, per-session lock, de-duplication by call id,
environment code in a thread pool). Each server runs in its own subprocess; every client
runs in this process. Configs are interleaved over rounds; medians are reported.

    .venv/bin/python bench/unary_rpc.py [--quick] [--json out.json]

See bench/README.md for how to read the table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import ctypes.util
import itertools
import json
import os
import platform
import resource
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import grpc
import httpx

from gymrpc import auth
from gymrpc.auth import new_token
from gymrpc.channels import service_channel_options
from gymrpc.client import Client
from gymrpc.tls import TlsFiles, create_stack_pki
from gymrpc.v1 import common_pb2
from gymrpc.v1 import resources_service_pb2 as pb
from gymrpc.v1 import resources_service_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
SERVICE_NAME = "resources/bench"
TOOL, ARGUMENTS = "increment_counter", '{"count": 1}'
SEED_ENV = '{"initial_count": 0, "expected_count": 0}'
ROLLOUT = "bench-rollout"
VARIANT_NAME = "resources/variant"
OPEN_NAME, TLS_NAME = "resources/bench-open", "resources/bench-tls"
GRPC, HTTP, VARIANT = "grpc", "http", "variant"
OPEN, TLS = "open", "tls"
"""The same resources server with its data plane open (no credential), and serving TLS + mTLS."""

AsyncCall = Callable[[], Awaitable[None]]
SyncCall = Callable[[], None]


# -- server processes ----------------------------------------------------------------------


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM the child when the bench process dies, so no server outlives it."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class _DirWatch:
    """Wakes on files created in or renamed into a directory (inotify), so readiness needs no polling."""

    _IN_CLOSE_WRITE, _IN_MOVED_TO, _IN_CREATE = 0x8, 0x80, 0x100

    def __init__(self, directory: Path) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        mask = self._IN_CLOSE_WRITE | self._IN_MOVED_TO | self._IN_CREATE
        if libc.inotify_add_watch(self.fd, os.fsencode(directory), mask) < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {directory}")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.fd, 4096):
                pass

    def close(self) -> None:
        os.close(self.fd)


@dataclass
class ServerProcess:
    """A server subprocess, its advertised address and its CPU clock."""

    label: str
    proc: subprocess.Popen[bytes]
    address: str
    log: Path

    def cpu_seconds(self) -> float:
        """utime + stime of all its threads, from /proc/<pid>/stat (fields 14 and 15)."""
        stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        fields = stat.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def spawn(label: str, argv: list[str], ready_file: Path, env: dict[str, str], timeout: float = 60.0) -> ServerProcess:
    """Start a server (stdout to DEVNULL, stderr to a log file) and wait for its ready file.

    Waits on inotify for the file and on a pidfd for an early exit; it never sleeps.
    """
    log = ready_file.with_suffix(".log")
    watch = _DirWatch(ready_file.parent)
    try:
        with log.open("wb") as stderr:
            proc = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr, preexec_fn=_die_with_parent
            )
        pidfd = os.pidfd_open(proc.pid)
        try:
            deadline = time.monotonic() + timeout
            while not ready_file.exists():
                left = deadline - time.monotonic()
                if proc.poll() is not None:
                    tail = log.read_text()[-3000:]
                    raise RuntimeError(f"{label} exited ({proc.returncode}) before ready:\n{tail}")
                if left <= 0:
                    proc.kill()
                    raise RuntimeError(f"{label} not ready after {timeout:.0f}s:\n{log.read_text()[-3000:]}")
                select.select([watch.fd, pidfd], [], [], left)
                watch.drain()
        finally:
            os.close(pidfd)
    finally:
        watch.close()
    info = json.loads(ready_file.read_text())
    return ServerProcess(label, proc, info["address"], log)


def child_env(token: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["GYMRPC_TOKEN"] = token
    env["GYMRPC_LOG_LEVEL"] = "WARNING"
    env.pop("GYMRPC_REGISTRY", None)
    return env


@dataclass
class Stack:
    """The server processes: registry, gRPC resources server, FastAPI twin, optional patched variant."""

    registry: ServerProcess
    grpc: ServerProcess
    http: ServerProcess
    token: str
    open: ServerProcess
    tls: ServerProcess
    tls_client: TlsFiles
    variant: ServerProcess | None = None

    @classmethod
    def start(
        cls,
        folder: Path,
        http_loop: str = "uvloop",
        http_parser: str = "httptools",
        profile: Path | None = None,
        variant: list[str] | None = None,
        data_plane_credentials: bool = True,
    ) -> Stack:
        """Start every server; `profile` runs the resources server under cProfile, writing that file;
        `variant` adds a resources server with these `variant_resources_server.py` patches;
        `data_plane_credentials=False` opens their data plane (`--no-data-plane-credentials`)."""
        token = new_token()
        env = child_env(token)
        py = sys.executable

        def resources(name: str, ready: Path, launcher: list[str]) -> list[str]:
            return [*launcher, "--environment", "counter", "--name", name, "--registry", registry.address,
                    "--ready-file", str(ready), "--grace", "1", *open_flag]  # fmt: skip

        open_flag = [] if data_plane_credentials else ["--no-data-plane-credentials"]

        registry = spawn(
            "registry",
            [py, "-m", "gymrpc.servers.registry", "--bind", f"unix:{folder / 'registry.sock'}",
             "--ready-file", str(folder / "registry.json"), "--grace", "1"],
            folder / "registry.json", env,
        )  # fmt: skip
        started = [registry]
        try:
            profiler = ["-m", "cProfile", "-o", str(profile)] if profile else []
            ready = folder / "resources.json"
            launcher = [py, *profiler, "-m", "gymrpc.servers.resources"]
            started.append(spawn("resources", resources(SERVICE_NAME, ready, launcher), ready, env))
            ready = folder / "http.json"
            http = [py, str(ROOT / "bench" / "http_counter_server.py"), "--ready-file", str(ready),
                    "--loop", http_loop, "--http", http_parser]  # fmt: skip
            started.append(spawn("fastapi", http, ready, env))
            ready = folder / "open.json"
            started.append(spawn("open", [*resources(OPEN_NAME, ready, [py, "-m", "gymrpc.servers.resources"]),
                                          "--no-data-plane-credentials"], ready, env))  # fmt: skip
            pki = create_stack_pki(folder / "tls", [TLS_NAME], ["127.0.0.1", "localhost"])
            files = pki.servers[TLS_NAME]
            ready = folder / "tls-server.json"  # not tls.json: that would make the folder a TLS run folder
            tls_server = [py, "-m", "gymrpc.servers.resources", "--environment", "counter", "--name", TLS_NAME,
                          "--ready-file", str(ready), "--grace", "1", "--tls-cert", str(files.cert),
                          "--tls-key", str(files.key), "--tls-ca", str(files.ca)]  # fmt: skip
            started.append(spawn("tls", tls_server, ready, env))  # not registered: the registry is plaintext
            if variant is not None:
                ready = folder / "variant.json"
                patches = [arg for patch in variant for arg in ("--patch", patch)]
                launcher = [py, str(ROOT / "bench" / "variant_resources_server.py"), *patches, "--"]
                started.append(spawn("variant", resources(VARIANT_NAME, ready, launcher), ready, env))
        except BaseException:
            for server in reversed(started):
                server.stop()
            raise
        return cls(registry, started[1], started[2], token, started[3], started[4], pki.client,
                   started[5] if variant is not None else None)  # fmt: skip

    def server(self, kind: str) -> ServerProcess:
        server = {GRPC: self.grpc, HTTP: self.http, VARIANT: self.variant, OPEN: self.open, TLS: self.tls}[kind]
        assert server is not None
        return server

    def stop(self) -> None:
        # Resources servers deregister before the registry goes.
        for server in (self.variant, self.tls, self.open, self.http, self.grpc, self.registry):
            if server is not None:
                server.stop()


# -- clients ------------------------------------------------------------------------------


def grpc_request(session_id: str, ids: Iterator[int]) -> pb.CallToolRequest:
    return pb.CallToolRequest(
        session_id=session_id,
        episode_id=common_pb2.EpisodeId(rollout_id=ROLLOUT, attempt=0),
        call=common_pb2.ToolCall(id=f"call_{next(ids)}", name=TOOL, arguments_json=ARGUMENTS),
    )


def http_body(session_id: str, ids: Iterator[int]) -> dict[str, Any]:
    return {
        "session_id": session_id,
        "episode_id": {"rollout_id": ROLLOUT, "attempt": 0},
        "call": {"id": f"call_{next(ids)}", "name": TOOL, "arguments_json": ARGUMENTS},
    }


def _check(is_error: bool, output: str) -> None:
    if is_error:
        raise RuntimeError(f"tool call failed: {output}")


class Clients:
    """Every client object of the run, created inside the bench's event loop."""

    def __init__(self, stack: Stack, folder: Path) -> None:
        self.stack = stack
        self.credential = auth.metadata(stack.token)
        grpc_target, http_base = stack.grpc.address, f"http://{stack.http.address}"
        self.aio_channel = grpc.aio.insecure_channel(grpc_target, options=service_channel_options())
        self.aio_stub = pb_grpc.ResourcesServiceStub(self.aio_channel)
        self.sync_channel = grpc.insecure_channel(grpc_target, options=service_channel_options())
        self.sync_stub = pb_grpc.ResourcesServiceStub(self.sync_channel)
        self.client = Client(registry=stack.registry.address, token=stack.token, run_dir=folder)
        self.named: Any = self.client.resources(SERVICE_NAME)  # typed as the sync stub class
        self.httpx_async = httpx.AsyncClient(base_url=http_base)
        self.httpx_sync = httpx.Client(base_url=http_base)
        self.own_httpx: list[httpx.AsyncClient] = []
        self.open_channel = grpc.aio.insecure_channel(stack.open.address, options=service_channel_options())
        self.open_stub = pb_grpc.ResourcesServiceStub(self.open_channel)
        self.tls_channel = grpc.aio.secure_channel(
            stack.tls.address, stack.tls_client.channel_credentials(), options=service_channel_options()
        )
        self.tls_stub = pb_grpc.ResourcesServiceStub(self.tls_channel)
        self.variant_channel = self.variant_stub = None
        if stack.variant is not None:
            self.variant_channel = grpc.aio.insecure_channel(stack.variant.address, options=service_channel_options())
            self.variant_stub = pb_grpc.ResourcesServiceStub(self.variant_channel)

    async def seed(self, kind: str, session_id: str) -> None:
        episode = common_pb2.EpisodeId(rollout_id=ROLLOUT, attempt=0)
        if kind in (GRPC, VARIANT, OPEN, TLS):
            task = common_pb2.Task(task_id="bench", env_json=SEED_ENV)
            request = pb.SeedSessionRequest(session_id=session_id, episode_id=episode, task=task)
            stub = {GRPC: self.aio_stub, VARIANT: self.variant_stub, OPEN: self.open_stub, TLS: self.tls_stub}[kind]
            assert stub is not None
            await stub.SeedSession(request, metadata=self.credential)
        else:
            body = {"session_id": session_id, "episode_id": {"rollout_id": ROLLOUT, "attempt": 0},
                    "task": {"task_id": "bench", "env_json": SEED_ENV}}  # fmt: skip
            (await self.httpx_async.post("/v1/seed_session", json=body)).raise_for_status()

    def aio_stub_call(self, session_id: str) -> AsyncCall:
        return _grpc_call(self.aio_stub.CallTool, session_id, self.credential)

    def variant_call(self, session_id: str) -> AsyncCall:
        assert self.variant_stub is not None
        return _grpc_call(self.variant_stub.CallTool, session_id, self.credential)

    def open_call(self, session_id: str) -> AsyncCall:
        """No credential: the server was started with `--no-data-plane-credentials`."""
        return _grpc_call(self.open_stub.CallTool, session_id)

    def tls_call(self, session_id: str) -> AsyncCall:
        return _grpc_call(self.tls_stub.CallTool, session_id, self.credential)

    def named_call(self, session_id: str) -> AsyncCall:
        return _grpc_call(self.named.CallTool, session_id)

    def sync_stub_call(self, session_id: str) -> SyncCall:
        ids, call, credential = itertools.count(), self.sync_stub.CallTool, self.credential

        def run() -> None:
            reply = call(grpc_request(session_id, ids), metadata=credential)
            _check(reply.is_error, reply.output)

        return run

    def httpx_async_call(self, session_id: str) -> AsyncCall:
        ids, post = itertools.count(), self.httpx_async.post

        async def run() -> None:
            response = await post("/v1/call_tool", json=http_body(session_id, ids))
            response.raise_for_status()
            data = response.json()
            _check(data["is_error"], data["output"])

        return run

    def httpx_own_async_call(self, session_id: str) -> AsyncCall:
        """A caller with its own AsyncClient: httpx's shared pool costs ~1 ms CPU per call at 16 callers."""
        client = httpx.AsyncClient(base_url=self.httpx_async.base_url)
        self.own_httpx.append(client)
        ids, post = itertools.count(), client.post

        async def run() -> None:
            response = await post("/v1/call_tool", json=http_body(session_id, ids))
            response.raise_for_status()
            data = response.json()
            _check(data["is_error"], data["output"])

        return run

    def httpx_sync_call(self, session_id: str) -> SyncCall:
        ids, post = itertools.count(), self.httpx_sync.post

        def run() -> None:
            response = post("/v1/call_tool", json=http_body(session_id, ids))
            response.raise_for_status()
            data = response.json()
            _check(data["is_error"], data["output"])

        return run

    async def close(self) -> None:
        await self.client.close()
        await self.aio_channel.close(None)
        await self.open_channel.close(None)
        await self.tls_channel.close(None)
        if self.variant_channel is not None:
            await self.variant_channel.close(None)
        self.sync_channel.close()
        await self.httpx_async.aclose()
        for client in self.own_httpx:
            await client.aclose()
        self.httpx_sync.close()


# -- configs and measurement --------------------------------------------------------------


@dataclass
class Config:
    """One client/server pairing; `callers` is filled once its sessions are seeded."""

    key: str
    label: str
    server: str
    make: Callable[[Clients, str], AsyncCall | SyncCall]
    is_async: bool
    concurrency: int = 1
    baseline: str | None = None
    """FastAPI config this one is compared with: httpx.AsyncClient, as many callers, one client."""
    best_http: str | None = None
    """The fastest FastAPI config of the same concurrency (sync client; one AsyncClient per caller)."""
    callers: list[Any] = field(default_factory=list)
    rounds: list[dict[str, float]] = field(default_factory=list)
    latencies_ns: list[int] = field(default_factory=list)


def build_configs(concurrency: int, variant: str | None = None) -> list[Config]:
    """Sequential configs, then (concurrency > 1) as many callers sharing one client.

    With `variant`, the raw aio stub also calls the patched resources server; its ratio is
    against the same client on the real server, so it reads as the patch's gain.
    """
    ref: dict[str, Any] = {"baseline": "http-async", "best_http": "http-sync"}
    configs = [
        Config("grpc-aio", "gRPC  raw grpc.aio stub", GRPC, Clients.aio_stub_call, True, **ref),
        Config("grpc-client", "gRPC  gymrpc.Client (registry+retry)", GRPC, Clients.named_call, True, **ref),
        Config("grpc-sync", "gRPC  raw sync stub", GRPC, Clients.sync_stub_call, False, **ref),
        Config("http-async", "HTTP  FastAPI <- httpx.AsyncClient", HTTP, Clients.httpx_async_call, True,
               **ref),
        Config("http-sync", "HTTP  FastAPI <- httpx.Client", HTTP, Clients.httpx_sync_call, False, **ref),
    ]  # fmt: skip
    # Against the raw stub with its credential over plaintext: what TLS + mTLS costs, and what
    # the data-plane credential costs (its ratio is without / with).
    configs += [
        Config("grpc-aio-tls", "gRPC  raw grpc.aio stub, TLS + mTLS", TLS, Clients.tls_call, True,
               baseline="grpc-aio"),
        Config("grpc-aio-open", "gRPC  raw grpc.aio stub, no credential", OPEN, Clients.open_call, True,
               baseline="grpc-aio"),
    ]  # fmt: skip
    if variant:
        configs.append(Config("grpc-aio-variant", f"gRPC  raw grpc.aio stub -> [{variant}]", VARIANT,
                              Clients.variant_call, True, baseline="grpc-aio"))  # fmt: skip
    if concurrency <= 1:
        return configs
    c = concurrency
    ref = {"baseline": f"http-async-c{c}", "best_http": f"http-async-own-c{c}"}
    configs += [
        Config(f"grpc-aio-c{c}", f"gRPC  raw grpc.aio stub x{c}", GRPC, Clients.aio_stub_call, True, c,
               **ref),
        Config(f"grpc-client-c{c}", f"gRPC  gymrpc.Client x{c}", GRPC, Clients.named_call, True, c, **ref),
        Config(f"http-async-c{c}", f"HTTP  FastAPI <- httpx.AsyncClient x{c}", HTTP, Clients.httpx_async_call,
               True, c, **ref),
        Config(f"http-async-own-c{c}", f"HTTP  FastAPI <- {c} own httpx.AsyncClient", HTTP,
               Clients.httpx_own_async_call, True, c, **ref),
        Config(f"grpc-aio-tls-c{c}", f"gRPC  raw grpc.aio stub x{c}, TLS + mTLS", TLS, Clients.tls_call, True, c,
               baseline=f"grpc-aio-c{c}"),
        Config(f"grpc-aio-open-c{c}", f"gRPC  raw grpc.aio stub x{c}, no credential", OPEN, Clients.open_call,
               True, c, baseline=f"grpc-aio-c{c}"),
    ]  # fmt: skip
    if variant:
        label = f"gRPC  raw grpc.aio stub x{c} -> [{variant}]"
        configs.append(Config(f"grpc-aio-variant-c{c}", label, VARIANT, Clients.variant_call, True, c,
                              baseline=f"grpc-aio-c{c}"))  # fmt: skip
    return configs


def _split(n: int, parts: int) -> list[int]:
    return [n // parts + (i < n % parts) for i in range(parts)]


async def _drive_async(callers: list[AsyncCall], n: int, out: list[int] | None) -> None:
    async def worker(call: AsyncCall, k: int) -> None:
        clock = time.perf_counter_ns
        for _ in range(k):
            t0 = clock()
            await call()
            if out is not None:
                out.append(clock() - t0)

    await asyncio.gather(*(worker(c, k) for c, k in zip(callers, _split(n, len(callers)), strict=True)))


def _drive_sync(call: SyncCall, n: int, out: list[int] | None) -> None:
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        call()
        if out is not None:
            out.append(clock() - t0)


def _client_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(runner: asyncio.Runner, config: Config, server: ServerProcess, n: int, warmup: int) -> None:
    """Warm up, then time `n` calls of one config; appends a round and the latencies."""

    def drive(count: int, out: list[int] | None) -> None:
        if config.is_async:
            runner.run(_drive_async(config.callers, count, out))
        else:
            _drive_sync(config.callers[0], count, out)

    drive(warmup, None)
    latencies: list[int] = []
    cpu_client, cpu_server, t0 = _client_cpu(), server.cpu_seconds(), time.perf_counter()
    drive(n, latencies)
    wall = time.perf_counter() - t0
    cpu_client, cpu_server = _client_cpu() - cpu_client, server.cpu_seconds() - cpu_server
    config.latencies_ns.extend(latencies)
    config.rounds.append({
        "calls_per_s": n / wall, "wall_s": wall, "n": n,
        "client_cpu_us_per_call": cpu_client / n * 1e6, "server_cpu_us_per_call": cpu_server / n * 1e6,
        "p50_us": _quantile(latencies, 0.50) / 1e3, "p99_us": _quantile(latencies, 0.99) / 1e3,
    })  # fmt: skip


def _quantile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def summarize(config: Config) -> dict[str, float]:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in config.rounds)

    return {
        "calls_per_s": med("calls_per_s"),
        "p50_us": _quantile(config.latencies_ns, 0.50) / 1e3,
        "p99_us": _quantile(config.latencies_ns, 0.99) / 1e3,
        "cpu_us_per_call": statistics.median(
            r["client_cpu_us_per_call"] + r["server_cpu_us_per_call"] for r in config.rounds
        ),
        "client_cpu_us_per_call": med("client_cpu_us_per_call"),
        "server_cpu_us_per_call": med("server_cpu_us_per_call"),
    }


# -- reporting ----------------------------------------------------------------------------


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("grpcio", "protobuf", "fastapi", "uvicorn", "uvloop", "httptools", "httpx", "pydantic"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "absent"
    return out


def payload_sizes() -> dict[str, int]:
    ids = itertools.count(1000)
    request = grpc_request("grpc-aio-0", ids)
    body = http_body("http-async-0", ids)
    reply = pb.CallToolResponse(output=json.dumps({"success": True}))
    return {
        "grpc_request_bytes": len(request.SerializeToString()),
        "grpc_response_bytes": len(reply.SerializeToString()),
        "http_request_body_bytes": len(json.dumps(body, separators=(",", ":"))),
        "http_response_body_bytes": len(json.dumps({"output": reply.output, "is_error": False}, separators=(",", ":"))),
    }


def report(configs: list[Config], summaries: dict[str, dict[str, float]]) -> list[str]:
    """Prints the table and the RATIO lines; returns the ratio lines."""
    w = max(len(c.label) for c in configs)
    header = (f"{'config':<{w}} {'calls/s':>8} {'p50 us':>8} {'p99 us':>8} {'CPU us/call':>12} "
              f"{'(srv+cli)':>11} {'x base':>8} {'x best':>7}  per-round calls/s")  # fmt: skip
    print(header)
    print("-" * len(header))
    for config in configs:
        s = summaries[config.key]
        ratio = _ratio(s, summaries, config.baseline)
        best = _ratio(s, summaries, config.best_http)
        per_round = " ".join(f"{r['calls_per_s']:.0f}" for r in config.rounds)
        split = f"{s['server_cpu_us_per_call']:.0f}+{s['client_cpu_us_per_call']:.0f}"
        print(f"{config.label:<{w}} {s['calls_per_s']:>8.0f} {s['p50_us']:>8.0f} {s['p99_us']:>8.0f} "
              f"{s['cpu_us_per_call']:>12.0f} {split:>11} {ratio:>8} {best:>7}  {per_round}")  # fmt: skip
    print(
        "x base: calls/s against FastAPI <- one httpx.AsyncClient at the same concurrency "
        "(a variant: against the same client on the real server)\n"
        "x best: against the fastest FastAPI client at the same concurrency "
        "(sequential: httpx.Client; concurrent: one httpx.AsyncClient per caller)\n"
    )
    lines = []
    for config in configs:
        if config.server == HTTP:
            continue
        for base in (config.baseline, config.best_http):
            if base is None or base not in summaries:
                continue
            s, b = summaries[config.key], summaries[base]
            cpu = s["cpu_us_per_call"] / b["cpu_us_per_call"] if b["cpu_us_per_call"] > 0 else float("nan")
            lines.append(
                f"RATIO {config.key} / {base}: {s['calls_per_s'] / b['calls_per_s']:.2f}x calls/s "
                f"({s['calls_per_s']:.0f} vs {b['calls_per_s']:.0f}), {cpu:.2f}x the CPU per call"
            )
    for line in lines:
        print(line)
    return lines


def _ratio(s: dict[str, float], summaries: dict[str, dict[str, float]], base: str | None) -> str:
    if base is None or base not in summaries:
        return "-"
    return f"{s['calls_per_s'] / summaries[base]['calls_per_s']:.2f}x"


# -- main ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short run for smoke tests (N=200, 2 rounds)")
    parser.add_argument("-n", "--calls", type=int, default=1500, help="timed calls per config per round")
    parser.add_argument("--warmup", type=int, default=150, help="untimed calls per config per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; configs are interleaved within each")
    parser.add_argument("--concurrency", type=int, default=16, help="callers of concurrent configs (1: none)")
    parser.add_argument("--only", help="comma-separated config keys to run (baselines are added)")
    parser.add_argument("--client-loop", choices=["asyncio", "uvloop"], default="asyncio",
                        help="event loop of the bench (client) process")  # fmt: skip
    parser.add_argument("--http-loop", choices=["uvloop", "asyncio"], default="uvloop")
    parser.add_argument("--http-parser", choices=["httptools", "h11"], default="httptools")
    parser.add_argument(
        "--variant",
        help="also run a resources server with these comma-separated patches of "
        "bench/variant_resources_server.py (inline-env, asyncio, no-guard, metrics, tracing) and compare",
    )
    parser.add_argument("--json", type=Path, help="write all results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.calls, args.warmup, args.rounds = 200, 50, 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configs = build_configs(args.concurrency, args.variant)
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {c.key for c in configs}
        if unknown:
            raise SystemExit(f"--only: unknown configs {sorted(unknown)}; known: {[c.key for c in configs]}")
        wanted |= {b for c in configs if c.key in wanted for b in (c.baseline, c.best_http) if b}
        configs = [c for c in configs if c.key in wanted]
    loop_factory = None
    if args.client_loop == "uvloop":
        import uvloop

        loop_factory = uvloop.new_event_loop
    load_before = os.getloadavg()
    sizes = payload_sizes()
    print(
        f"unary CallTool({TOOL}, {ARGUMENTS}) on the counter env; N={args.calls} timed + {args.warmup} "
        f"warm-up calls per config per round, {args.rounds} rounds, interleaved; "
        f"client loop {args.client_loop}"
    )
    print(
        f"payload: gRPC request {sizes['grpc_request_bytes']} B / response {sizes['grpc_response_bytes']} B; "
        f"HTTP JSON body {sizes['http_request_body_bytes']} B / {sizes['http_response_body_bytes']} B"
    )
    print(
        f"cpus {os.cpu_count()}, load {load_before[0]:.2f} {load_before[1]:.2f}; "
        + ", ".join(f"{k} {v}" for k, v in _versions().items())
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gymrpc-bench-") as tmp:
        folder = Path(tmp)
        variant = args.variant.split(",") if args.variant else None
        stack = Stack.start(folder, args.http_loop, args.http_parser, variant=variant)
        try:
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                clients = runner.run(_make_clients(stack, folder))
                try:
                    for config in configs:
                        sessions = [f"{config.key}-{i}" for i in range(config.concurrency)]
                        for session_id in sessions:
                            runner.run(clients.seed(config.server, session_id))
                        config.callers = [config.make(clients, s) for s in sessions]
                    for r in range(args.rounds):
                        shift = r % len(configs)
                        for config in configs[shift:] + configs[:shift]:
                            measure(runner, config, stack.server(config.server), args.calls, args.warmup)
                finally:
                    runner.run(clients.close())
        finally:
            stack.stop()
    load_after = os.getloadavg()
    print(f"took {time.perf_counter() - started:.0f}s; load after {load_after[0]:.2f} {load_after[1]:.2f}\n")
    summaries = {c.key: summarize(c) for c in configs}
    ratios = report(configs, summaries)
    if args.json:
        args.json.write_text(json.dumps({
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "versions": _versions(), "payload": sizes, "cpus": os.cpu_count(),
            "loadavg_before": load_before, "loadavg_after": load_after,
            "configs": {c.key: {"label": c.label, "concurrency": c.concurrency, "baseline": c.baseline,
                                "summary": summaries[c.key], "rounds": c.rounds} for c in configs},
            "ratios": ratios,
        }, indent=2))  # fmt: skip
    return 0


async def _make_clients(stack: Stack, folder: Path) -> Clients:
    return Clients(stack, folder)


def _grpc_call(call: Any, session_id: str, metadata: tuple[tuple[str, str], ...] | None = None) -> AsyncCall:
    """One timed CallTool on `call` (any async stub method), with a fresh call id each time.

    `metadata` is the raw stubs' credential (`gymrpc.Client`'s named stubs send their own)."""
    ids = itertools.count()
    extra = {} if metadata is None else {"metadata": metadata}

    async def run() -> None:
        reply = await call(grpc_request(session_id, ids), **extra)
        _check(reply.is_error, reply.output)

    return run


if __name__ == "__main__":
    sys.exit(main())
