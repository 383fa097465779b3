"""Fuzz every request message of every gymrpc service against live server processes.

A registry, a resources server (counter), a model server (scripted counter policy) and an agent
(durable resume off) run as real processes. For every method of every service, hypothesis builds
requests from the method's descriptor (random fields of every type: sizes, UTF-8 from the whole
of Unicode, ids that are valid, too long or path-like, deep or huge JSON, out-of-range integers,
unknown enum values, nested messages, maps) and also sends raw bytes that may not decode. Control
methods get the token. Every answer must be a success or a status other than INTERNAL and UNKNOWN,
errors carry an ErrorInfo of our domain, and no server restarts (same process, alive, healthy).
Checkpoint folders are only ever under the test's own folder or not absolute, so the fuzz writes
nowhere else; a checkpoint the fuzz left open is resumed after each example.

The fast tier runs a few examples per method; `@pytest.mark.slow` runs many more.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gymrpc.errors import DOMAIN
from gymrpc.servers.registry.service import CONTROL_METHODS as REGISTRY_CONTROL
from gymrpc.v1 import (
    agent_service_pb2,
    model_service_pb2,
    participant_service_pb2,
    registry_service_pb2,
    resources_service_pb2,
)
from gymrpc.v1 import participant_service_pb2 as pb
from gymrpc.v1 import participant_service_pb2_grpc as pb_grpc
from tests.security.helpers import CONTROL, ServerProcess, channel, error_info, healthy

FAST_EXAMPLES = 8
SLOW_EXAMPLES = 40  # per method: about five times the fast tier, minutes in CI, not half an hour
CALL_TIMEOUT = 5.0
ENDLESS_TIMEOUT = 0.5
"""`Watch` never ends by itself: each example's stream is cut by this deadline."""
SERVICES = {
    "AgentService": agent_service_pb2,
    "ResourcesService": resources_service_pb2,
    "ModelService": model_service_pb2,
    "ParticipantService": participant_service_pb2,
    "RegistryService": registry_service_pb2,
}
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
NO_ERROR_INFO = {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
"""Codes the client itself may produce (its deadline, its cancel of an endless stream)."""

INTERESTING_STRINGS = [
    "",
    "e1",
    "s1",
    "c1",
    "0",
    "resources/r",
    "model/policy",
    "agent/counter",
    "increment_counter",
    "x" * 10_000,
    "../../etc/passwd",
    "a/b",
    "nul\x00byte",
    "ünïcödé ✓ 𝄞",
    "{}",
    '{"count": 1}',
    "[" * 5000 + "]" * 5000,
    '{"count": ' + "9" * 5000 + "}",
    "NaN",
    "127.0.0.1:1",
    "unix:/nonexistent.sock",
]
INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def strings() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(INTERESTING_STRINGS), st.text(max_size=40), st.text(max_size=2000))


def scalar(field: FieldDescriptor, folder: Path) -> st.SearchStrategy[Any]:
    if field.name == "checkpoint_dir":  # never a real absolute path outside the test's folder
        return st.sampled_from([str(folder / "ckpt"), str(folder / "c1"), str(folder), "relative/dir", "", "/a/../b"])
    kind = field.type
    if kind == FieldDescriptor.TYPE_STRING:
        return strings()
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=300)
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_ENUM:
        return st.integers(-3, 40)
    if kind == FieldDescriptor.TYPE_DOUBLE:
        return st.floats()
    if kind == FieldDescriptor.TYPE_FLOAT:
        return st.floats(width=32)
    low, high = INT_RANGES[kind]
    return st.one_of(st.integers(low, high), st.sampled_from([0, 1, high, max(low, -1)]))


def messages(descriptor: Descriptor, folder: Path, depth: int = 0) -> st.SearchStrategy[Any]:
    """Random messages of `descriptor`: any subset of its fields set, nested up to three levels."""
    cls = message_factory.GetMessageClass(descriptor)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            entry = field.message_type
            if entry.GetOptions().map_entry:
                key = scalar(entry.fields_by_name["key"], folder)
                value_field = entry.fields_by_name["value"]
                if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                    continue
                fields[field.name] = st.dictionaries(key, scalar(value_field, folder), max_size=3)
                continue
            if depth >= 3:
                continue
            inner = messages(entry, folder, depth + 1)
        else:
            inner = scalar(field, folder)
        repeated = field.is_repeated
        fields[field.name] = st.lists(inner, max_size=3) if repeated else inner
    return st.fixed_dictionaries({}, optional=fields).map(lambda values: _build(cls, values))


def _build(cls: Any, values: dict[str, Any]) -> Any:
    message = cls()
    for name, value in values.items():
        field = cls.DESCRIPTOR.fields_by_name[name]
        try:
            if field.is_repeated and field.message_type is not None:
                if field.message_type.GetOptions().map_entry:
                    getattr(message, name).update(value)
                else:
                    getattr(message, name).extend(value)
            elif field.is_repeated:
                getattr(message, name).extend(value)
            elif field.message_type is not None:
                getattr(message, name).CopyFrom(value)
            else:
                setattr(message, name, value)
        except (ValueError, TypeError):  # a value protobuf itself refuses to hold (e.g. a lone surrogate)
            continue
    return message


