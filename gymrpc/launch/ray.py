"""The Ray launcher: the same servers, names and registry protocol, placed on a Ray cluster.

Each server replica runs under a *host actor* (`ServerHost`) that Ray places with the
server's resource requests (`num_cpus`, `num_gpus`, custom `resources`, `node` affinity;
replicas spread over the nodes otherwise). The host runs the very `python -m gymrpc.servers.<role>`
process the local launcher runs, bound to its node's IP, and supervises it with the stack's
restart policy (`ServerProcess`, shared with the local launcher). When the host itself dies
(its worker process, or its node), Ray restarts the actor (`max_actor_restarts`), on another
node if need be, and the new host starts the server again under the same name and endpoint id.

The registry runs the same way, pinned to the launcher's node on a port chosen once, so its
address never changes while the stack lives. Its host actor is named `gymrpc-registry` in the
stack's Ray namespace: `discover_registry` finds it, so `gymrpc.Client()` needs no address
inside a Ray job. Host actors belong to the `gymrpc up` process (not detached), so the stack
lives exactly as long as it does, as with the local launcher.

Nothing here imports `ray` at module level: the client's discovery fallback imports this module
and must stay cheap where Ray is absent.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import itertools
import logging
import math
import os
import signal
import socket
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gymrpc import auth, logs, rundir
from gymrpc.launch.base import ServerState
from gymrpc.launch.local import (
    REGISTRY_NAME,
    ProcessConfig,
    ServerProcess,
    StartError,
    log_file_name,
    prepare_run_dir,
    stack_tls,
    write_stack_state,
)
from gymrpc.launch.private import PrivateFolder
from gymrpc.launch.spec import RayOptions, RestartPolicy, ServerSpec, StackSpec
from gymrpc.launch.storage import (
    CheckpointDirError,
    Marker,
    check_checkpoint_dir,
    checkpoint_dirs,
    needs_ofd,
    write_marker,
)
from gymrpc.registry import RegistryClient
from gymrpc.tls import StackPki, TlsFiles, write_private

log = logging.getLogger(__name__)
REGISTRY_ACTOR = "gymrpc-registry"
"""Name of the registry's host actor in the stack's namespace: how Ray jobs find the stack."""
NAMESPACE_ENV = "GYMRPC_RAY_NAMESPACE"
MONITOR_INTERVAL = 0.5
CALL_TIMEOUT = 10.0
"""Seconds a host actor has to answer `status` before the launcher counts it as restarting."""


def discover_registry(
    namespace: str | None = None, timeout: float = CALL_TIMEOUT
) -> tuple[str, str, TlsFiles | None] | None:
    """`(registry address, token, client TLS)` of the stack the Ray launcher runs in `namespace`, from inside Ray.

    Returns None unless `ray` is already imported and initialized (a Ray job, task or actor, or
    a driver after `ray.init`) and the stack's registry actor exists; never imports or starts Ray.
    The namespace defaults to `$GYMRPC_RAY_NAMESPACE`, else `gymrpc`.

    The token comes along, and for a TLS stack the CA and client certificate (written to a
    private temporary folder of this process, mode 0600): anyone who can call actors on the
    cluster can already run any code on it, so the cluster, not the token, is the trust
    boundary there.
    """
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    namespace = namespace or os.environ.get(NAMESPACE_ENV) or RayOptions.namespace
    try:
        host = ray.get_actor(REGISTRY_ACTOR, namespace=namespace)
    except ValueError:
        return None
    info = ray.get(host.info.remote(), timeout=timeout)
    return info["registry"], info["token"], _client_tls(info) if info.get("ca") else None


_CLIENT_TLS: dict[tuple[str, str, str, str], TlsFiles | None] = {}
"""The client TLS files this process wrote, by their material: written once however often it discovers."""
_CLIENT_TLS_LOCK = threading.Lock()


def _client_tls(info: dict[str, Any]) -> TlsFiles | None:
    """The stack's client certificate, key and CA as files in a private folder of this process.

    A channel reads them whenever it is made, so they stay while the process runs; the folder
    (it holds a private key) is removed when the process exits, or by a later process if this one
    is killed (`PrivateFolder`).
    """
    cert, key = info["client_cert"], info["client_key"]  # no server key: the client side only
    material = (cert, key, info["ca"], info.get("server_name", ""))
    with _CLIENT_TLS_LOCK:
        if material not in _CLIENT_TLS:
            private = PrivateFolder("gymrpc-client-tls-")
            atexit.register(private.remove)
            folder = private.path
            pem = {"cert": cert, "key": key, "client_cert": cert, "client_key": key, "ca": info["ca"]}
            _CLIENT_TLS[material] = _write_tls(folder, {**pem, "server_name": material[3]})[1]
        return _CLIENT_TLS[material]


# -- on the nodes ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class HostConfig:
    """What a host actor needs to run its server; pickled to the node, reused on actor restarts."""

    registry_address: str
    """The registry's `host:port`; for the registry's own host, the address it binds."""
    token: str
    lease_ttl: float
    grace: float
    restart: RestartPolicy
    namespace: str
    log_dir: str | None = None
    markers: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Checkpoint folder -> the launcher's marker in it (`gymrpc.launch.storage.write_marker`)."""
    tls: dict[str, str] = field(default_factory=dict)
    """PEM material of this host's server (`cert`, `key`, `ca`, `client_cert`, `client_key`,
    `server_name`): only its own key travels to its node. Empty: plaintext."""
    insecure: bool = False
    """Pass `--insecure`: plaintext on the node's network address (docs/security.md)."""


