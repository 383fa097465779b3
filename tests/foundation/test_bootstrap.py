"""The shared server bootstrap: token on control calls, reflection, health, graceful stop, rich errors."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import shutil
import signal
import sys
import time

import grpc
import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

import gymrpc
from gymrpc import errors
from gymrpc.channels import insecure_channel, service_channel_options
from gymrpc.servers.bootstrap import ServerConfig, ServiceBinding, start_server
from gymrpc.servers.registry.service import CONTROL_METHODS, RegistryServicer
from gymrpc.v1 import common_pb2
from gymrpc.v1 import registry_service_pb2 as reg_pb
from gymrpc.v1 import registry_service_pb2_grpc as reg_grpc
from gymrpc.v1 import resources_service_pb2 as res_pb

TOKEN = "s3cret-token"


async def _registry(token: str = TOKEN):  # type: ignore[no-untyped-def]
    servicer = RegistryServicer()
    binding = ServiceBinding(
        reg_pb.DESCRIPTOR.services_by_name["RegistryService"],
        servicer,
        reg_grpc.add_RegistryServiceServicer_to_server,
        CONTROL_METHODS,
    )
    return await start_server(ServerConfig(name="registry/test", token=token, grace=0.5), [binding])


def _register_request() -> reg_pb.RegisterRequest:
    return reg_pb.RegisterRequest(name="agent/simple", address="127.0.0.1:1234")


@pytest.mark.parametrize(
    ("metadata", "why"),
    [((), "missing"), ((("authorization", "Bearer wrong"),), "wrong"), ((("authorization", TOKEN),), "wrong")],
)
def test_control_calls_without_the_right_token_are_unauthenticated(metadata, why) -> None:  # type: ignore[no-untyped-def]
    async def scenario() -> grpc.aio.AioRpcError:
        server = await _registry()
        try:
            async with insecure_channel(server.address, service_channel_options()) as channel:
                stub = reg_grpc.RegistryServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Register(_register_request(), metadata=metadata, timeout=5)
                # nothing changed: the name is still unknown
                listed = await stub.ListEndpoints(reg_pb.ListEndpointsRequest(), timeout=5)
                assert not listed.endpoints
                return info.value
        finally:
            await server.stop()

    exc = asyncio.run(scenario())
    assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
    err = errors.from_rpc_error(exc)
    assert err.reason == "UNAUTHENTICATED"
    assert f"the token was {why}" in err.message


def test_control_call_with_the_token_succeeds_and_open_calls_need_none() -> None:
    async def scenario() -> list[str]:
        server = await _registry()
        try:
            async with insecure_channel(server.address, service_channel_options()) as channel:
                stub = reg_grpc.RegistryServiceStub(channel)
                await stub.Register(_register_request(), metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=5)
                reply = await stub.Resolve(reg_pb.ResolveRequest(name="agent/simple"), timeout=5)
                return [e.address for e in reply.endpoints]
        finally:
            await server.stop()

    assert asyncio.run(scenario()) == ["127.0.0.1:1234"]


def test_a_server_with_control_methods_refuses_to_start_without_a_token() -> None:
    with pytest.raises(ValueError, match="needs a token"):
        asyncio.run(_registry(token=""))


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (reg_pb.RegisterRequest(name="Agent/Simple", address="127.0.0.1:1"), "name"),
        (reg_pb.RegisterRequest(name="agent", address="127.0.0.1:1"), "name"),
        (reg_pb.RegisterRequest(name="agent/simple", address="no-port"), "address"),
        (reg_pb.RegisterRequest(name="agent/simple", address="127.0.0.1:1", endpoint_id="../x"), "endpoint_id"),
    ],
)
def test_bad_registration_is_invalid_argument_naming_the_field(request_, field) -> None:  # type: ignore[no-untyped-def]
    async def scenario() -> errors.GymrpcError:
        server = await _registry()
        try:
            async with insecure_channel(server.address, service_channel_options()) as channel:
                stub = reg_grpc.RegistryServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Register(request_, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=5)
                assert not (await stub.ListEndpoints(reg_pb.ListEndpointsRequest(), timeout=5)).endpoints
                return errors.from_rpc_error(info.value)
        finally:
            await server.stop()

    err = asyncio.run(scenario())
    assert isinstance(err, errors.InvalidArgument)
    assert err.metadata["field"] == field
    assert field in err.message


def test_reflection_lists_services_and_drives_health_without_proto_files() -> None:
    async def scenario() -> tuple[list[str], str]:
        server = await _registry()
        try:
            return await asyncio.to_thread(_reflect, server.address)
        finally:
            await server.stop()

    services, status = asyncio.run(scenario())
    assert "gymrpc.v1.RegistryService" in services
    assert "grpc.health.v1.Health" in services
    assert "grpc.reflection.v1alpha.ServerReflection" in services
    assert status == "SERVING"


def _reflect(address: str) -> tuple[list[str], str]:
    """Discover the health service's types through reflection alone, then call it dynamically."""
    with grpc.insecure_channel(address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = list(database.get_services())
        pool = descriptor_pool.DescriptorPool(database)
        method = pool.FindServiceByName("grpc.health.v1.Health").FindMethodByName("Check")
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        call = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=request_cls.SerializeToString,
            response_deserializer=response_cls.FromString,
        )
        reply = call(request_cls(), timeout=5)
        return services, json_format.MessageToDict(reply)["status"]


