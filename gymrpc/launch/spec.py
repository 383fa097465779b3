"""The stack config: a YAML file (or the embedded default) parsed into frozen dataclasses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gymrpc.ids import check_service_name

ROLE_MODULES = {
    "registry": "servers.registry",
    "resources": "servers.resources",
    "agent": "servers.agent",
    "model": "servers.model",
}


@dataclass(frozen=True)
class RestartPolicy:
    """How the supervisor restarts servers that die."""

    max_restarts: int = 5
    """Restarts allowed within `window_seconds`; past that the server is left down (state `failed`)."""
    window_seconds: float = 60.0
    backoff_seconds: float = 0.2
    """Pause before a restart, doubled for each recent restart (at most 5 s)."""


@dataclass(frozen=True)
class ServerSpec:
    """One server process of the stack."""

    name: str
    """Stable name `role/instance`."""
    role: str
    """`resources`, `agent`, `model`, or a module path run with `python -m`."""
    args: Mapping[str, Any] = field(default_factory=dict)
    """Role options, passed as `--key value` flags (`True` as a bare flag)."""
    bind: str = "127.0.0.1:0"
    env: Mapping[str, str] = field(default_factory=dict)
    start_timeout: float = 60.0
    """Seconds a (re)started server has to register and report SERVING."""

    @property
    def module(self) -> str:
        return ROLE_MODULES.get(self.role, self.role)

    def argv(self) -> list[str]:
        out: list[str] = []
        for key, value in self.args.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                out.append(flag)
            elif value is not False and value is not None:
                out += [flag, str(value)]
        return out


@dataclass(frozen=True)
class StackSpec:
    """A whole stack: the registry and the servers that register with it."""

    servers: tuple[ServerSpec, ...]
    registry_bind: str = "unix"
    """`unix` (a socket in the run folder, the default) or a fixed `host:port`."""
    lease_ttl: float = 10.0
    grace: float = 5.0
    restart: RestartPolicy = RestartPolicy()
    launcher: str = "local"


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


def _fail(where: str, message: str) -> ValueError:
    return ValueError(f"stack config {where}: {message}")


def parse_stack_spec(data: Mapping[str, Any], where: str = "<config>") -> StackSpec:
    """Validate a parsed config; every problem names its key."""
    if not isinstance(data, Mapping):
        raise _fail(where, "top level must be a mapping")
    known = {"servers", "registry", "lease_ttl", "grace", "restart", "launcher"}
    if unknown := set(data) - known:
        raise _fail(where, f"unknown keys {sorted(unknown)} (known: {sorted(known)})")
    servers = []
    seen = set()
    for i, raw in enumerate(data.get("servers") or ()):
        if not isinstance(raw, Mapping) or "name" not in raw or "role" not in raw:
            raise _fail(where, f"servers[{i}] needs 'name' and 'role'")
        extra = set(raw) - {"name", "role", "args", "bind", "env", "start_timeout"}
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
            )
        )
    if not servers:
        raise _fail(where, "'servers' must list at least one server")
    registry = data.get("registry") or {}
    restart = data.get("restart") or {}
    try:
        policy = RestartPolicy(**restart)
    except TypeError as exc:
        raise _fail(where, f"restart: {exc}") from None
    launcher = str(data.get("launcher", "local"))
    if launcher != "local":
        raise _fail(where, f"launcher {launcher!r} is not available (only 'local')")
    return StackSpec(
        servers=tuple(servers),
        registry_bind=str(registry.get("bind", "unix")),
        lease_ttl=float(data.get("lease_ttl", 10.0)),
        grace=float(data.get("grace", 5.0)),
        restart=policy,
        launcher=launcher,
    )


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