class ServerHost:
    """Runs one server process on its Ray node and keeps it alive; a Ray actor (threaded).

    The server's event loop (spawn, health, restarts) runs in a thread of its own, so the
    actor's methods (`status`, `stop`) answer while the server starts or restarts.
    """

    def __init__(self, spec: ServerSpec, endpoint_id: str, config: HostConfig) -> None:
        import ray

        self.spec, self.endpoint_id, self.config = spec, endpoint_id, config
        self.label = spec.label(endpoint_id)
        logs.configure(f"ray-host:{self.label}")
        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self._restarted = ray.get_runtime_context().was_current_actor_reconstructed
        log_dir = Path(config.log_dir or Path(tempfile.gettempdir()) / f"gymrpc-{config.namespace}" / "logs")
        log_dir.mkdir(parents=True, exist_ok=True)
        self._folder = PrivateFolder("gymrpc-host-")  # the token file, TLS files, the registry's ready file
        self._private = self._folder.path
        token_file = self._private / "token"
        auth.write_token_file(token_file, config.token)
        is_registry = spec.role == "registry"
        bind = config.registry_address if is_registry else f"{self.node_ip}:{spec.bind.rpartition(':')[2]}"
        self._server_tls, self._client_tls = _write_tls(self._private, config.tls)
        process_config = ProcessConfig(
            registry_address=config.registry_address,
            token_file=token_file,
            lease_ttl=config.lease_ttl,
            grace=config.grace,
            restart=config.restart,
            log_path=log_dir / log_file_name(self.label),
            bind=bind,
            ready_file=self._private / "ready.json" if is_registry else None,
            new_session=False,  # stays in the worker's process group: stopping the node stops it too
            tls=self._server_tls,
            client_tls=self._client_tls,
            insecure=config.insecure,
        )
        self._config = process_config
        self._process: ServerProcess | None = None
        self._error: str | None = None
        self._settled, self._stopping = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"gymrpc-host-{self.label}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        registry = None
        if self.spec.role != "registry":
            registry = RegistryClient(self.config.registry_address, token=self.config.token, tls=self._client_tls)
        try:
            for folder in checkpoint_dirs(self.spec.args):
                kind = await asyncio.to_thread(
                    check_checkpoint_dir, folder, marker=self.config.markers.get(folder), ofd=needs_ofd(self.spec.args)
                )
                log.info("checkpoint folder usable", extra={"service": self.label, "folder": folder, "fs": kind})
            self._process = ServerProcess(self.spec, self.endpoint_id, self._config, registry)
            self._process.state.node = self.node_ip
            await self._process.start()
            self._process.supervise()
        except StartError as exc:
            if self._restarted and self._process is not None and self._process.process is not None:
                # Ray restarted this host: `gymrpc up` is not waiting to report the failure, so the
                # restart policy takes over, as for a server that died.
                log.error("server could not start; restarting it: %s", exc, extra={"service": self.label})
                if self._process.process.returncode is None:
                    self._process.process.kill()
                self._process.supervise()
            else:
                await self._fail(str(exc))
        except CheckpointDirError as exc:
            await self._fail(f"{self.label}: {exc}")
        finally:
            self._settled.set()
        await asyncio.to_thread(self._stopping.wait)
        if self._process is not None:
            await self._process.stop()
        if registry is not None:
            await registry.close()
        self._folder.remove()

    async def _fail(self, error: str) -> None:
        self._error = error
        log.error("server could not start: %s", error, extra={"service": self.label})
        if self._process is not None:
            await self._process.stop(0)
            self._process.state.state = "failed"

    # -- actor methods ------------------------------------------------------------------------

    def wait_serving(self) -> dict[str, Any]:
        """Block until the first start settled; the status, or RuntimeError with the server's log tail."""
        self._settled.wait()
        if self._error is not None:
            raise RuntimeError(self._error)
        return self.status()

    def status(self) -> dict[str, Any]:
        """The server's `ServerState` as a dict, plus this host's pid and node."""
        if self._process is None:
            state = ServerState(self.label, endpoint_id=self.endpoint_id, node=self.node_ip)
            state.state = "failed" if self._error else "starting"
        else:
            state = self._process.state
        return {**asdict(state), "host_pid": os.getpid(), "node_id": self.node_id, "error": self._error}

    def info(self) -> dict[str, str]:
        """What `discover_registry` returns (with the client side of a TLS stack's material)."""
        tls = self.config.tls
        out = {"registry": self.config.registry_address, "token": self.config.token}
        if tls:
            out |= {k: tls[k] for k in ("ca", "client_cert", "client_key", "server_name")}
        return out

    def stop(self) -> None:
        """Stop the server gracefully (SIGTERM, drain, SIGKILL after the grace); idempotent."""
        self._stopping.set()
        self._thread.join(timeout=self.config.grace + 10)


