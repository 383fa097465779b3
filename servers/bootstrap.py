"""The one way every gymrpc server starts, registers, serves and stops.

`start_server` binds (port 0, a fixed port, or a unix socket guarded by a lock
file; TLS with `--tls-*`, plaintext beyond loopback only with `--insecure`), adds
health and reflection, checks data-plane credentials (`gymrpc.servers.credentials`), wraps
every servicer with the control-token check and error mapping (`gymrpc.servers.guard`), and
registers the address it actually got under its stable name. `serve` runs until
SIGTERM/SIGINT and then stops gracefully: deregister, health NOT_SERVING, drain
in-flight calls for `grace` seconds, run the role's own teardown.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import gc
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gymrpc import auth, logs, tracing
from gymrpc.channels import server_options
from gymrpc.errors import NotFound, Unavailable
from gymrpc.ids import check_endpoint_id, check_service_name
from gymrpc.registry import NameLease, RegistryClient
from gymrpc.rundir import write_text_atomic
from gymrpc.servers.credentials import DataPlaneCredentials
from gymrpc.servers.guard import DEFAULT_MAX_INFLIGHT_CALLS, Admission, SafeDecoding, guard_servicer
from gymrpc.servers.metrics import ServerMetrics
from gymrpc.tls import TlsFiles, is_loopback_bind

log = logging.getLogger(__name__)

EVENT_LOOPS = ("auto", "uvloop", "asyncio")


@dataclass(frozen=True)
class ServiceBinding:
    """One service to serve: its descriptor, implementation and generated `add_*_to_server`."""

    descriptor: ServiceDescriptor
    servicer: object
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    control_methods: Sequence[str] = ()
    """Methods that need the bearer token."""


@dataclass(frozen=True)
class ServerConfig:
    """How a server binds, names itself and stops."""

    name: str
    """Stable name `role/instance` registered with the registry."""
    bind: str = "127.0.0.1:0"
    """`host:port` (port 0 picks a free one) or `unix:/abs/path`."""
    registry: str | None = None
    """Registry target; None serves without registering (the registry itself, tests)."""
    token: str | None = None
    """Bearer token for control methods; required when any service has them."""
    endpoint_id: str = "0"
    """Replica id behind the name."""
    lease_ttl: float = 10.0
    grace: float = 5.0
    """Seconds in-flight calls get to finish on stop."""
    ready_file: Path | None = None
    """Written (atomically) with the bound address once serving."""
    labels: dict[str, str] = field(default_factory=dict)
    max_inflight_calls: int = DEFAULT_MAX_INFLIGHT_CALLS
    """Calls run at once; more wait in gRPC's queue only until admitted, then get OVERLOADED."""
    tls: TlsFiles | None = None
    """Certificate and key to serve TLS with; with a CA, clients must present a certificate it
    signed (mTLS). The same files are the server's client side when it calls the registry."""
    insecure: bool = False
    """Allow plaintext on a non-loopback address (refused otherwise: docs/security.md)."""
    data_plane_credentials: bool = True
    """With a token, data-plane calls need the stack token or an admitted role token
    (`gymrpc.servers.credentials`); False opens the data plane (benchmarks)."""
    metrics_port: int | None = None
    """Serve Prometheus metrics over HTTP on this port of the bind host (0: a free one); None: off."""
    lease_file: Path | None = None
    """Keeps the registry lease id across restarts, so a restarted server replaces its own entry."""
    depends_on: tuple[str, ...] = ()
    """Stable names this server calls: it registers and reports SERVING only once each resolves,
    so a client that sees it ready never gets NOT_FOUND for them (the agent's resources and model)."""


class RunningServer:
    """A started server: its bound address, health, and name lease; `stop` is idempotent."""

    def __init__(
        self,
        server: grpc.aio.Server,
        address: str,
        health_servicer: health.aio.HealthServicer,
        lease: NameLease | None,
        registry: RegistryClient | None,
        grace: float,
        lock_fd: int | None,
        admission: Admission | None = None,
        metrics: ServerMetrics | None = None,
        metrics_url: str | None = None,
    ) -> None:
        self.server, self.address, self.health = server, address, health_servicer
        self.lease, self.registry = lease, registry
        """Its name lease and registry client (None without a registry)."""
        self._grace, self._lock_fd = grace, lock_fd
        self._stopped: asyncio.Task[None] | None = None
        self.admission = admission
        """The server's in-flight call count and limit."""
        self.metrics, self.metrics_url = metrics, metrics_url
        """Its metrics and where they are served (None when off)."""

    async def stop(self, grace: float | None = None) -> None:
        if self._stopped is None:
            self._stopped = asyncio.get_running_loop().create_task(self._stop(self._grace if grace is None else grace))
        await asyncio.shield(self._stopped)

    async def _stop(self, grace: float) -> None:
        log.info("stopping", extra={"address": self.address, "grace_s": grace})
        if self.lease is not None:
            await self.lease.close()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self.registry is not None:
            await self.registry.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
        if self.metrics is not None:
            self.metrics.close()
        log.info("stopped", extra={"address": self.address})


