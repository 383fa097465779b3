"""The local launcher: every server a process on this machine, supervised and restarted.

The registry listens on a unix socket in the run folder, so its address never
changes, even when the registry itself is restarted. Servers bind port 0 and
register what they got; a restarted server registers its new port under the same
name and clients follow it. A server with `replicas: N` runs N processes under one
name, endpoint ids `0`..`N-1`.

`ServerProcess` (one supervised process) is shared with the Ray launcher, whose host
actors run it on cluster nodes: both launchers start, watch and restart servers alike.
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
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from grpc_health.v1 import health_pb2, health_pb2_grpc

from gymrpc import auth, rundir
from gymrpc.channels import open_channel, service_channel_options
from gymrpc.errors import GymrpcError
from gymrpc.launch.base import ServerState
from gymrpc.launch.spec import RestartPolicy, ServerSpec, StackSpec
from gymrpc.launch.storage import CheckpointDirError, check_checkpoint_dir, checkpoint_dirs, needs_ofd
from gymrpc.registry import RegistryClient
from gymrpc.tls import (
    TLS_DIR,
    TLS_FILE,
    StackPki,
    TlsFiles,
    create_stack_pki,
    local_hosts,
    write_run_dir_tls,
)

log = logging.getLogger(__name__)
REGISTRY_NAME = "registry/main"


class StartError(RuntimeError):
    """A server did not come up; the message carries the tail of its log."""


@dataclass(frozen=True)
class ProcessConfig:
    """What a server process needs from its launcher besides its own spec."""

    registry_address: str
    token_file: Path
    lease_ttl: float
    grace: float
    restart: RestartPolicy
    log_path: Path
    bind: str
    """The address to bind: the spec's, or (Ray) the spec's port on the node's IP."""
    ready_file: Path | None = None
    """The registry only: where it writes its address once serving."""
    new_session: bool = True
    """Start the process in its own session (local: a Ctrl-C of `gymrpc up` reaches only the launcher)."""
    tls: TlsFiles | None = None
    """The server's certificate, key and CA (mTLS); None: plaintext."""
    client_tls: TlsFiles | None = None
    """What the launcher presents when it checks the server's health."""
    insecure: bool = False
    """Pass `--insecure`: plaintext allowed on a non-loopback bind."""


