"""The stack config: a YAML file (or the embedded default) parsed into frozen dataclasses."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gymrpc.ids import check_service_name

LAUNCHERS = ("local", "ray")
MAX_REPLICAS = 1024

ROLE_MODULES = {
    "registry": "gymrpc.servers.registry",
    "resources": "gymrpc.servers.resources",
    "agent": "gymrpc.servers.agent",
    "model": "gymrpc.servers.model",
}


@dataclass(frozen=True)
class RestartPolicy:
    """How the supervisor restarts servers that die."""

    max_restarts: int | None = None
    """A hard limit: restarts allowed within `window_seconds`, past which the server is left down
    (state `failed`). None (the default): never give up, back off instead (a crash loop)."""
    window_seconds: float = 60.0
    """Restarts this recent count as one crash loop: each doubles the next pause."""
    backoff_seconds: float = 0.2
    """Pause before a restart, doubled for each restart within `window_seconds`, up to `max_backoff_seconds`."""
    max_backoff_seconds: float = 30.0
    """Longest pause between restarts of a server that keeps dying (`gymrpc status` shows it)."""


@dataclass(frozen=True)
class ServerSpec:
    """One server process of the stack."""

    name: str
    """Stable name `role/instance`."""
    role: str
    """`resources`, `agent`, `model`, or a module path run with `python -m`."""
    args: Mapping[str, Any] = field(default_factory=dict)
    """Role options, passed as `--key value` flags; `true`/`false` for switches (`--x` / `--no-x`), lists repeat."""
    bind: str = "127.0.0.1:0"
    env: Mapping[str, str] = field(default_factory=dict)
    start_timeout: float = 60.0
    """Seconds a (re)started server has to register and report SERVING."""
    replicas: int = 1
    """Processes behind the one name, endpoint ids `0`..`replicas-1`; clients balance sessions over them."""
    num_cpus: float = 1.0
    """Ray: CPUs each replica reserves (a placement request, as for any Ray actor); local: ignored."""
    num_gpus: float = 0.0
    """Ray: GPUs each replica reserves (the model server); local: ignored."""
    resources: Mapping[str, float] = field(default_factory=dict)
    """Ray: custom resources each replica needs, e.g. `{worker: 1}`; local: ignored."""
    node: str | None = None
    """Ray: the only node the replicas may run on (its IP or hex node id); unset spreads them; local: ignored."""

    @property
    def module(self) -> str:
        return ROLE_MODULES.get(self.role, self.role)

    def endpoint_ids(self) -> list[str]:
        return [str(i) for i in range(self.replicas)]

    def label(self, endpoint_id: str) -> str:
        """How `gymrpc status` and log file names tell replicas apart: `name`, or `name#id` with replicas."""
        return self.name if self.replicas == 1 else f"{self.name}#{endpoint_id}"

    def argv(self) -> list[str]:
        """`args` as flags, checked against the role's own options (`gymrpc.launch.options`)."""
        from gymrpc.launch.options import server_argv

        return server_argv(self.name, self.module, self.args)


@dataclass(frozen=True)
class RayOptions:
    """Where the Ray launcher finds its cluster (`ray:` in the config)."""

    address: str | None = None
    """`auto` (the cluster this machine belongs to), `host:port` of a head node, or unset: a private
    local Ray instance that lives as long as `gymrpc up`."""
    namespace: str = "gymrpc"
    """Ray namespace of the stack's actors; clients inside Ray jobs find the registry in it."""
    num_cpus: float | None = None
    """CPUs of the private local instance (default: what the servers request)."""
    max_actor_restarts: int = -1
    """Times Ray restarts a server's host actor after its process or node died (-1: always)."""
    log_dir: str | None = None
    """Folder for server logs on each node (default: `gymrpc-<namespace>/logs` in the node's temp folder)."""


@dataclass(frozen=True)
class TlsSpec:
    """TLS of a whole stack (`tls:` in the config, or `gymrpc up --tls`).

    `generate: true` makes a private CA and a certificate per server in the run folder; else
    `cert`/`key` (every server's) and `ca` (which signed them and the clients') are given, with
    `client_cert`/`client_key` for the launcher and the run folder's clients. Either way servers
    require client certificates signed by the CA (mTLS).
    """

    generate: bool = False
    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    server_name: str | None = None
    """Name clients check in server certificates instead of the address's host."""


@dataclass(frozen=True)
class StackSpec:
    """A whole stack: the registry and the servers that register with it."""

    servers: tuple[ServerSpec, ...]
    registry_bind: str = "unix"
    """`unix` (a socket in the run folder, the default; on Ray: a free port on the launcher's node) or a
    fixed `host:port`."""
    lease_ttl: float = 10.0
    grace: float = 5.0
    restart: RestartPolicy = RestartPolicy()
    launcher: str = "local"
    ray: RayOptions = RayOptions()
    tls: TlsSpec | None = None
    """None: plaintext, allowed on loopback and unix sockets only (unless `insecure`)."""
    insecure: bool = False
    """Let servers serve plaintext on non-loopback addresses (`--insecure`; docs/security.md)."""
    metrics: bool = False
    """Every server (the registry too) serves Prometheus metrics on a free HTTP port, registered as its
    `metrics` label."""