@pytest.mark.grpcurl
def test_grpcurl_lists_describes_and_calls_through_reflection() -> None:
    grpcurl = shutil.which("grpcurl") or shutil.which("grpcurl", path=os.path.dirname(sys.executable))
    if grpcurl is None:
        pytest.skip("grpcurl is not installed (scripts/venv.sh installs it on x86-64 only)")

    async def scenario() -> list[str]:
        server = await _registry()
        try:
            base = [grpcurl, "-plaintext"]
            listed = await _run([*base, server.address, "list"])
            described = await _run([*base, server.address, "describe", "gymrpc.v1.RegistryService"])
            registered = await _run(
                [
                    *base,
                    "-H",
                    f"authorization: Bearer {TOKEN}",
                    "-d",
                    '{"name": "agent/simple", "address": "127.0.0.1:9"}',
                    server.address,
                    "gymrpc.v1.RegistryService/Register",
                ]
            )
            denied = await _run(
                [*base, "-d", '{"lease_id": "x"}', server.address, "gymrpc.v1.RegistryService/Deregister"], check=False
            )
            return [listed, described, registered, denied]
        finally:
            await server.stop()

    listed, described, registered, denied = asyncio.run(scenario())
    assert "gymrpc.v1.RegistryService" in listed.split()
    assert "rpc Resolve" in described
    assert json.loads(registered)["endpoint"]["address"] == "127.0.0.1:9"
    assert "Unauthenticated" in denied


async def _run(argv: list[str], *, check: bool = True) -> str:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    if check and proc.returncode != 0:
        raise AssertionError(f"{argv} failed: {out.decode()}")
    return out.decode()


