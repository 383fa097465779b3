"""Who the controller talks to: `Member` (one replica of a name) and `Directory`, the narrow
interface through which it finds and reaches them.

`gymrpc.Client` is a `Directory` over the registry; `gymrpc.testing.participants.NamedDirectory`
is one over in-process stubs addressed by name, so the controller has no special case for tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gymrpc.control.types import Kind
from gymrpc.v1 import registry_service_pb2 as registry_pb


class Directory(Protocol):
    """What a `Controller` needs of a client: the registered replicas of names, and a stub to each."""

    async def list_endpoints(self, prefix: str = "") -> Sequence[registry_pb.Endpoint]:
        """Every registered replica of every name starting with `prefix`."""
        ...

    async def resolve_endpoints(self, name: str) -> Sequence[registry_pb.Endpoint]:
        """Every registered replica of `name` (NotFound: none)."""
        ...

    def participant(self, name: str, endpoint_id: str | None = None) -> Any:
        """A ParticipantService stub to `name`, to its replica `endpoint_id` when given."""
        ...

    async def refresh(self, name: str) -> None:
        """Forget where `name`'s sessions were placed (after a restore placed them afresh)."""
        ...


@dataclass(frozen=True)
class Member:
    """One replica of a name, addressed directly by its endpoint id; `kind` once `GetStatus` said it."""

    name: str
    kind: Kind | None = None
    """None: registered, not yet asked whether (and what) participant it is."""
    endpoint_id: str | None = None
    """Replica id behind `name`; None: the name itself (a directory without replica ids)."""
    replicas: int = 1
    """Replicas of `name` discovered; with more than one, labels tell them apart."""
    packed_scope: bool = False
    """It reads a Commit's scope in packed form (`GetStatusResponse.accepts_packed_scope`)."""

    @property
    def label(self) -> str:
        """Key of this member in every reply map: `name`, or `name#endpoint_id` when the name has replicas."""
        if self.endpoint_id is None or self.replicas == 1:
            return self.name
        return f"{self.name}#{self.endpoint_id}"

    def of_kind(self, kind: Kind, *, packed_scope: bool = False) -> Member:
        return dataclasses.replace(self, kind=kind, packed_scope=packed_scope)
