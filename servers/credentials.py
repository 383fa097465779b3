"""Data-plane credentials: a server interceptor that lets a data-plane call in only with a token.

Control calls (ParticipantService, the registry's writes) are checked by `gymrpc.servers.guard`
against the stack token alone. Data-plane services take the stack token or the token of
a role allowed to call them (`gymrpc.auth.role_token`): agents may call resources and
model servers, trainers may call agents. A missing or unknown token is UNAUTHENTICATED;
a valid token of a role the service does not admit is PERMISSION_DENIED ROLE_NOT_ALLOWED.
Health and reflection stay open (they reveal nothing a port scan does not).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Mapping

import grpc

from gymrpc import auth
from gymrpc.errors import GymrpcError, PermissionDenied, Unauthenticated

DATA_PLANE_ROLES: Mapping[str, frozenset[str]] = {
    "gymrpc.v1.AgentService": frozenset({"trainer"}),
    "gymrpc.v1.ResourcesService": frozenset({"agent"}),
    "gymrpc.v1.ModelService": frozenset({"agent"}),
}
"""Data-plane service -> the roles whose tokens may call it (the stack token always may)."""

_STACK = "stack"


class DataPlaneCredentials(grpc.aio.ServerInterceptor):
    """Refuse data-plane calls without an admitted credential, before the servicer sees them."""

    def __init__(self, stack_token: str, services: Mapping[str, frozenset[str]] = DATA_PLANE_ROLES) -> None:
        self._tokens = {_STACK: stack_token.encode()} | {
            role: auth.role_token(stack_token, role).encode() for role in auth.ROLES
        }
        self._services = dict(services)

    def caller_role(self, presented: str | None) -> str | None:
        """The role of a presented `Bearer` value (`stack` for the stack token), None when none matches."""
        if presented is None or not presented.startswith(auth.SCHEME):
            return None
        token = presented[len(auth.SCHEME) :].encode()
        role = None
        for name, expected in self._tokens.items():  # every comparison runs: constant time in the match
            if hmac.compare_digest(token, expected):
                role = name
        return role

    def refusal(self, method: str, presented: str | None) -> GymrpcError | None:
        """Why `method` may not run with `presented`, or None when it may."""
        service = method[1:].partition("/")[0]
        admitted = self._services.get(service)
        if admitted is None:
            return None
        role = self.caller_role(presented)
        if role == _STACK or role in admitted:
            return None
        if role is None:
            why = "missing" if presented is None else "not a token of this stack"
            return Unauthenticated(
                f"{method} is a data-plane call and needs 'authorization: Bearer <token>' metadata (the stack "
                f"token or a role token: {', '.join(sorted(admitted))}); the credential was {why}",
                metadata={"method": method},
            )
        return PermissionDenied(
            f"{method}: a {role} token may not call {service}; it admits the stack token and "
            f"{', '.join(sorted(admitted))} tokens",
            reason="ROLE_NOT_ALLOWED",
            metadata={"method": method, "role": role},
        )

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        err = self.refusal(handler_call_details.method, auth.presented_token(handler_call_details.invocation_metadata))
        return handler if err is None else _refusing(handler, err)


def _refusing(handler: grpc.RpcMethodHandler, err: GymrpcError) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that answers with `err` and runs nothing."""
    status = err.to_status()

    async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort_with_status(status)

    kinds = {
        "unary_unary": grpc.unary_unary_rpc_method_handler,
        "unary_stream": grpc.unary_stream_rpc_method_handler,
        "stream_unary": grpc.stream_unary_rpc_method_handler,
        "stream_stream": grpc.stream_stream_rpc_method_handler,
    }
    for attr, make in kinds.items():
        if getattr(handler, attr) is not None:
            return make(
                deny,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    raise TypeError(f"unknown handler kind: {handler!r}")
