"""`NamedDirectory`: the controller's `gymrpc.control.membership.Directory` over participants
addressed by name alone (in-process stubs, fixed addresses), for tests without a registry."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from gymrpc.errors import NotFound
from gymrpc.v1 import registry_service_pb2 as registry_pb


class NamedDirectory:
    """Each name is one participant without a replica id; subclasses say which names
    (`participant_names`) and how to reach one (`participant`)."""

    def participant_names(self) -> Iterable[str]:
        raise NotImplementedError

    def participant(self, name: str, endpoint_id: str | None = None) -> Any:
        raise NotImplementedError

    async def list_endpoints(self, prefix: str = "") -> Sequence[registry_pb.Endpoint]:
        return [registry_pb.Endpoint(name=n) for n in sorted(self.participant_names()) if n.startswith(prefix)]

    async def resolve_endpoints(self, name: str) -> Sequence[registry_pb.Endpoint]:
        if name not in set(self.participant_names()):
            raise NotFound(f"no participant named {name!r}", metadata={"name": name})
        return [registry_pb.Endpoint(name=name)]

    async def refresh(self, name: str) -> None:
        """Nothing is placed by a directory of names: nothing to forget."""


class StubDirectory(NamedDirectory):
    """A `NamedDirectory` over ready stubs, by name (e.g. `DirectStub`s of in-process servicers)."""

    def __init__(self, stubs: dict[str, Any]) -> None:
        self.stubs = stubs

    def participant_names(self) -> Iterable[str]:
        return self.stubs

    def participant(self, name: str, endpoint_id: str | None = None) -> Any:
        return self.stubs[name]