def _bind(server: grpc.aio.Server, bind: str, tls: TlsFiles | None) -> tuple[str, int | None]:
    """Bind and return (address to advertise, lock fd for a unix socket)."""
    credentials = tls.server_credentials() if tls is not None else None

    def add_port(address: str) -> int:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)

    if bind.startswith("unix:"):
        path = Path(bind.removeprefix("unix:").removeprefix("//"))
        # Two servers on one path: the second would silently steal it. A lock file prevents that.
        lock_fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            raise RuntimeError(f"another live server holds {path}; refusing to take over its socket") from None
        path.unlink(missing_ok=True)  # left behind by a killed predecessor
        add_port(f"unix:{path}")
        return f"unix:{path}", lock_fd
    host, _, _ = bind.rpartition(":")
    port = add_port(bind)
    if port == 0:
        raise RuntimeError(f"could not bind {bind}")
    return f"{advertised_host(host)}:{port}", None


WILDCARDS = ("", "0.0.0.0", "[::]", "::")


def advertised_host(host: str) -> str:
    """The host to register for a bind: the host itself, or for a wildcard this machine's address.

    A wildcard listens on every interface, so the server is reachable from the network: say so,
    and advertise an address other machines can use rather than a loopback one that hides it.
    """
    if host not in WILDCARDS:
        return host
    address = node_address()
    log.warning(
        "listening on every interface (%s): anyone who can reach this machine can call this server; "
        "advertising %s. Bind 127.0.0.1 (or a unix socket) unless it must be reachable from other hosts",
        host or "*",
        address,
        extra={"bind": host or "*", "advertised": address},
    )
    return address


def node_address() -> str:
    """This machine's primary IPv4 address (the source of its default route), else 127.0.0.1."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: picks the outgoing interface, sends nothing
        address = probe.getsockname()[0]
        if address and not address.startswith("0."):
            return str(address)
    with contextlib.suppress(OSError):
        return socket.gethostbyname(socket.gethostname())
    return "127.0.0.1"


class TransportRefused(RuntimeError):
    """The server would serve plaintext where the network can see it."""


def check_transport(config: ServerConfig) -> None:
    """Refuse plaintext beyond loopback: tokens and sessions would cross the network in clear."""
    if config.tls is not None or config.insecure or is_loopback_bind(config.bind):
        return
    raise TransportRefused(
        f"{config.name}: refusing to serve plaintext on {config.bind}, a non-loopback address: the bearer "
        "token and every request would cross the network unencrypted and unauthenticated. Serve TLS "
        "(--tls-cert/--tls-key/--tls-ca, or `gymrpc up --tls`), bind 127.0.0.1 or a unix socket, or pass "
        "--insecure to accept the risk (docs/security.md)"
    )


async def start_server(config: ServerConfig, bindings: Sequence[ServiceBinding]) -> RunningServer:
    """Build, bind, start and register a server."""
    check_service_name(config.name)
    check_endpoint_id(config.endpoint_id)
    check_transport(config)
    if any(b.control_methods for b in bindings) and not config.token:
        raise ValueError(f"{config.name}: serving control methods needs a token (--token-file or GYMRPC_TOKEN)")
    tracing.setup_from_env(config.name)  # before the servicers are wrapped: they trace only if it is on
    interceptors = [DataPlaneCredentials(config.token)] if config.token and config.data_plane_credentials else []
    server = grpc.aio.server(options=server_options(), interceptors=interceptors)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    admission = Admission(config.max_inflight_calls)
    metrics = None if config.metrics_port is None else ServerMetrics(config.name)
    for b in bindings:
        guarded = guard_servicer(
            b.servicer,
            b.descriptor,
            token=config.token,
            control_methods=b.control_methods,
            admission=admission,
            metrics=metrics,
        )
        b.add_to_server(guarded, SafeDecoding(server))
    names = [b.descriptor.full_name for b in bindings]
    reflection.enable_server_reflection(
        (*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    address, lock_fd = _bind(server, config.bind, config.tls)
    labels = dict(config.labels)
    metrics_url = None
    if metrics is not None and config.metrics_port is not None:
        metrics_url = metrics.serve(_metrics_host(address), config.metrics_port)
        labels["metrics"] = metrics_url  # clients and `gymrpc top` find the metrics next to the address
    await server.start()
    running = RunningServer(
        server, address, health_servicer, None, None, config.grace, lock_fd, admission, metrics, metrics_url
    )
    try:
        await _announce(running, config, names, labels)
    except BaseException:  # cancelled (a signal while it waited for a name) or the registry refused: unbind
        await running.stop(0)
        raise
    return running


async def _announce(running: RunningServer, config: ServerConfig, names: list[str], labels: dict[str, str]) -> None:
    """Health SERVING once every name it depends on resolves, then the registry lease and the ready file."""
    if config.registry:
        running.registry = RegistryClient(config.registry, token=config.token, tls=config.tls)
        if config.depends_on:
            for service in ("", *names):
                await running.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
            await _await_names(running.registry, config.name, config.depends_on)
    for service in ("", *names):
        await running.health.set(service, health_pb2.HealthCheckResponse.SERVING)
    if running.registry is not None:
        running.lease = NameLease(
            running.registry,
            config.name,
            running.address,
            endpoint_id=config.endpoint_id,
            ttl=config.lease_ttl,
            labels=labels,
            lease_file=config.lease_file,
        )
        await running.lease.start()
    event_loop = running_loop_name()
    if config.ready_file is not None:
        ready = {"address": running.address, "pid": os.getpid(), "name": config.name, "event_loop": event_loop}
        if running.metrics_url is not None:
            ready["metrics"] = running.metrics_url
        write_text_atomic(config.ready_file, json.dumps(ready))
    served = {
        "service": config.name,
        "address": running.address,
        "services": ",".join(names),
        "metrics": running.metrics_url or "off",
        "event_loop": event_loop,
        "gc_young_threshold": gc.get_threshold()[0],
    }
    log.info("serving", extra=served)


def _metrics_host(address: str) -> str:
    """Metrics listen on the host the gRPC server advertises; a unix-socket server uses loopback."""
    return "127.0.0.1" if address.startswith("unix:") else address.rpartition(":")[0].strip("[]")


async def _await_names(registry: RegistryClient, name: str, depends_on: Sequence[str]) -> None:
    """Until every name in `depends_on` resolves (the launcher's start timeout bounds the wait)."""
    for wanted in depends_on:
        delay, said = 0.02, False
        while True:
            try:
                if await registry.resolve(wanted):
                    break
            except (NotFound, Unavailable):
                pass
            if not said:
                log.info("waiting for a name it depends on to register", extra={"service": name, "depends_on": wanted})
                said = True
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)