def test_errors_cross_the_wire_with_reason_metadata_and_retry_info() -> None:
    err = errors.Aborted("held", reason="LEASE_HELD", metadata={"rollout_id": "r1"}, retry_delay=1.5)

    class Fake(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return status.code

        def details(self) -> str:
            return status.details

        def trailing_metadata(self):  # type: ignore[no-untyped-def]
            return status.trailing_metadata

    status = err.to_status()
    back = errors.from_rpc_error(Fake())
    assert type(back) is errors.Aborted
    assert (back.reason, back.metadata, back.retry_delay, back.message) == (
        "LEASE_HELD",
        {"rollout_id": "r1"},
        1.5,
        "held",
    )
    again = pickle.loads(pickle.dumps(back))
    assert (type(again), again.reason, again.metadata, again.retry_delay) == (
        errors.Aborted,
        "LEASE_HELD",
        {"rollout_id": "r1"},
        1.5,
    )


SLOW = {
    "lease_ttl": 30,
    "grace": 10,
    "restart": {"max_restarts": 0},
    "servers": [
        {
            "name": "resources/slow",
            "role": "resources",
            "args": {"environment": "tests.foundation.slow_env:SlowEnvironment"},
        }
    ],
}


def test_sigterm_drains_in_flight_calls_goes_not_serving_and_deregisters(start_stack) -> None:  # type: ignore[no-untyped-def]
    stack = start_stack(SLOW)
    server = stack.server("resources/slow")

    async def scenario() -> tuple[res_pb.CallToolResponse, list[str], errors.NotFound, float]:
        async with gymrpc.Client(run_dir=stack.run_dir) as client:
            slow = client.resources("resources/slow")
            episode = common_pb2.EpisodeId(rollout_id="r1")
            await slow.SeedSession(
                res_pb.SeedSessionRequest(session_id="s1", episode_id=episode, task=common_pb2.Task())
            )
            call = res_pb.CallToolRequest(
                session_id="s1",
                episode_id=episode,
                call=common_pb2.ToolCall(id="c1", name="sleep", arguments_json='{"seconds": 2}'),
            )
            # a health watcher (what load balancers use) sees the server leave before it stops
            async with insecure_channel(server["address"], service_channel_options()) as channel:
                watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
                first = await watch.read()
                in_flight = asyncio.ensure_future(slow.CallTool(call, timeout=30))
                await asyncio.sleep(0.5)
                os.kill(server["pid"], signal.SIGTERM)
                started = time.monotonic()
                second = await watch.read()
                health = [health_pb2.HealthCheckResponse.ServingStatus.Name(r.status) for r in (first, second)]
            with pytest.raises(errors.NotFound) as gone:
                await client.registry.resolve("resources/slow")
            return await in_flight, health, gone.value, time.monotonic() - started

    result, health, gone, elapsed = asyncio.run(scenario())
    assert result.output == "done"
    assert not result.is_error
    assert health == ["SERVING", "NOT_SERVING"]
    assert gone.reason == "LEASE_EXPIRED"  # the name is gone long before its 30 s lease could run out
    assert elapsed < 15
    exited = stack.wait_for("resources/slow", lambda s: s["state"] == "failed")
    assert exited["last_exit"] == "code 0"


def test_watch_streams_existing_endpoints_then_changes() -> None:
    async def scenario() -> list[str]:
        server = await _registry()
        md = (("authorization", f"Bearer {TOKEN}"),)
        try:
            async with insecure_channel(server.address, service_channel_options()) as channel:
                stub = reg_grpc.RegistryServiceStub(channel)
                await stub.Register(reg_pb.RegisterRequest(name="agent/a", address="127.0.0.1:1"), metadata=md)
                watch = stub.Watch(reg_pb.WatchRequest(name_prefix="agent/"), timeout=10)
                events = [await watch.read()]
                second = await stub.Register(reg_pb.RegisterRequest(name="agent/b", address="127.0.0.1:2"), metadata=md)
                await stub.Register(reg_pb.RegisterRequest(name="model/x", address="127.0.0.1:3"), metadata=md)
                await stub.Deregister(reg_pb.DeregisterRequest(lease_id=second.endpoint.lease_id), metadata=md)
                events += [await watch.read(), await watch.read()]
                watch.cancel()
                return [f"{reg_pb.WatchEventType.Name(e.type)}:{e.endpoint.name}" for e in events]
        finally:
            await server.stop()

    assert asyncio.run(scenario()) == [
        "WATCH_EVENT_TYPE_EXISTING:agent/a",
        "WATCH_EVENT_TYPE_ADDED:agent/b",
        "WATCH_EVENT_TYPE_REMOVED:agent/b",
    ]