class ServerProcess:
    """One server process: spawned with the launcher's flags, awaited until SERVING, restarted by policy.

    `on_change` runs after every state change (the launcher writes `stack.json` there).
    `registry` resolves the server's name to tell that it registered; None for the registry itself.
    """

    def __init__(
        self,
        spec: ServerSpec,
        endpoint_id: str,
        config: ProcessConfig,
        registry: RegistryClient | None,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.spec, self.endpoint_id, self.config = spec, endpoint_id, config
        self.label = spec.label(endpoint_id)
        self.state = ServerState(self.label, endpoint_id=endpoint_id)
        self.process: asyncio.subprocess.Process | None = None
        self._registry, self._on_change = registry, on_change
        self._restart_times: list[float] = []
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    # -- one start ---------------------------------------------------------------------------

    def argv(self) -> list[str]:
        spec, config = self.spec, self.config
        argv = [
            sys.executable,
            "-m",
            spec.module,
            "--name",
            spec.name,
            "--bind",
            config.bind,
            "--token-file",
            str(config.token_file),
            "--lease-ttl",
            str(config.lease_ttl),
            "--grace",
            str(config.grace),
            *spec.argv(),
        ]
        if spec.replicas > 1 or self.endpoint_id != "0":
            argv += ["--endpoint-id", self.endpoint_id]
        if config.tls is not None:
            argv += tls_flags(config.tls)
        if config.insecure:
            argv.append("--insecure")
        if config.ready_file is not None:
            argv += ["--ready-file", str(config.ready_file)]
        else:
            # The lease id outlives the process: restarted, it replaces its own registry entry at once.
            lease_file = config.log_path.with_name(f".{config.log_path.stem}.lease")
            argv += ["--registry", config.registry_address, "--lease-file", str(lease_file)]
        return argv

    async def _spawn(self) -> asyncio.subprocess.Process:
        env = {**os.environ, **self.spec.env, "GYMRPC_SUPERVISOR_PID": str(os.getpid())}
        env.setdefault("PYTHONUNBUFFERED", "1")
        with open(self.config.log_path, "ab") as out:  # noqa: ASYNC230 - a local append-open, microseconds
            return await asyncio.create_subprocess_exec(
                *self.argv(),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=env,
                start_new_session=self.config.new_session,
            )

    async def start(self) -> None:
        """Spawn the process and return once it is registered and SERVING; StartError otherwise."""
        self.state.state = "starting"
        self.process = await self._spawn()
        # The old address is dead with the old process; the new one is published once serving.
        self.state.pid, self.state.address = self.process.pid, None
        self._on_change()
        await self._wait_serving()
        self.state.state = "serving"
        self._on_change()
        log.info(
            "server serving",
            extra={"service": self.label, "pid": self.process.pid, "address": self.state.address},
        )

    async def _wait_serving(self) -> None:
        """Until the process has registered (the registry: bound its socket) and health says SERVING."""
        proc, spec = self.process, self.spec
        assert proc is not None
        deadline = time.monotonic() + spec.start_timeout
        address = None
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                raise StartError(f"{self.label} exited with code {proc.returncode} while starting:\n{self.tail()}")
            address = address or await self._registered_address(proc.pid)
            if address and await health_serving(address, tls=self.config.client_tls):
                self.state.address = address
                return
            await asyncio.sleep(0.05)
        raise StartError(f"{self.label} did not become SERVING within {spec.start_timeout:.0f}s:\n{self.tail()}")

    async def _registered_address(self, pid: int) -> str | None:
        if self.config.ready_file is not None:
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                info = json.loads(self.config.ready_file.read_text())
                if info.get("pid") == pid:
                    return str(info["address"])
            return None
        assert self._registry is not None
        try:
            endpoints = await self._registry.resolve(self.spec.name, timeout=2.0)
        except GymrpcError:
            return None
        return next(
            (e.address for e in endpoints if e.endpoint_id == self.endpoint_id and e.labels.get("pid") == str(pid)),
            None,
        )

    def tail(self, lines: int = 20) -> str:
        """The last lines of the server's log, indented, for error messages."""
        try:
            text = self.config.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(f"  | {line}" for line in text[-lines:]) + f"\n  (log: {self.config.log_path})"

    # -- supervision -------------------------------------------------------------------------

    def supervise(self) -> None:
        """Restart the process whenever it exits, until `stop` or the restart budget is spent."""
        self._task = asyncio.get_running_loop().create_task(self._supervise())

    async def _supervise(self) -> None:
        policy = self.config.restart
        while not self._stopping:
            assert self.process is not None
            code = await self.process.wait()
            if self._stopping:
                return
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
            self.state.last_exit = how
            now = time.monotonic()
            self._restart_times = [t for t in self._restart_times if now - t < policy.window_seconds]
            if policy.max_restarts is not None and len(self._restart_times) >= policy.max_restarts:
                self.state.state = "failed"
                self._on_change()
                log.error(
                    "server died too often; not restarting it",
                    extra={
                        "service": self.label,
                        "exit": how,
                        "restarts_in_window": len(self._restart_times),
                        "window_s": policy.window_seconds,
                    },
                )
                return
            self._restart_times.append(now)
            self.state.restarts += 1
            self.state.state = "restarting"
            delay = min(policy.backoff_seconds * 2 ** (len(self._restart_times) - 1), policy.max_backoff_seconds)
            self.state.backoff_s = round(delay, 3)
            self._on_change()
            log.warning(
                "server exited; restarting",
                extra={"service": self.label, "exit": how, "restart": self.state.restarts, "delay_s": delay},
            )
            await asyncio.sleep(delay)
            if self._stopping:
                return
            try:
                await self.start()
            except StartError as exc:
                log.error("restart failed: %s", exc, extra={"service": self.label})
                # the process may still be alive but unhealthy: kill it and let the loop count the restart
                if self.process is not None and self.process.returncode is None:
                    self.process.kill()

    async def stop(self, grace: float | None = None) -> None:
        """SIGTERM the process, SIGKILL it if it outlives the grace; supervision ends first."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
        proc = self.process
        if proc is not None and proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), timeout=(self.config.grace if grace is None else grace) + 3)
            except TimeoutError:
                log.warning("server ignored SIGTERM; killing it", extra={"service": self.label})
                proc.kill()
                await proc.wait()
        self.state.state = "stopped"


class LocalLauncher:
    """Starts a `StackSpec` as local processes and keeps it alive until `stop`."""

    def __init__(self, spec: StackSpec, run_dir: Path) -> None:
        self.spec, self.run_dir = spec, run_dir.absolute()
        self.token = auth.new_token()
        self.registry_address = (
            f"unix:{rundir.registry_socket(self.run_dir)}" if spec.registry_bind == "unix" else spec.registry_bind
        )
        self._registry_spec = ServerSpec(
            name=REGISTRY_NAME,
            role="registry",
            bind=self.registry_address,
            args={"metrics_port": 0} if spec.metrics else {},
        )
        self._servers: dict[str, ServerProcess] = {}
        self._stopping = False
        self._registry_client: RegistryClient | None = None
        self._lock_fd: int | None = None
        self.tls: StackPki | None = None
        self.state = "starting"

    # -- files ---------------------------------------------------------------------------

    def _prepare_run_dir(self) -> None:
        self._lock_fd = prepare_run_dir(self.run_dir, self.token)
        labels = [REGISTRY_NAME, *(s.name for s in self.spec.servers)]
        binds = [s.bind for s in self.spec.servers]
        self.tls = stack_tls(self.spec, self.run_dir, labels, binds)

    def write_state(self) -> None:
        write_stack_state(self.run_dir, "local", self.state, self.registry_address, self.server_states())

    def log_path(self, label: str) -> Path:
        return self.run_dir / rundir.LOG_DIR / log_file_name(label)

    def _process(self, spec: ServerSpec, endpoint_id: str, registry: RegistryClient | None) -> ServerProcess:
        is_registry = spec.role == "registry"
        config = ProcessConfig(
            registry_address=self.registry_address,
            token_file=self.run_dir / rundir.TOKEN_FILE,
            lease_ttl=self.spec.lease_ttl,
            grace=self.spec.grace,
            restart=self.spec.restart,
            log_path=self.log_path(spec.label(endpoint_id)),
            bind=spec.bind,
            ready_file=rundir.registry_ready(self.run_dir) if is_registry else None,
            tls=self.tls.servers[spec.name] if self.tls else None,
            client_tls=self.tls.client if self.tls else None,
            insecure=self.spec.insecure,
        )
        return ServerProcess(spec, endpoint_id, config, registry, self.write_state)

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Start the registry, then every server replica; return once all are SERVING."""
        self._prepare_run_dir()
        try:
            registry = self._servers[REGISTRY_NAME] = self._process(self._registry_spec, "0", None)
            await registry.start()
            registry.supervise()
            rundir.write_text_atomic(self.run_dir / rundir.REGISTRY_FILE, self.registry_address + "\n")
            self._registry_client = RegistryClient(
                self.registry_address, token=self.token, tls=self.tls.client if self.tls else None
            )
            await asyncio.gather(*(_check_dirs(s) for s in self.spec.servers))
            others = [
                self._process(spec, endpoint_id, self._registry_client)
                for spec in self.spec.servers
                for endpoint_id in spec.endpoint_ids()
            ]
            self._servers.update((p.label, p) for p in others)
            await asyncio.gather(*(p.start() for p in others))
            for process in others:
                process.supervise()
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
        others = [p for label, p in self._servers.items() if label != REGISTRY_NAME]
        await asyncio.gather(*(p.stop() for p in others))
        if REGISTRY_NAME in self._servers:
            await self._servers[REGISTRY_NAME].stop()
        if self._registry_client is not None:
            await self._registry_client.close()
        (self.run_dir / rundir.REGISTRY_FILE).unlink(missing_ok=True)
        self.state = "stopped"
        self.write_state()
        if self._lock_fd is not None:
            os.close(self._lock_fd)

    def server_states(self) -> list[ServerState]:
        return [p.state for p in self._servers.values()]


# -- shared with the Ray launcher ------------------------------------------------------------


def prepare_run_dir(run_dir: Path, token: str) -> int:
    """Create the run folder, take its lock (one stack per folder), write the token; returns the lock fd."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / rundir.LOG_DIR).mkdir(exist_ok=True)
    lock_fd = os.open(run_dir / "launcher.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock_fd)
        raise RuntimeError(f"a stack is already running in {run_dir}; stop it with `gymrpc down`") from None
    auth.write_token_file(run_dir / rundir.TOKEN_FILE, token)
    for role, file_name in auth.ROLE_TOKEN_FILES.items():  # handed to agents and trainers outside the stack
        auth.write_token_file(run_dir / file_name, auth.role_token(token, role))
    (run_dir / rundir.REGISTRY_FILE).unlink(missing_ok=True)
    (run_dir / TLS_FILE).unlink(missing_ok=True)  # a stack before this one may have spoken TLS
    return lock_fd


def stack_tls(spec: StackSpec, run_dir: Path, labels: list[str], binds: list[str]) -> StackPki | None:
    """The stack's TLS files by server name (generated for `tls: {generate: true}`), written to `tls.json`."""
    if spec.tls is None:
        return None
    if spec.tls.generate:
        hosts = [*local_hosts(), *(b.rpartition(":")[0].strip("[]") for b in binds if not b.startswith("unix:"))]
        pki = create_stack_pki(run_dir / TLS_DIR, labels, [h for h in hosts if h not in ("", "0.0.0.0", "::")])
    else:
        t = spec.tls
        server = TlsFiles(cert=t.cert, key=t.key, ca=t.ca, server_name=t.server_name)
        client = TlsFiles(cert=t.client_cert, key=t.client_key, ca=t.ca, server_name=t.server_name)
        assert t.ca is not None
        pki = StackPki(servers=dict.fromkeys(labels, server), client=client, ca=t.ca)
    write_run_dir_tls(run_dir, pki.client)
    return pki


def tls_flags(files: TlsFiles) -> list[str]:
    """The `--tls-*` flags of a server process."""
    out = []
    for flag, value in (
        ("--tls-cert", files.cert),
        ("--tls-key", files.key),
        ("--tls-ca", files.ca),
        ("--tls-server-name", files.server_name),
    ):
        if value:
            out += [flag, value]
    return out


def write_stack_state(run_dir: Path, launcher: str, state: str, registry: str, servers: list[ServerState]) -> None:
    """`stack.json`: what `gymrpc status` and `gymrpc down` read."""
    rundir.write_json_atomic(
        run_dir / rundir.STATE_FILE,
        {
            "launcher": launcher,
            "launcher_pid": os.getpid(),
            "state": state,
            "registry": registry,
            "updated_at": time.time(),
            "servers": [asdict(s) for s in servers],
        },
    )


def log_file_name(label: str) -> str:
    return label.replace("/", "__") + ".log"


async def _check_dirs(spec: ServerSpec) -> None:
    """Refuse to start a server whose checkpoint folder it could not use (the folder is local here)."""
    for folder in checkpoint_dirs(spec.args):
        try:
            await asyncio.to_thread(check_checkpoint_dir, folder, ofd=needs_ofd(spec.args))
        except CheckpointDirError as exc:
            raise StartError(f"{spec.name}: {exc}") from None


async def health_serving(address: str, timeout: float = 1.0, tls: TlsFiles | None = None) -> bool:
    channel = open_channel(address, service_channel_options(), tls=tls)
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except Exception:
        return False
    finally:
        await channel.close()