# -- on the launcher's node ----------------------------------------------------------------------


@dataclass
class _Host:
    spec: ServerSpec
    endpoint_id: str
    label: str
    actor: Any
    state: ServerState
    host_pid: int | None = None
    carried: int = 0
    """Restarts of earlier incarnations of the host (each Ray restart counts one more)."""


class RayLauncher:
    """Starts a `StackSpec` on a Ray cluster and keeps it alive until `stop`."""

    def __init__(self, spec: StackSpec, run_dir: Path) -> None:
        self.spec, self.run_dir = spec, run_dir.absolute()
        self.token = auth.new_token()
        self.registry_address = ""
        self.state = "starting"
        self._hosts: dict[str, _Host] = {}
        self._markers: dict[str, Marker] = {}
        self._lock_fd: int | None = None
        self._tls: StackPki | None = None
        self._connected = False
        self._monitor: asyncio.Task[None] | None = None
        self._stopping = False
        for server in spec.servers:
            if server.bind.startswith("unix:"):
                raise ValueError(f"{server.name}: a unix socket is reachable from one machine only; bind host:port")

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect to Ray, start the registry on this node, then every replica; return once all serve."""
        self._lock_fd = prepare_run_dir(self.run_dir, self.token)
        try:
            ray = self._connect()
            for folder in sorted({f for s in self.spec.servers for f in checkpoint_dirs(s.args)}):
                try:
                    self._markers[folder] = write_marker(folder)
                except OSError as exc:
                    raise StartError(f"checkpoint folder {folder} on the launcher's node: {exc}") from None
            self.registry_address = self._registry_address(ray)
            config = HostConfig(
                registry_address=self.registry_address,
                token=self.token,
                lease_ttl=self.spec.lease_ttl,
                grace=self.spec.grace,
                restart=self.spec.restart,
                namespace=self.spec.ray.namespace,
                log_dir=self.spec.ray.log_dir,
                markers={folder: marker.proof for folder, marker in self._markers.items()},
                insecure=self.spec.insecure,
            )
            labels = [REGISTRY_NAME, *(s.name for s in self.spec.servers)]
            node_ips = [str(n["NodeManagerAddress"]) for n in _alive_nodes(ray)]
            self._tls = stack_tls(self.spec, self.run_dir, labels, [f"{ip}:0" for ip in node_ips])
            registry_spec = ServerSpec(
                name=REGISTRY_NAME, role="registry", num_cpus=0, args={"metrics_port": 0} if self.spec.metrics else {}
            )
            here = ray.get_runtime_context().get_node_id()
            await self._start_hosts(ray, [(registry_spec, "0", self._strategy(ray, here), REGISTRY_ACTOR)], config)
            rundir.write_text_atomic(self.run_dir / rundir.REGISTRY_FILE, self.registry_address + "\n")
            slots = itertools.count()  # every unpinned replica of the stack takes the next node in turn
            instances = [
                (spec, endpoint_id, self._strategy(ray, spec.node, next(slots)), f"gymrpc:{spec.label(endpoint_id)}")
                for spec in self.spec.servers
                for endpoint_id in spec.endpoint_ids()
            ]
            await self._start_hosts(ray, instances, config)
        except BaseException:
            await self.stop()
            raise
        self.state = "serving"
        self.write_state()
        self._monitor = asyncio.get_running_loop().create_task(self._watch())

    def _connect(self) -> Any:
        if not self.spec.ray.address and "ray" not in sys.modules:
            # A private instance is one machine: keep Ray (and so every server) on loopback instead of
            # the machine's network address. Ray reads this once, at import; it means "single node".
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        try:
            import ray
        except ImportError:
            raise RuntimeError("launcher: ray needs the `ray` package: pip install 'gymrpc[ray]'") from None
        options = self.spec.ray
        if not ray.is_initialized():
            # ray.init makes SIGTERM a sys.exit: `gymrpc down` would then kill the stack instead of stopping it.
            handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
            if options.address:
                ray.init(address=options.address, namespace=options.namespace, logging_level=logging.WARNING)
            else:  # a private instance on this machine, sized to the stack: it is one machine anyway
                wanted = sum(s.num_cpus * s.replicas for s in self.spec.servers)
                ray.init(
                    address="local",
                    namespace=options.namespace,
                    num_cpus=math.ceil(options.num_cpus if options.num_cpus is not None else max(wanted, 1)),
                    include_dashboard=False,
                    logging_level=logging.WARNING,
                )
            for sig, handler in handlers.items():
                if handler is not None and threading.current_thread() is threading.main_thread():
                    signal.signal(sig, handler)
            self._connected = True
        log.info("connected to ray", extra={"namespace": options.namespace, "nodes": len(_alive_nodes(ray))})
        return ray

    def _registry_address(self, ray: Any) -> str:
        """`host:port` the registry binds on this node: the configured one, or a free port chosen once."""
        if self.spec.registry_bind != "unix":
            return self.spec.registry_bind
        ip = ray.util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind((ip, 0))
            return f"{ip}:{probe.getsockname()[1]}"

    def _strategy(self, ray: Any, node: str | None, slot: int = 0) -> Any:
        """Ray scheduling for a replica: pinned to `node` (an IP or node id), else spread over nodes.

        Ray's own `SPREAD` is best effort: replicas started together may still share a node. So the
        stack's n-th unpinned replica prefers the n-th live node (round robin, softly: a node that is full
        or lacks what the server requests lets it run elsewhere); one server's replicas cover the nodes.
        """
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = _alive_nodes(ray)
        if node is None:
            ordered = sorted(nodes, key=lambda n: (str(n["NodeManagerAddress"]), str(n["NodeID"])))
            if len(ordered) < 2:
                return "SPREAD"
            return NodeAffinitySchedulingStrategy(node_id=ordered[slot % len(ordered)]["NodeID"], soft=True)
        matches = [n["NodeID"] for n in nodes if node in (n["NodeID"], n["NodeManagerAddress"])]
        if len(matches) != 1:
            known = ", ".join(f"{n['NodeManagerAddress']} ({n['NodeID'][:12]}…)" for n in nodes)
            which = "no" if not matches else "more than one"
            raise StartError(f"node {node!r} matches {which} live Ray node (use a node id); nodes: {known}")
        return NodeAffinitySchedulingStrategy(node_id=matches[0], soft=False)

    async def _start_hosts(
        self, ray: Any, instances: list[tuple[ServerSpec, str, Any, str]], config: HostConfig
    ) -> None:
        remote = ray.remote(ServerHost)
        started = []
        for spec, endpoint_id, strategy, actor_name in instances:
            if self._tls is not None:  # each host gets its own server's key, and no other
                config = dataclasses.replace(config, tls=_pem_material(self._tls.servers[spec.name], self._tls.client))
            label = spec.label(endpoint_id)
            resources = {k: v for k, v in spec.resources.items()}
            try:
                actor = remote.options(
                    name=actor_name,
                    namespace=self.spec.ray.namespace,
                    num_cpus=spec.num_cpus,
                    num_gpus=spec.num_gpus,
                    resources=resources or None,
                    scheduling_strategy=strategy,
                    max_restarts=self.spec.ray.max_actor_restarts,
                    max_concurrency=4,
                ).remote(spec, endpoint_id, config)
            except ValueError as exc:  # the name is taken: another stack in this namespace
                raise StartError(
                    f"cannot create {actor_name!r} in Ray namespace {self.spec.ray.namespace!r}: {exc}; is another "
                    "stack running there? stop it, or give this one its own `ray: {namespace: ...}`"
                ) from None
            host = self._hosts[label] = _Host(
                spec, endpoint_id, label, actor, ServerState(label, endpoint_id=endpoint_id)
            )
            started.append(host)
        self.write_state()
        await asyncio.gather(*(self._wait_serving(ray, h) for h in started))

    async def _wait_serving(self, ray: Any, host: _Host) -> None:
        timeout = host.spec.start_timeout + 30  # placement and a worker process come first
        try:
            status = await asyncio.wait_for(_awaitable(host.actor.wait_serving.remote()), timeout)
        except TimeoutError:
            raise StartError(
                f"{host.label} was not serving within {timeout:.0f}s; if it was never placed, the cluster lacks "
                f"what it requests (num_cpus={host.spec.num_cpus}, num_gpus={host.spec.num_gpus}, "
                f"resources={dict(host.spec.resources)}); available: {ray.available_resources()}"
            ) from None
        except ray.exceptions.RayError as exc:  # the server failed (its log tail), or its host died
            cause = getattr(exc, "cause", None)
            raise StartError(str(cause if isinstance(cause, Exception) else exc)) from None
        self._absorb(host, status)
        log.info(
            "server serving",
            extra={"service": host.label, "node": host.state.node, "address": host.state.address},
        )

    async def _watch(self) -> None:
        """Refresh every server's state (and `stack.json`) from its host; a host that does not
        answer is being restarted by Ray."""
        import ray

        while not self._stopping:
            await asyncio.sleep(MONITOR_INTERVAL)
            hosts = list(self._hosts.values())
            replies = await asyncio.gather(
                *(asyncio.wait_for(_awaitable(h.actor.status.remote()), CALL_TIMEOUT) for h in hosts),
                return_exceptions=True,
            )
            for host, reply in zip(hosts, replies, strict=True):
                if isinstance(reply, dict):
                    self._absorb(host, reply)
                elif isinstance(reply, ray.exceptions.RayActorError | ray.exceptions.ActorUnavailableError):
                    if host.state.state != "restarting":
                        log.warning("host actor lost; Ray restarts it", extra={"service": host.label})
                    host.state.state, host.state.last_exit = "restarting", "host actor died"
                elif isinstance(reply, BaseException) and not isinstance(reply, TimeoutError):
                    log.warning("status of %s failed: %r", host.label, reply)
            self.write_state()

    def _absorb(self, host: _Host, status: dict[str, Any]) -> None:
        """Take a host's report; a new host pid means Ray restarted the host (one more restart)."""
        if host.host_pid is not None and status["host_pid"] != host.host_pid:
            host.carried = host.state.restarts + 1
        host.host_pid = status["host_pid"]
        state = host.state
        state.state, state.pid, state.address = status["state"], status["pid"], status["address"]
        state.node, state.restarts = status["node"], host.carried + status["restarts"]
        state.last_exit = status["last_exit"] or state.last_exit

    async def stop(self) -> None:
        """Stop every server gracefully (callers first, the registry last), then the host actors."""
        if self._stopping:
            return
        self._stopping = True
        if self._monitor is not None:
            self._monitor.cancel()
        self.state = "stopping"
        self.write_state()
        others = [h for label, h in self._hosts.items() if label != REGISTRY_NAME]
        await self._stop_hosts(others)
        if REGISTRY_NAME in self._hosts:
            await self._stop_hosts([self._hosts[REGISTRY_NAME]])
        for marker in self._markers.values():
            marker.remove()
        if self._connected:
            import ray

            ray.shutdown()
        (self.run_dir / rundir.REGISTRY_FILE).unlink(missing_ok=True)
        self.state = "stopped"
        self.write_state()
        if self._lock_fd is not None:
            os.close(self._lock_fd)

    async def _stop_hosts(self, hosts: list[_Host]) -> None:
        import ray

        async def one(host: _Host) -> None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(_awaitable(host.actor.stop.remote()), self.spec.grace + 15)
            with contextlib.suppress(Exception):
                ray.kill(host.actor, no_restart=True)
            host.state.state = "stopped"

        await asyncio.gather(*(one(h) for h in hosts))

    # -- state -----------------------------------------------------------------------------------

    def write_state(self) -> None:
        write_stack_state(self.run_dir, "ray", self.state, self.registry_address, self.server_states())

    def server_states(self) -> list[ServerState]:
        return [h.state for h in self._hosts.values()]


