"""`gymrpc call`: any method of a running stack, by stable name, JSON in and JSON out.

    gymrpc call agent/counter gymrpc.v1.AgentService/Run @run.json
    gymrpc call resources/counter gymrpc.v1.ParticipantService/GetStatus
    gymrpc call registry gymrpc.v1.RegistryService/ListEndpoints '{"name_prefix": "agent/"}'
    gymrpc call 127.0.0.1:40513 list

The fallback for grpcurl, so that manual control never depends on a binary that may be
missing. It learns every type from the server's reflection service (no `.proto` files, no
generated stubs), so it also reaches methods newer than this client. The target is a
stable name (`role/instance`, resolved through the registry like `gymrpc.Client` does),
`registry` (the run folder's registry), or an address (`host:port`, `unix:/path`). Every
call carries the bearer token from `$GYMRPC_TOKEN` or the run folder. JSON uses the proto field
names, as grpcurl does. A failed call prints its status code, `ErrorInfo` reason and
metadata, and exits with 64 + the code (grpcurl's convention); usage errors exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from gymrpc import auth, rundir
from gymrpc.channels import open_sync_channel, service_channel_options
from gymrpc.errors import GymrpcError, from_rpc_error
from gymrpc.ids import check_service_name
from gymrpc.tls import read_run_dir_tls
from gymrpc.v1 import registry_service_pb2, registry_service_pb2_grpc

"""Control calls outside the control services (which are control calls throughout)."""
REGISTRY = "registry"
EXIT_USAGE = 2
EXIT_NO_STACK = 1
EXIT_RPC = 64


class UsageError(Exception):
    """A mistake in the command line or the JSON; nothing was sent."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help="stable name (agent/counter), 'registry', or an address (host:port, unix:/path)")
    parser.add_argument("method", help="SERVICE/METHOD (full service name), or 'list' to list services or methods")
    parser.add_argument(
        "data",
        nargs="?",
        help="request JSON (default {}); @FILE reads a file, - reads stdin; after 'list': a service name",
    )
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="deadline in seconds; 0 for none (default %(default)s)"
    )
    parser.add_argument("--emit-defaults", action="store_true", help="print fields that hold their default value")


