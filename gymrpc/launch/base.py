"""The launcher interface: what `gymrpc up` needs from anything that places servers.

A launcher starts the registry and every server of a `StackSpec`, keeps them alive
(restarting the dead under the same names), reports their state, and stops them.
The local launcher runs processes on this machine; a cluster launcher (Ray) places
the same servers on several machines with the same names and registry protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class ServerState:
    """What `gymrpc status` shows of one server."""

    name: str
    state: str = "starting"  # starting | serving | restarting | failed | stopped
    pid: int | None = None
    address: str | None = None
    restarts: int = 0
    last_exit: str | None = None
    endpoint_id: str = "0"
    """Which replica of the name this is (`name` is `service#id` when a name has several)."""
    node: str | None = None
    """Where the process runs (Ray: the node's IP; local: unset)."""
    backoff_s: float | None = None
    """The pause before the latest restart (a crash loop grows it); `gymrpc status` shows it while restarting."""


class Launcher(Protocol):
    """Places, supervises and stops the servers of one stack."""

    registry_address: str
    """Where the stack's registry listens; written to the run folder for clients."""

    async def start(self) -> None:
        """Start the registry, then every server; return once all report SERVING."""

    async def stop(self) -> None:
        """Stop every server gracefully, callers first and the registry last."""

    def server_states(self) -> list[ServerState]:
        """Current state of every server, the registry included."""