DEFAULT_STACK = """
# The embedded default stack: what `gymrpc up` and `gymrpc demo` run without a config.
# No GPU, no downloads: the model is scripted (a counter solver, then blackjack replayed
# from the reference's recorded rollouts, standing when a hand outlasts the recording).
servers:
  - {name: resources/counter, role: resources, args: {environment: counter}}
  - {name: resources/blackjack, role: resources, args: {environment: blackjack}}
  - name: model/policy
    role: model
    args: {policy: counter, recorded: "env:blackjack", fallback: "<action>stand</action>"}
  - {name: agent/counter, role: agent, args: {resources: resources/counter, model: model/policy}}
  - {name: agent/blackjack, role: agent, args: {resources: resources/blackjack, model: model/policy}}
"""


def with_vllm_model(
    spec: StackSpec, model_path: str, *, name: str = "model/policy", start_timeout: float = 900.0, **engine: Any
) -> StackSpec:
    """`spec` with server `name` served by vLLM from `model_path` (`python -m gymrpc.servers.model --backend vllm`).

    `engine` adds model-server flags (`dtype`, `tensor_parallel_size`, `max_model_len`,
    `kv_cache_gib`; None drops one). The start timeout covers loading the weights; the agents'
    call timeout (300 s) already covers a restarted engine.
    """
    args = {"backend": "vllm", "model_path": model_path, **{k: v for k, v in engine.items() if v is not None}}
    if not any(s.name == name for s in spec.servers):
        raise ValueError(f"the stack has no server {name!r} to serve with vLLM")
    servers = tuple(
        dataclasses.replace(s, args=args, start_timeout=max(s.start_timeout, start_timeout)) if s.name == name else s
        for s in spec.servers
    )
    return dataclasses.replace(spec, servers=tuple(with_dependency_timeouts(list(servers))))


def with_dependency_timeouts(servers: list[ServerSpec]) -> list[ServerSpec]:
    """A server whose args name another server of the stack (an agent's `resources`, `model`) is
    ready only once those names resolve, so its start timeout also covers theirs."""
    timeouts = {s.name: s.start_timeout for s in servers}
    out = []
    for server in servers:
        named = {v for v in server.args.values() if isinstance(v, str) and v in timeouts and v != server.name}
        extra = max((timeouts[n] for n in named), default=0.0)
        out.append(dataclasses.replace(server, start_timeout=server.start_timeout + extra) if extra else server)
    return out


def _fail(where: str, message: str) -> ValueError:
    return ValueError(f"stack config {where}: {message}")


def parse_stack_spec(data: Mapping[str, Any], where: str = "<config>") -> StackSpec:
    """Validate a parsed config; every problem names its key."""
    if not isinstance(data, Mapping):
        raise _fail(where, "top level must be a mapping")
    known = {"servers", "registry", "lease_ttl", "grace", "restart", "launcher", "ray", "tls", "insecure", "metrics"}
    if unknown := set(data) - known:
        raise _fail(where, f"unknown keys {sorted(unknown)} (known: {sorted(known)})")
    servers = []
    seen = set()
    for i, raw in enumerate(data.get("servers") or ()):
        if not isinstance(raw, Mapping) or "name" not in raw or "role" not in raw:
            raise _fail(where, f"servers[{i}] needs 'name' and 'role'")
        extra = set(raw) - {"name", "role", "args", "bind", "env", "start_timeout", *_PLACEMENT_KEYS}
        if extra:
            raise _fail(where, f"servers[{i}] has unknown keys {sorted(extra)}")
        try:
            check_service_name(str(raw["name"]))
        except Exception as exc:
            raise _fail(where, f"servers[{i}]: {exc}") from None
        if raw["name"] in seen:
            raise _fail(where, f"servers[{i}]: name {raw['name']!r} is used twice")
        seen.add(raw["name"])
        servers.append(
            ServerSpec(
                name=str(raw["name"]),
                role=str(raw["role"]),
                args=dict(raw.get("args") or {}),
                bind=str(raw.get("bind", "127.0.0.1:0")),
                env={k: str(v) for k, v in (raw.get("env") or {}).items()},
                start_timeout=float(raw.get("start_timeout", 60.0)),
                **_placement(raw, f"{where} servers[{i}] ({raw['name']})"),
            )
        )
    if not servers:
        raise _fail(where, "'servers' must list at least one server")
    servers = with_dependency_timeouts(servers)
    registry = data.get("registry") or {}
    restart = data.get("restart") or {}
    try:
        policy = RestartPolicy(**restart)
    except TypeError as exc:
        raise _fail(where, f"restart: {exc}") from None
    if policy.max_restarts is not None and (
        isinstance(policy.max_restarts, bool) or not isinstance(policy.max_restarts, int) or policy.max_restarts < 0
    ):
        raise _fail(where, f"restart: max_restarts must be an integer >= 0 or null, got {policy.max_restarts!r}")
    launcher = str(data.get("launcher", "local"))
    if launcher not in LAUNCHERS:
        raise _fail(where, f"launcher {launcher!r} is not available (only {', '.join(map(repr, LAUNCHERS))})")
    metrics = data.get("metrics", False)
    if not isinstance(metrics, bool):
        raise _fail(where, f"metrics must be true or false, got {metrics!r}")
    if metrics:
        servers = [dataclasses.replace(s, args={"metrics_port": 0, **s.args}) for s in servers]
    return StackSpec(
        metrics=metrics,
        servers=tuple(servers),
        registry_bind=str(registry.get("bind", "unix")),
        lease_ttl=float(data.get("lease_ttl", 10.0)),
        grace=float(data.get("grace", 5.0)),
        restart=policy,
        launcher=launcher,
        ray=_ray_options(data.get("ray"), where),
        tls=_tls_spec(data.get("tls"), where),
        insecure=_flag(data.get("insecure", False), "insecure", where),
    )