def _pem_material(server: TlsFiles, client: TlsFiles) -> dict[str, str]:
    """The files' contents, to travel to a node with the host's config."""
    out = {"server_name": server.server_name or ""}
    for key, path in (
        ("cert", server.cert),
        ("key", server.key),
        ("ca", server.ca),
        ("client_cert", client.cert),
        ("client_key", client.key),
    ):
        out[key] = Path(path).read_text() if path else ""
    return out


def _write_tls(folder: Path, material: dict[str, str]) -> tuple[TlsFiles | None, TlsFiles | None]:
    """Write a host's PEM material into its private folder (mode 0600): (server side, health-check side)."""
    if not material:
        return None, None
    paths = {}
    for key in ("cert", "key", "ca", "client_cert", "client_key"):
        if material.get(key):
            write_private(folder / f"{key}.pem", material[key].encode())
            paths[key] = str(folder / f"{key}.pem")
    name = material.get("server_name") or None
    server = TlsFiles(cert=paths["cert"], key=paths["key"], ca=paths.get("ca"), server_name=name)
    client = TlsFiles(cert=paths.get("client_cert"), key=paths.get("client_key"), ca=paths.get("ca"), server_name=name)
    return server, client


def _alive_nodes(ray: Any) -> list[dict[str, Any]]:
    return [n for n in ray.nodes() if n.get("Alive")]


async def _awaitable(ref: Any) -> Any:
    """An ObjectRef as a coroutine (`asyncio.wait_for` and `gather` want one)."""
    return await ref