class Stack:
    """The live servers, their addresses by service, and one event loop the fuzz runs its calls on."""

    def __init__(self, folder: Path) -> None:
        socket = f"unix:{folder}/registry.sock"
        self.registry = ServerProcess(
            "gymrpc.servers.registry", "registry/main", ["--bind", socket], folder / "registry"
        )
        common = ["--registry", socket, "--checkpoint-lease-grace", "2"]
        self.resources = ServerProcess(
            "gymrpc.servers.resources", "resources/r", ["--environment", "counter", *common], folder / "resources"
        )
        self.model = ServerProcess(
            "gymrpc.servers.model", "model/policy", ["--policy", "counter", *common], folder / "model"
        )
        self.agent = ServerProcess(
            "gymrpc.servers.agent",
            "agent/counter",
            ["--resources", "resources/r", "--model", "model/policy", *common],
            folder / "agent",
        )
        self.servers = [self.registry, self.resources, self.model, self.agent]
        self.pids = [s.pid for s in self.servers]
        self.folder = folder
        self.loop = asyncio.new_event_loop()
        self.channels: dict[str, grpc.aio.Channel] = {}

    def targets(self, service: str) -> list[str]:
        return {
            "AgentService": [self.agent.address],
            "ResourcesService": [self.resources.address],
            "ModelService": [self.model.address],
            "ParticipantService": [self.resources.address, self.model.address, self.agent.address],
            "RegistryService": [self.registry.address],
        }[service]

    def channel(self, address: str) -> grpc.aio.Channel:
        if address not in self.channels:
            self.channels[address] = channel(address)
        return self.channels[address]

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    def stop(self) -> None:
        for ch in self.channels.values():
            self.run(ch.close())
        self.loop.close()
        for server in reversed(self.servers):
            server.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = Stack(Path(tmp_path_factory.mktemp("fuzz", numbered=True)))
    yield running
    running.stop()


def methods() -> list[tuple[str, MethodDescriptor]]:
    out = []
    for service, module in SERVICES.items():
        for method in module.DESCRIPTOR.services_by_name[service].methods:
            out.append((service, method))
    return out


METHODS = methods()


async def call(stack: Stack, service: str, method: MethodDescriptor, request: Any, raw: bytes | None) -> None:
    """One call to each server of the service; check what came back."""
    control = service == "ParticipantService" or (service == "RegistryService" and method.name in REGISTRY_CONTROL)
    path = f"/gymrpc.v1.{service}/{method.name}"
    payload = raw if raw is not None else request.SerializeToString()
    for address in stack.targets(service):
        ch = stack.channel(address)
        metadata = CONTROL if control else ()
        failed: grpc.aio.AioRpcError | None = None
        try:
            if method.server_streaming:
                timeout = ENDLESS_TIMEOUT if method.name == "Watch" else CALL_TIMEOUT
                stream = ch.unary_stream(path)(payload, timeout=timeout, metadata=metadata)
                for _ in range(20):  # an endless stream (Watch) is cut by the deadline or here
                    if await stream.read() == grpc.aio.EOF:
                        break
                stream.cancel()
            else:
                await ch.unary_unary(path)(payload, timeout=CALL_TIMEOUT, metadata=metadata)
        except grpc.aio.AioRpcError as error:
            failed = error
        if failed is not None:
            assert failed.code() not in FORBIDDEN, (path, failed.code(), failed.details())
            if failed.code() not in NO_ERROR_INFO:
                assert error_info(failed).domain == DOMAIN, (path, failed.code(), failed.details())
    await _settle(stack)


async def _settle(stack: Stack) -> None:
    """Resume any checkpoint the fuzz opened, so admission is open for the next example."""
    for address in stack.targets("ParticipantService"):
        participant = pb_grpc.ParticipantServiceStub(stack.channel(address))
        status = await participant.GetStatus(pb.GetStatusRequest(), timeout=30, metadata=CONTROL)
        if status.checkpoint_id:
            await participant.Resume(pb.ResumeRequest(checkpoint_id=status.checkpoint_id), timeout=30, metadata=CONTROL)


def fuzz(stack: Stack, service: str, method: MethodDescriptor, examples: int) -> None:
    requests = messages(method.input_type, stack.folder)
    raw = st.one_of(st.none(), st.none(), st.binary(max_size=200))

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(request=requests, raw=raw)
    def run(request: Any, raw: bytes | None) -> None:
        stack.run(call(stack, service, method, request, raw))

    run()
    for server, pid in zip(stack.servers, stack.pids, strict=True):
        assert server.alive(), f"{server.log_path.name}: the server died\n{server.log_path.read_text()[-3000:]}"
        assert server.pid == pid
    assert all(stack.run(healthy(s.address)) for s in stack.servers)


@pytest.mark.parametrize(("service", "method"), METHODS, ids=[f"{s}.{m.name}" for s, m in METHODS])
def test_fuzz(stack: Stack, service: str, method: MethodDescriptor) -> None:
    fuzz(stack, service, method, FAST_EXAMPLES)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize(("service", "method"), METHODS, ids=[f"{s}.{m.name}" for s, m in METHODS])
def test_fuzz_slow(stack: Stack, service: str, method: MethodDescriptor) -> None:
    fuzz(stack, service, method, SLOW_EXAMPLES)


def test_the_fuzz_covers_every_method() -> None:
    covered = {(s, m.name) for s, m in METHODS}
    assert len(covered) == sum(len(m.DESCRIPTOR.services_by_name[s].methods) for s, m in SERVICES.items())
    assert json.dumps(sorted(covered))  # every service of the protocol is listed in SERVICES
    listed = {s.name for m in SERVICES.values() for s in m.DESCRIPTOR.services_by_name.values()}
    assert listed == set(SERVICES)