GC_YOUNG_THRESHOLD = 10_000
"""Net new container objects between young collections (CPython's default: 700). A server's calls keep
objects alive across their awaits, so at 700 a durable agent ran 570 young collections in 3,000 counter
episodes (140 us of CPU per episode in the collector); at 10,000, with the start-up heap frozen, 7 (10 us),
at the same peak memory (bench/README.md, "The collector")."""


def settle_heap() -> None:
    """Freeze what start-up built (modules, descriptors, servicers: never garbage, yet walked by every full
    collection) and collect young objects less often. Called once per server process, before it serves."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


async def serve(
    config: ServerConfig,
    bindings: Sequence[ServiceBinding],
    *,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    on_start: Callable[[RunningServer], None] | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, then stop gracefully and run `on_stop`."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)  # before the ready file: a signal right after it stops gracefully
    watchdog = loop.create_task(_watch_supervisor(stop))
    settle_heap()
    running = await _start_unless_stopped(config, bindings, stop)
    if running is not None:
        if on_start is not None:
            on_start(running)
        await stop.wait()
    watchdog.cancel()
    if running is not None:
        await running.stop()
    if on_stop is not None:
        await on_stop()
    tracing.shutdown()  # the process ends: flush what an OTLP exporter still batches


async def _start_unless_stopped(
    config: ServerConfig, bindings: Sequence[ServiceBinding], stop: asyncio.Event
) -> RunningServer | None:
    """The started server; None when `stop` came first (it waited for a name it depends on: nothing served)."""
    starting = asyncio.ensure_future(start_server(config, bindings))
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if starting.done():
        return starting.result()
    starting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await starting
    return None


async def _watch_supervisor(stop: asyncio.Event) -> None:
    """Stop when the launcher that started us is gone, so a killed launcher leaves no orphans."""
    supervisor = os.environ.get("GYMRPC_SUPERVISOR_PID")
    if not supervisor:
        return
    while True:
        await asyncio.sleep(1.0)
        try:
            os.kill(int(supervisor), 0)
        except ProcessLookupError:
            log.warning("supervisor is gone; stopping", extra={"supervisor_pid": supervisor})
            stop.set()
            return


def add_common_arguments(parser: argparse.ArgumentParser, *, default_name: str) -> None:
    """The flags every server process takes (the launcher passes them)."""
    parser.add_argument("--name", default=default_name, help="stable name role/instance (default %(default)s)")
    parser.add_argument("--bind", default="127.0.0.1:0", help="host:port or unix:/path (default %(default)s)")
    parser.add_argument(
        "--registry",
        default=os.environ.get("GYMRPC_REGISTRY"),
        help="registry target (default $GYMRPC_REGISTRY; none: do not register)",
    )
    parser.add_argument("--token-file", type=Path, help="file holding the control token (else $GYMRPC_TOKEN)")
    parser.add_argument("--endpoint-id", default="0", help="replica id behind the name")
    parser.add_argument("--lease-ttl", type=float, default=10.0, help="registry lease TTL in seconds")
    parser.add_argument("--grace", type=float, default=5.0, help="seconds to drain calls on SIGTERM")
    parser.add_argument("--ready-file", type=Path, help="write the bound address here once serving")
    parser.add_argument(
        "--lease-file",
        type=Path,
        help="keep the registry lease id here (mode 0600): restarted, the server replaces its own entry at once",
    )
    parser.add_argument(
        "--max-inflight-calls",
        type=int,
        default=DEFAULT_MAX_INFLIGHT_CALLS,
        help="calls run at once; beyond, callers get RESOURCE_EXHAUSTED OVERLOADED with a retry delay "
        "(default %(default)s)",
    )
    parser.add_argument("--tls-cert", help="PEM certificate to serve TLS with (with --tls-key)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument(
        "--tls-ca",
        help="PEM CA: clients must present a certificate it signed (mTLS); also verifies the servers this one calls",
    )
    parser.add_argument("--tls-server-name", help="name to check in the certificates of servers this one calls")
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow plaintext on a non-loopback bind (refused otherwise; docs/security.md)",
    )
    parser.add_argument(
        "--no-data-plane-credentials",
        dest="data_plane_credentials",
        action="store_false",
        help="let data-plane calls in without a token (benchmarks only; docs/security.md)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this HTTP port of the bind host (0: a free port; default: off)",
    )
    parser.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default=os.environ.get("GYMRPC_EVENT_LOOP", "auto"),
        help="auto: uvloop where installed, else asyncio's (default $GYMRPC_EVENT_LOOP or %(default)s)",
    )
    parser.add_argument("--log-level", default=None)


def config_from_arguments(args: argparse.Namespace) -> ServerConfig:
    token = auth.read_token_file(args.token_file) if args.token_file else os.environ.get("GYMRPC_TOKEN")
    return ServerConfig(
        name=args.name,
        bind=args.bind,
        registry=args.registry,
        token=token,
        endpoint_id=args.endpoint_id,
        lease_ttl=args.lease_ttl,
        grace=args.grace,
        ready_file=args.ready_file,
        max_inflight_calls=args.max_inflight_calls,
        tls=tls_from_arguments(args),
        insecure=args.insecure,
        data_plane_credentials=args.data_plane_credentials,
        metrics_port=args.metrics_port,
        lease_file=args.lease_file,
    )


def tls_from_arguments(args: argparse.Namespace) -> TlsFiles | None:
    """The `--tls-*` flags as `TlsFiles`; None for plaintext."""
    if not (args.tls_cert or args.tls_key or args.tls_ca):
        return None
    if not (args.tls_cert and args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together (--tls-ca alone is not enough to serve TLS)")
    return TlsFiles(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca, server_name=args.tls_server_name)


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop a server runs on; None for asyncio's own.

    "auto" is uvloop where it is installed (a dependency on Linux and macOS): it takes 6-7 % off a
    stack's CPU per episode and about 14 % off a resources server's per call (bench/README.md)."""
    if choice not in EVENT_LOOPS:
        raise ValueError(f"event loop {choice!r} is not one of {', '.join(EVENT_LOOPS)}")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ValueError("--event-loop uvloop: uvloop is not installed (pip install uvloop)") from None
        return None
    return uvloop.new_event_loop


def running_loop_name() -> str:
    """The loop running: uvloop or asyncio (the ready file and the serving log say which)."""
    return type(asyncio.get_running_loop()).__module__.partition(".")[0]


def run(component: str, main: Callable[[], Awaitable[None]], args: argparse.Namespace) -> None:
    """Process entry point shared by every server's `__main__`; `args` from `add_common_arguments`
    (its log level and event loop)."""
    logs.configure(component, args.log_level)
    try:
        factory = loop_factory(args.event_loop)
    except ValueError as exc:
        print(f"{component}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    try:
        with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=factory) as runner:
            runner.run(main())
    except TransportRefused as exc:
        log.error("%s", exc)
        print(f"{component}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
