"""The local launcher: every server a process on this machine, supervised and restarted.

The registry listens on a unix socket in the run folder, so its address never
changes, even when the registry itself is restarted. Servers bind port 0 and
register what they got; a restarted server registers its new port under the same
name and clients follow it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

from grpc_health.v1 import health_pb2, health_pb2_grpc

from gymrpc import auth, rundir
from gymrpc.channels import insecure_channel, service_channel_options
from gymrpc.errors import GymrpcError
from gymrpc.launch.base import ServerState
from gymrpc.launch.spec import ServerSpec, StackSpec
from gymrpc.registry import RegistryClient

log = logging.getLogger(__name__)
REGISTRY_NAME = "registry/main"


class StartError(RuntimeError):
    """A server did not come up; the message carries the tail of its log."""


class _Supervised:
    """One server process and its restart bookkeeping."""

    def __init__(self, spec: ServerSpec, state: ServerState) -> None:
        self.spec, self.state = spec, state
        self.process: asyncio.subprocess.Process | None = None
        self.restart_times: list[float] = []
        self.task: asyncio.Task[None] | None = None


class LocalLauncher:
    """Starts a `StackSpec` as local processes and keeps it alive until `stop`."""

    def __init__(self, spec: StackSpec, run_dir: Path) -> None:
        self.spec, self.run_dir = spec, run_dir.absolute()
        self.token = auth.new_token()
        self.registry_address = (
            f"unix:{rundir.registry_socket(self.run_dir)}" if spec.registry_bind == "unix" else spec.registry_bind
        )
        self._registry_spec = ServerSpec(name=REGISTRY_NAME, role="registry", bind=self.registry_address)
        self._servers: dict[str, _Supervised] = {}
        self._stopping = False
        self._registry_client: RegistryClient | None = None
        self._lock_fd: int | None = None
        self.state = "starting"

    # -- files ---------------------------------------------------------------------------

    def _prepare_run_dir(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / rundir.LOG_DIR).mkdir(exist_ok=True)
        self._lock_fd = os.open(self.run_dir / "launcher.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"a stack is already running in {self.run_dir}; stop it with `gymrpc down`") from None
        auth.write_token_file(self.run_dir / rundir.TOKEN_FILE, self.token)
        (self.run_dir / rundir.REGISTRY_FILE).unlink(missing_ok=True)

    def write_state(self) -> None:
        rundir.write_json_atomic(
            self.run_dir / rundir.STATE_FILE,
            {
                "launcher": "local",
                "launcher_pid": os.getpid(),
                "state": self.state,
                "registry": self.registry_address,
                "updated_at": time.time(),
                "servers": [asdict(s.state) for s in self._servers.values()],
            },
        )

    def log_path(self, name: str) -> Path:
        return self.run_dir / rundir.LOG_DIR / (name.replace("/", "__") + ".log")

    # -- processes -----------------------------------------------------------------------

    async def _spawn(self, spec: ServerSpec) -> asyncio.subprocess.Process:
        argv = [
            sys.executable,
            "-m",
            spec.module,
            "--name",
            spec.name,
            "--bind",
            spec.bind,
            "--token-file",
            str(self.run_dir / rundir.TOKEN_FILE),
            "--lease-ttl",
            str(self.spec.lease_ttl),
            "--grace",
            str(self.spec.grace),
            *spec.argv(),
        ]
        if spec.role == "registry":
            argv += ["--ready-file", str(self.run_dir / "registry.ready")]
        else:
            argv += ["--registry", self.registry_address]
        env = {**os.environ, **spec.env, "GYMRPC_SUPERVISOR_PID": str(os.getpid())}
        env.setdefault("PYTHONUNBUFFERED", "1")
        with open(self.log_path(spec.name), "ab") as out:  # noqa: ASYNC230 - a local append-open, microseconds
            return await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=env,
                start_new_session=True,
            )

    async def _wait_serving(self, sup: _Supervised) -> None:
        """Until the process has registered (the registry: bound its socket) and health says SERVING."""
        proc, spec = sup.process, sup.spec
        assert proc is not None
        deadline = time.monotonic() + spec.start_timeout
        address = None
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                raise StartError(f"{spec.name} exited with code {proc.returncode} while starting:\n{self._tail(spec)}")
            address = address or await self._registered_address(spec, proc.pid)
            if address and await _health_serving(address):
                sup.state.address = address
                return
            await asyncio.sleep(0.05)
        raise StartError(f"{spec.name} did not become SERVING within {spec.start_timeout:.0f}s:\n{self._tail(spec)}")

    async def _registered_address(self, spec: ServerSpec, pid: int) -> str | None:
        if spec.role == "registry":
            ready = self.run_dir / "registry.ready"
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                info = json.loads(ready.read_text())
                if info.get("pid") == pid:
                    return str(info["address"])
            return None
        assert self._registry_client is not None
        try:
            endpoints = await self._registry_client.resolve(spec.name, timeout=2.0)
        except GymrpcError:
            return None
        return next((e.address for e in endpoints if e.labels.get("pid") == str(pid)), None)

    def _tail(self, spec: ServerSpec, lines: int = 20) -> str:
        try:
            text = self.log_path(spec.name).read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(f"  | {line}" for line in text[-lines:]) + f"\n  (log: {self.log_path(spec.name)})"

    async def _start_one(self, sup: _Supervised) -> None:
        sup.state.state = "starting"
        sup.process = await self._spawn(sup.spec)
        sup.state.pid = sup.process.pid
        self.write_state()
        await self._wait_serving(sup)
        sup.state.state = "serving"
        self.write_state()
        log.info(
            "server serving",
            extra={"service": sup.spec.name, "pid": sup.process.pid, "address": sup.state.address},
        )

    async def _supervise(self, sup: _Supervised) -> None:
        policy = self.spec.restart
        while not self._stopping:
            assert sup.process is not None
            code = await sup.process.wait()
            if self._stopping:
                return
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
            sup.state.last_exit = how
            now = time.monotonic()
            sup.restart_times = [t for t in sup.restart_times if now - t < policy.window_seconds]
            if len(sup.restart_times) >= policy.max_restarts:
                sup.state.state = "failed"
                self.write_state()
                log.error(
                    "server died too often; not restarting it",
                    extra={
                        "service": sup.spec.name,
                        "exit": how,
                        "restarts_in_window": len(sup.restart_times),
                        "window_s": policy.window_seconds,
                    },
                )
                return
            sup.restart_times.append(now)
            sup.state.restarts += 1
            sup.state.state = "restarting"
            self.write_state()
            delay = min(policy.backoff_seconds * 2 ** (len(sup.restart_times) - 1), 5.0)
            log.warning(
                "server exited; restarting",
                extra={
                    "service": sup.spec.name,
                    "exit": how,
                    "restart": sup.state.restarts,
                    "delay_s": delay,
                },
            )
            await asyncio.sleep(delay)
            if self._stopping:
                return
            try:
                await self._start_one(sup)
            except StartError as exc:
                log.error("restart failed: %s", exc, extra={"service": sup.spec.name})
                # the process may still be alive but unhealthy: kill it and let the loop count the restart
                if sup.process is not None and sup.process.returncode is None:
                    sup.process.kill()

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Start the registry, then every server; return once all are SERVING."""
        self._prepare_run_dir()
        for spec in (self._registry_spec, *self.spec.servers):
            self._servers[spec.name] = _Supervised(spec, ServerState(spec.name))
        try:
            registry = self._servers[REGISTRY_NAME]
            await self._start_one(registry)
            registry.task = asyncio.get_running_loop().create_task(self._supervise(registry))
            rundir.write_text_atomic(self.run_dir / rundir.REGISTRY_FILE, self.registry_address + "\n")
            self._registry_client = RegistryClient(self.registry_address, token=self.token)
            others = [self._servers[s.name] for s in self.spec.servers]
            await asyncio.gather(*(self._start_one(s) for s in others))
            for sup in others:
                sup.task = asyncio.get_running_loop().create_task(self._supervise(sup))
        except BaseException:
            await self.stop()
            raise
        self.state = "serving"
        self.write_state()

    async def stop(self) -> None:
        """SIGTERM every server (callers first, registry last), SIGKILL what outlives the grace."""
        if self._stopping:
            return
        self._stopping = True
        self.state = "stopping"
        self.write_state()
        for sup in self._servers.values():
            if sup.task is not None:
                sup.task.cancel()
        others = [s for n, s in self._servers.items() if n != REGISTRY_NAME]
        await asyncio.gather(*(self._terminate(s) for s in others))
        if REGISTRY_NAME in self._servers:
            await self._terminate(self._servers[REGISTRY_NAME])
        if self._registry_client is not None:
            await self._registry_client.close()
        (self.run_dir / rundir.REGISTRY_FILE).unlink(missing_ok=True)
        self.state = "stopped"
        self.write_state()
        if self._lock_fd is not None:
            os.close(self._lock_fd)

    async def _terminate(self, sup: _Supervised) -> None:
        proc = sup.process
        if proc is not None and proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), timeout=self.spec.grace + 3)
            except TimeoutError:
                log.warning("server ignored SIGTERM; killing it", extra={"service": sup.spec.name})
                proc.kill()
                await proc.wait()
        sup.state.state = "stopped"

    def server_states(self) -> list[ServerState]:
        return [s.state for s in self._servers.values()]


async def _health_serving(address: str, timeout: float = 1.0) -> bool:
    channel = insecure_channel(address, service_channel_options())
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except Exception:
        return False
    finally:
        await channel.close()