def _flag(value: Any, key: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(where, f"{key} must be true or false, got {value!r}")
    return value


def _tls_spec(raw: Any, where: str) -> TlsSpec | None:
    if raw is None or raw is False:
        return None
    if raw is True:
        return TlsSpec(generate=True)
    if not isinstance(raw, Mapping):
        raise _fail(where, "tls: must be true or a mapping (generate, cert, key, ca, client_cert, client_key)")
    try:
        spec = TlsSpec(**{k: v if k == "generate" else str(v) for k, v in raw.items()})
    except TypeError as exc:
        raise _fail(where, f"tls: {exc}") from None
    if spec.generate:
        if any((spec.cert, spec.key, spec.ca, spec.client_cert, spec.client_key)):
            raise _fail(where, "tls: generate makes its own CA and certificates; give no files with it")
        return spec
    missing = [k for k in ("cert", "key", "ca", "client_cert", "client_key") if getattr(spec, k) is None]
    if missing:
        raise _fail(where, f"tls: without generate, give {', '.join(missing)} (or tls: true)")
    return spec


_PLACEMENT_KEYS = ("replicas", "num_cpus", "num_gpus", "resources", "node")


def _placement(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`replicas` and the Ray resource requests of one server, validated."""
    out: dict[str, Any] = {}
    try:
        replicas = raw.get("replicas", 1)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= MAX_REPLICAS:
            raise ValueError(f"replicas must be an integer from 1 to {MAX_REPLICAS}, got {replicas!r}")
        out["replicas"] = replicas
        if replicas > 1 and not str(raw.get("bind", "127.0.0.1:0")).endswith(":0"):
            raise ValueError("replicas share one name, not one address: their bind must end in ':0' (any port)")
        for key in ("num_cpus", "num_gpus"):
            if key in raw:
                out[key] = _amount(raw[key], key)
        if "resources" in raw:
            if not isinstance(raw["resources"], Mapping):
                raise ValueError(f"resources must be a mapping of name to amount, got {raw['resources']!r}")
            out["resources"] = {str(k): _amount(v, f"resources.{k}") for k, v in raw["resources"].items()}
        if raw.get("node") is not None:
            out["node"] = str(raw["node"])
    except ValueError as exc:
        raise _fail(where, str(exc)) from None
    return out


def _amount(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"{key} must be a number >= 0, got {value!r}")
    return float(value)


def _ray_options(raw: Any, where: str) -> RayOptions:
    if raw is None:
        return RayOptions()
    if not isinstance(raw, Mapping):
        raise _fail(where, "ray: must be a mapping (address, namespace, num_cpus, max_actor_restarts, log_dir)")
    try:
        options = RayOptions(**raw)
    except TypeError as exc:
        raise _fail(where, f"ray: {exc}") from None
    if options.address is not None and not isinstance(options.address, str):
        raise _fail(where, f"ray: address must be a string, got {options.address!r}")
    if not isinstance(options.namespace, str) or not options.namespace:
        raise _fail(where, "ray: namespace must be a non-empty string")
    if options.num_cpus is not None:
        try:
            _amount(options.num_cpus, "num_cpus")
        except ValueError as exc:
            raise _fail(where, f"ray: {exc}") from None
    if options.log_dir is not None and not str(options.log_dir).startswith("/"):
        raise _fail(where, f"ray: log_dir must be an absolute path (every node resolves it), got {options.log_dir!r}")
    if isinstance(options.max_actor_restarts, bool) or not isinstance(options.max_actor_restarts, int):
        raise _fail(where, f"ray: max_actor_restarts must be an integer, got {options.max_actor_restarts!r}")
    return options


def load_stack_spec(path: Path | None) -> StackSpec:
    """Read a YAML stack config, or the embedded default when `path` is None."""
    if path is None:
        return parse_stack_spec(yaml.safe_load(DEFAULT_STACK), "<embedded default>")
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"stack config {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"stack config {path} is not valid YAML: {exc}") from None
    return parse_stack_spec(data, str(path))
