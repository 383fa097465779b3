"""`gymrpc.Client`: reach services by stable name, survive their restarts.

A name (`agent/simple`) is resolved through the registry and cached. When a call
fails with UNAVAILABLE (the server died, or is draining), the client drops the
cached address, resolves again, and retries with full-jitter backoff until the
call's overall deadline. Only methods the protocol marks idempotent are retried,
which in gymrpc.v1 is all of them: every mutating call is de-duplicated by a key
the caller chose.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

from gymrpc import auth, rundir, tracing
from gymrpc.balancing import Balancer, affinity_key
from gymrpc.channels import open_channel, service_channel_options
from gymrpc.errors import DeadlineExceeded, GymrpcError, NotFound, RegistryUnavailable, Unavailable, from_rpc_error
from gymrpc.ids import check_endpoint_id, check_id, check_service_name
from gymrpc.registry import RegistryClient
from gymrpc.retry import RetryPolicy
from gymrpc.tls import TlsFiles, read_run_dir_tls
from gymrpc.v1 import (
    agent_service_pb2,
    agent_service_pb2_grpc,
    common_pb2,
    model_service_pb2,
    model_service_pb2_grpc,
    participant_service_pb2,
    participant_service_pb2_grpc,
    registry_service_pb2,
    resources_service_pb2,
    resources_service_pb2_grpc,
    weights_service_pb2,
    weights_service_pb2_grpc,
)

log = logging.getLogger(__name__)
StubT = TypeVar("StubT")
CONTROL_SERVICES = frozenset({"gymrpc.v1.ParticipantService", "gymrpc.v1.WeightsService"})
"""Services whose every method is a control call; only these get the bearer token."""
RUN_TIMEOUT = 4 * 3600.0
"""Default overall deadline of `Client.run`, retries included: episodes are long (the agent's own
default episode timeout is 1 h), and a run may survive several agent restarts and resumes."""
_BACK_OFF_CODES = (grpc.StatusCode.ABORTED, grpc.StatusCode.RESOURCE_EXHAUSTED)
_RETRYABLE_LEVELS = (descriptor_pb2.MethodOptions.NO_SIDE_EFFECTS, descriptor_pb2.MethodOptions.IDEMPOTENT)


def _is_retryable(err: GymrpcError) -> bool:
    # UNAVAILABLE: the server is gone or draining; ABORTED with RetryInfo: a lease is held;
    # RESOURCE_EXHAUSTED with RetryInfo: the server turned the call away before doing anything.
    return isinstance(err, Unavailable) or (err.code in _BACK_OFF_CODES and err.retry_delay is not None)


class Client:
    """Async client of a gymrpc stack.

    Args:
        registry: registry target (`unix:/path` or `host:port`). Default: `$GYMRPC_REGISTRY`,
            else the address `gymrpc up` wrote into the run folder, else (inside a Ray job) the
            registry of the stack the Ray launcher started (`gymrpc.launch.ray.discover_registry`).
        run_dir: run folder to read the registry address and token from (default
            `$GYMRPC_RUN_DIR` or `./.gymrpc`).
        token: bearer token sent with every call: the stack token (control and data plane) or a
            role token (`gymrpc.auth.role_token`; data plane only). Default: `$GYMRPC_TOKEN`,
            else the run folder's stack token (or the Ray-launched stack's).
        retry: how long calls are retried after UNAVAILABLE (default `RetryPolicy.default`, 60 s).
        tls: CA and client certificate to speak TLS with (`gymrpc.tls.TlsFiles`). Default: the run
            folder's `tls.json`, which `gymrpc up --tls` writes; plaintext without one.

    A name with several replicas is balanced by `balancer` (`gymrpc.balancing`): the calls of one
    session or episode stay on one replica, and move to another only when it fails.

    One `Client` belongs to one event loop; create it inside the loop that uses it.
    It is safe to share between tasks of that loop. Never share it across `fork()`.
    """

    def __init__(
        self,
        registry: str | None = None,
        *,
        run_dir: str | Path | None = None,
        token: str | None = None,
        retry: RetryPolicy = RetryPolicy.default,
        tls: TlsFiles | None = None,
    ) -> None:
        folder = Path(run_dir) if run_dir is not None else rundir.default_run_dir()
        if tls is None:
            tls = read_run_dir_tls(folder)
        self.tls = tls
        target = registry or os.environ.get("GYMRPC_REGISTRY")
        ray_token = None
        if not target:
            try:
                target = rundir.read_registry_address(folder)
            except FileNotFoundError:
                from gymrpc.launch.ray import discover_registry  # imports ray only if the caller already did

                if (found := discover_registry()) is None:
                    raise
                target, ray_token, ray_tls = found
                if self.tls is None:
                    tls = self.tls = ray_tls
        if token is None:
            token = os.environ.get("GYMRPC_TOKEN")
            token_file = folder / rundir.TOKEN_FILE
            if token is None and token_file.exists():
                token = auth.read_token_file(token_file)
            token = token or ray_token
        self.retry = retry
        self.balancer = Balancer()
        self.registry = RegistryClient(target, token=token, tls=tls)
        self._metadata = auth.metadata(token)
        self._addresses: dict[str, str] = {}
        self._known: set[str] = set()  # names resolved at least once: NOT_FOUND then means "restarting"
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[tuple[str, Any], Any] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._resolving: dict[str, asyncio.Future[str]] = {}

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._stubs.clear()
        await self.registry.close()

    # -- typed entry points ---------------------------------------------------------------

    def stub(
        self,
        name: str,
        stub_class: Callable[[grpc.aio.Channel], StubT],
        service: ServiceDescriptor,
        *,
        endpoint_id: str | None = None,
    ) -> StubT:
        """A stub for `service` at the stable `name`; its methods resolve and retry by themselves.

        `endpoint_id` pins every call to that replica of the name (None: the balancer chooses).
        The return value is typed as the generated stub class, so calls are type-checked.
        """
        check_service_name(name)
        if endpoint_id is not None:
            check_endpoint_id(endpoint_id)
        return NamedStub(self, name, stub_class, service, endpoint_id)  # type: ignore[return-value]

    def agent(self, name: str = "agent/simple") -> agent_service_pb2_grpc.AgentServiceStub:
        return self.stub(
            name,
            agent_service_pb2_grpc.AgentServiceStub,
            agent_service_pb2.DESCRIPTOR.services_by_name["AgentService"],
        )

    def resources(self, name: str) -> resources_service_pb2_grpc.ResourcesServiceStub:
        return self.stub(
            name,
            resources_service_pb2_grpc.ResourcesServiceStub,
            resources_service_pb2.DESCRIPTOR.services_by_name["ResourcesService"],
        )

    def model(self, name: str = "model/policy") -> model_service_pb2_grpc.ModelServiceStub:
        return self.stub(
            name,
            model_service_pb2_grpc.ModelServiceStub,
            model_service_pb2.DESCRIPTOR.services_by_name["ModelService"],
        )

    def weights(self, name: str = "model/policy") -> weights_service_pb2_grpc.WeightsServiceStub:
        """Weight updates of the model server `name` (control calls: they carry the token).

        `UploadWeights` streams a request iterator and is not retried here; `gymrpc.weights`
        wraps both ways of updating, with retries.
        """
        return self.stub(
            name,
            weights_service_pb2_grpc.WeightsServiceStub,
            weights_service_pb2.DESCRIPTOR.services_by_name["WeightsService"],
        )

    def participant(
        self, name: str, endpoint_id: str | None = None
    ) -> participant_service_pb2_grpc.ParticipantServiceStub:
        """Control calls to `name`; with `endpoint_id`, to that replica (a controller addresses each)."""
        return self.stub(
            name,
            participant_service_pb2_grpc.ParticipantServiceStub,
            participant_service_pb2.DESCRIPTOR.services_by_name["ParticipantService"],
            endpoint_id=endpoint_id,
        )

    async def run(
        self,
        task: common_pb2.Task,
        *,
        episode_id: str | common_pb2.EpisodeId,
        policy_version: str,
        agent: str = "agent/simple",
        options: agent_service_pb2.RunOptions | None = None,
        timeout: float | None = None,
    ) -> agent_service_pb2.Trajectory:
        """Run one episode to the end and return its trajectory, surviving agent crashes.

        A `Run` that fails with UNAVAILABLE (the agent died or is draining) is sent again,
        with the same episode id, to whatever address the name resolves to next; one that
        fails with ABORTED and a retry delay (another call holds the episode's lease) is
        sent again after that delay. An agent with durable resume on (`--resume-dir`)
        continues the episode from its last checkpoint, or returns the cached result if it
        had completed, so the caller needs no recovery code of its own. Any other error is
        raised as its `gymrpc.errors` class.

        Args:
            task: what the episode is asked to do.
            episode_id: the episode's rollout id (or a full `EpisodeId`); reuse it to retry.
            policy_version: the weights the episode must be generated with.
            agent: the agent's stable name.
            options: per-run options (`max_steps`, `episode_timeout`).
            timeout: overall deadline in seconds, every retry included (default `RUN_TIMEOUT`, 4 h).
        """
        if isinstance(episode_id, str):
            episode_id = common_pb2.EpisodeId(rollout_id=episode_id)
        check_id(episode_id.rollout_id, "episode_id.rollout_id")
        request = agent_service_pb2.RunRequest(
            task=task, episode_id=episode_id, policy_version=policy_version, options=options
        )
        stub: Any = self.agent(agent)
        moved = self.balancer.failovers(agent, episode_id.rollout_id)
        reply = await stub.Run(request, timeout=RUN_TIMEOUT if timeout is None else timeout)
        # The agent counted its own calls' moves; the moves of `Run` itself only this client saw.
        reply.trajectory.failovers += self.balancer.failovers(agent, episode_id.rollout_id) - moved
        return reply.trajectory

    # -- resolution ----------------------------------------------------------------------

    async def resolve(self, name: str, *, fresh: bool = False) -> str:
        """Current address of `name`: cached, or asked of the registry (one request per name at a time)."""
        if not fresh and name in self._addresses:
            return self._addresses[name]
        pending = self._resolving.get(name)
        if pending is None:
            pending = asyncio.get_running_loop().create_future()
            self._resolving[name] = pending
            try:
                endpoints = await self.registry.resolve(name)
                address = endpoints[0].address
                old = self._addresses.get(name)
                self._addresses[name] = address
                self._known.add(name)
                stale = self.balancer.update(name, endpoints)
                if old is not None and old != address:
                    stale.add(old)
                for gone in stale:
                    self._drop_channel(gone)
                pending.set_result(address)
            except BaseException as exc:
                pending.set_exception(exc)
                pending.exception()  # mark retrieved: there may be no concurrent waiter
            finally:
                del self._resolving[name]
        return await asyncio.shield(pending)

    async def list_endpoints(self, prefix: str = "") -> Sequence[registry_service_pb2.Endpoint]:
        """Every registered replica of every name starting with `prefix` (`Controller` discovery)."""
        return await self.registry.list(prefix)

    async def resolve_endpoints(self, name: str) -> Sequence[registry_service_pb2.Endpoint]:
        """Every registered replica of `name`, asked of the registry now (not the cache)."""
        return await self.registry.resolve(name)

    async def refresh(self, name: str) -> None:
        """Forget where `name`'s sessions were placed and resolve its replicas again.

        For after a restore onto the replicas now registered: restored sessions live where
        `gymrpc.balancing.place` puts them among those, which is where new calls then go.
        """
        self.balancer.forget(name)
        await self.resolve(name, fresh=True)

    def stub_at(self, address: str, stub_class: Callable[[grpc.aio.Channel], StubT]) -> StubT:
        """A generated stub on the shared channel to `address`."""
        key = (address, stub_class)
        stub = self._stubs.get(key)
        if stub is None:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = open_channel(address, service_channel_options(), tls=self.tls)
            stub = self._stubs[key] = stub_class(channel)
        return stub

    def _drop_channel(self, address: str) -> None:
        """Close the channel to an address no name maps to any more, letting its calls finish first."""
        if address in self._addresses.values() or address in self.balancer.addresses():
            return
        for key in [k for k in self._stubs if k[0] == address]:
            del self._stubs[key]
        channel = self._channels.pop(address, None)
        if channel is not None:
            task = asyncio.get_running_loop().create_task(channel.close(grace=5.0))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _attempts(
        self, name: str, method: str, timeout: float | None, key: str | None = None, endpoint_id: str | None = None
    ) -> AsyncIterator[tuple[str, float]]:
        """Yield (address, seconds left) per attempt, sleeping and re-resolving in between.

        `key` is the call's session (`gymrpc.balancing.affinity_key`): with replicas it picks the
        one that holds the session, and a replica that failed with UNAVAILABLE is avoided next.
        `endpoint_id` pins the call to one replica instead, waited for while it is not registered
        (restarting); its failures mark nothing down, as no session chose it.

        The caller reports a retryable failure by continuing the loop; anything else ends it.
        """
        policy = self.retry if timeout is None else self.retry.with_deadline(timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + policy.deadline
        delays = policy.delays()
        attempt, last = 0, ""
        stale = False  # the cached address may be wrong: resolve afresh before the next attempt
        registry_down: RegistryUnavailable | None = None
        registry_since = 0.0  # loop time of the first registry failure in a row
        while True:
            left = deadline - loop.time()
            if registry_down is not None and (left <= 0 or loop.time() - registry_since >= policy.registry_grace):
                silent = loop.time() - registry_since
                raise RegistryUnavailable(
                    f"{method} on {name!r}: the registry at {self.registry.target} has not answered for "
                    f"{silent:.1f}s: the stack is gone or unreachable (not one server restarting); "
                    f"last: {registry_down.message}",
                    metadata={"name": name, "method": method, "registry": self.registry.target},
                )
            if left <= 0:
                raise DeadlineExceeded(
                    f"{method} on {name!r} gave up after {attempt} attempts in {policy.deadline:.1f}s: {last}",
                    metadata={"name": name, "method": method, "attempts": str(attempt)},
                )
            try:
                if stale or name not in self._addresses:
                    await asyncio.wait_for(self.resolve(name, fresh=stale), timeout=left)
                if endpoint_id is None:
                    address: str | None = self.balancer.pick(name, key)
                else:
                    address = self.balancer.address_of(name, endpoint_id)
            except NotFound as exc:
                if exc.reason == "NOT_FOUND" and name not in self._known:
                    raise  # never registered: a wrong name, not a restart; waiting would not help
                last, stale = str(exc), True
            except RegistryUnavailable as exc:
                if registry_down is None:
                    registry_since = loop.time()
                registry_down, last, stale = exc, f"registry unavailable: {exc}", True
            except Unavailable as exc:
                last, stale = f"registry unavailable: {exc}", True
            except TimeoutError:
                continue
            else:
                registry_down = None
                if address is None:
                    last = f"replica {endpoint_id} of {name!r} is not registered (restarting?)"
                    await asyncio.sleep(min(next(delays), max(deadline - loop.time(), 0)))
                    continue
                attempt += 1
                failure = yield address, deadline - loop.time()
                if isinstance(failure, Unavailable) and endpoint_id is None:
                    self.balancer.failed(name, address)
                last = str(failure)
                # A server that pushed back (overloaded, lease held) is still where it was.
                stale = not (isinstance(failure, GymrpcError) and failure.code in _BACK_OFF_CODES)
            await asyncio.sleep(min(next(delays), max(deadline - loop.time(), 0)))


class NamedStub:
    """Duck-typed generated stub whose methods go through `Client`'s resolve-and-retry path."""

    def __init__(
        self,
        client: Client,
        name: str,
        stub_class: Callable[[grpc.aio.Channel], Any],
        service: ServiceDescriptor,
        endpoint_id: str | None = None,
    ) -> None:
        self._client, self._name, self._stub_class = client, name, stub_class
        self._endpoint_id = endpoint_id
        # Every call carries the credential: control calls need the stack token, data-plane calls
        # the stack token or a role token the service admits (gymrpc.servers.credentials).
        self._metadata = client._metadata
        for method in service.methods:
            wrap = self._stream if method.server_streaming else self._unary
            setattr(self, method.name, wrap(method))

    def _method(self, address: str, method: MethodDescriptor) -> Any:
        return getattr(self._client.stub_at(address, self._stub_class), method.name)

    def _retryable(self, method: MethodDescriptor) -> bool:
        return method.GetOptions().idempotency_level in _RETRYABLE_LEVELS

    def _unary(self, method: MethodDescriptor) -> Callable[..., Any]:
        client, name, retryable = self._client, self._name, self._retryable(method)

        async def call(request: Any, *, timeout: float | None = None) -> Any:
            attempts = client._attempts(name, method.full_name, timeout, affinity_key(request), self._endpoint_id)
            try:
                address, left = await anext(attempts)
                while True:
                    try:
                        return await self._method(address, method)(
                            request, timeout=left, metadata=tracing.outgoing(self._metadata)
                        )
                    except grpc.RpcError as exc:
                        err = from_rpc_error(exc)
                        if not (retryable and _is_retryable(err)):
                            raise err from exc
                        if err.retry_delay:
                            await asyncio.sleep(min(err.retry_delay, left))
                        address, left = await attempts.asend(err)
            finally:
                await attempts.aclose()

        return call

    def _stream(self, method: MethodDescriptor) -> Callable[..., AsyncIterator[Any]]:
        client, name, retryable = self._client, self._name, self._retryable(method)

        async def call(request: Any, *, timeout: float | None = None) -> AsyncIterator[Any]:
            # Retried only until the first message arrives; after that a failure is the caller's.
            attempts = client._attempts(name, method.full_name, timeout, affinity_key(request), self._endpoint_id)
            address, left = await anext(attempts)
            while True:
                stream = self._method(address, method)(request, timeout=left, metadata=tracing.outgoing(self._metadata))
                try:
                    first = await stream.read()
                    break
                except grpc.RpcError as exc:
                    err = from_rpc_error(exc)
                    if not (retryable and _is_retryable(err)):
                        raise err from exc
                    if err.retry_delay:
                        await asyncio.sleep(min(err.retry_delay, left))
                    address, left = await attempts.asend(err)
            await attempts.aclose()
            if first is grpc.aio.EOF:
                return
            yield first
            try:
                while (item := await stream.read()) is not grpc.aio.EOF:
                    yield item
            except grpc.RpcError as exc:
                raise from_rpc_error(exc) from exc

        return call