def run(args: argparse.Namespace, run_dir: Path) -> int:
    try:
        label, address = resolve_target(args.target, run_dir)
        with open_sync_channel(address, service_channel_options(), tls=read_run_dir_tls(run_dir)) as channel:
            reflection = Reflection(channel, label)
            if args.method == "list":
                lines = reflection.methods(args.data) if args.data else reflection.services()
                print("\n".join(lines))
                return 0
            method = reflection.method(args.method)
            request = parse_request(method, read_data(args.data or "{}"))
            metadata = auth.metadata(token(run_dir))  # control and data-plane calls both need it
            for reply in invoke(channel, method, request, metadata, args.timeout or None):
                print(to_json(reply, args.emit_defaults), flush=True)  # a stream's replies as they come
        return 0
    except UsageError as exc:
        print(f"gymrpc call: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except FileNotFoundError as exc:
        print(f"gymrpc call: {exc}", file=sys.stderr)
        return EXIT_NO_STACK
    except GymrpcError as exc:
        print(format_error(exc, args.target, args.method), file=sys.stderr)
        return EXIT_RPC + exc.code.value[0]


# -- targets ---------------------------------------------------------------------------------


def registry_address(run_dir: Path) -> str:
    return os.environ.get("GYMRPC_REGISTRY") or rundir.read_registry_address(run_dir)


def resolve_target(target: str, run_dir: Path) -> tuple[str, str]:
    """`(label, address)`: an address as given, or the current address of a name."""
    if ":" in target:
        return target, target
    if target == REGISTRY:
        address = registry_address(run_dir)
        return f"registry ({address})", address
    try:
        check_service_name(target, "target")
    except GymrpcError as exc:
        raise UsageError(f"{exc.message}, 'registry', or an address (host:port, unix:/path)") from None
    with open_sync_channel(registry_address(run_dir), [], tls=read_run_dir_tls(run_dir)) as channel:
        stub = registry_service_pb2_grpc.RegistryServiceStub(channel)
        try:
            reply = stub.Resolve(registry_service_pb2.ResolveRequest(name=target), timeout=10)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
    address = reply.endpoints[0].address
    return f"{target} ({address})", address


def token(run_dir: Path) -> str | None:
    """The control token: `$GYMRPC_TOKEN`, else the run folder's (None when neither exists)."""
    if value := os.environ.get("GYMRPC_TOKEN"):
        return value
    path = run_dir / rundir.TOKEN_FILE
    return auth.read_token_file(path) if path.exists() else None


# -- reflection ------------------------------------------------------------------------------


class Reflection:
    """The services and types a server describes about itself."""

    def __init__(self, channel: grpc.Channel, label: str) -> None:
        self.label = label
        self._database = ProtoReflectionDescriptorDatabase(channel)
        self._pool = descriptor_pool.DescriptorPool(self._database)
        self._services: list[str] | None = None

    def services(self) -> list[str]:
        if self._services is None:
            try:
                self._services = sorted(self._database.get_services())
            except grpc.RpcError as exc:
                raise from_rpc_error(exc) from None
        return self._services

    def methods(self, service: str) -> list[str]:
        descriptor = self._service(service)
        return [
            f"{m.name}({'stream ' if m.client_streaming else ''}{m.input_type.full_name}) returns "
            f"({'stream ' if m.server_streaming else ''}{m.output_type.full_name})"
            for m in descriptor.methods
        ]

    def method(self, full_name: str) -> MethodDescriptor:
        service, sep, name = full_name.lstrip("/").rpartition("/")
        if not sep or not service or not name:
            raise UsageError(f"method {full_name!r} must be SERVICE/METHOD, for example gymrpc.v1.AgentService/Run")
        descriptor = self._service(service)
        method = descriptor.methods_by_name.get(name)
        if method is None:
            known = ", ".join(m.name for m in descriptor.methods)
            raise UsageError(f"{service} has no method {name!r}; it has: {known}")
        return method

    def _service(self, service: str):  # type: ignore[no-untyped-def]
        if service not in self.services():
            raise UsageError(f"{self.label} does not serve {service!r}; it serves: {', '.join(self.services())}")
        return self._pool.FindServiceByName(service)


# -- the call --------------------------------------------------------------------------------


def read_data(data: str) -> str:
    if data == "-":
        return sys.stdin.read()
    if data.startswith("@"):
        try:
            return Path(data[1:]).read_text()
        except OSError as exc:
            raise UsageError(f"cannot read {data[1:]}: {exc.strerror}") from None
    return data


def parse_request(method: MethodDescriptor, text: str) -> Message:
    request = message_factory.GetMessageClass(method.input_type)()
    try:
        json_format.Parse(text or "{}", request)
    except json_format.ParseError as exc:
        raise UsageError(f"request JSON does not fit {method.input_type.full_name}: {exc}") from None
    return request


def invoke(
    channel: grpc.Channel,
    method: MethodDescriptor,
    request: Message,
    metadata: tuple[tuple[str, str], ...],
    timeout: float | None,
) -> Iterator[Message]:
    """The reply (or, for a server stream, each reply as it arrives)."""
    if method.client_streaming:
        raise UsageError(f"{method.full_name} streams requests; gymrpc call sends one request only")
    path = f"/{method.containing_service.full_name}/{method.name}"
    encode = type(request).SerializeToString
    decode = message_factory.GetMessageClass(method.output_type).FromString
    try:
        if method.server_streaming:
            stream = channel.unary_stream(path, request_serializer=encode, response_deserializer=decode)
            yield from stream(request, metadata=metadata, timeout=timeout)
        else:
            unary = channel.unary_unary(path, request_serializer=encode, response_deserializer=decode)
            yield unary(request, metadata=metadata, timeout=timeout)
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None


def to_json(message: Message, emit_defaults: bool) -> str:
    return json_format.MessageToJson(
        message,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=emit_defaults,
        indent=2,
    )


def format_error(exc: GymrpcError, target: str, method: str) -> str:
    lines = [f"gymrpc call: {target} {method} failed: {exc.code.name}", f"  reason: {exc.reason}"]
    lines.append(f"  message: {exc.message}")
    if exc.metadata:
        lines.append(f"  metadata: {json.dumps(exc.metadata, sort_keys=True)}")
    if exc.retry_delay is not None:
        lines.append(f"  retry after: {exc.retry_delay:g} s")
    if exc.code == grpc.StatusCode.UNAUTHENTICATED:
        lines.append("  hint: the token comes from $GYMRPC_TOKEN or the run folder's `token` (see --run-dir)")
    return "\n".join(lines)
