"""In-process participants over real gRPC, for the simulation, bad-input tests and the control benchmark.

Each participant is a real `grpc.aio` server on 127.0.0.1:0 started by `gymrpc.servers.bootstrap.start_server`
(token check, error mapping, reflection, as `gymrpc up` serves it), in this process so that hundreds
of control rounds run in seconds and the tests can look at participant state directly. The
`Controller` reaches them through `DirectClient`, a name to address map instead of a registry, so a
killed participant fails at once with UNAVAILABLE rather than being retried for a minute.

Kinds: `resources` (the counter environment, exported sessions), `model` (scripted backend, capture
ledger) and `FakeAgent`, a minimal agent-kind participant whose running episodes the test toggles,
so prepares can miss their deadline on purpose.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from gymrpc import auth
from gymrpc.channels import service_channel_options
from gymrpc.chat import default_tokenizer
from gymrpc.control import Capture, ControlPlane, EpisodeKey, Kind, Participant, Report, Scope
from gymrpc.controller import Controller
from gymrpc.envs.counter import CounterEnvironment
from gymrpc.errors import DataLoss, FailedPrecondition, from_rpc_error
from gymrpc.servers.bootstrap import RunningServer, ServerConfig, ServiceBinding, start_server
from gymrpc.servers.model.backends.scripted import ScriptedBackend
from gymrpc.servers.model.backends.sources import CounterSolver
from gymrpc.servers.model.participant import ModelParticipant
from gymrpc.servers.model.service import ModelServicer
from gymrpc.servers.participant import participant_binding
from gymrpc.servers.resources.participant import ResourcesParticipant, gate_servicer
from gymrpc.servers.resources.service import ResourcesServicer
from gymrpc.testing.participants import NamedDirectory
from gymrpc.v1 import checkpoint_records_pb2 as rec_pb
from gymrpc.v1 import common_pb2
from gymrpc.v1 import model_service_pb2 as model_pb
from gymrpc.v1 import model_service_pb2_grpc as model_grpc
from gymrpc.v1 import participant_service_pb2 as pb
from gymrpc.v1 import participant_service_pb2_grpc as pb_grpc
from gymrpc.v1 import resources_service_pb2 as res_pb
from gymrpc.v1 import resources_service_pb2_grpc as res_grpc
from tests.agent.fakes import counter_task, counter_tasks

TOKEN = "test-control-token"
AGENT_STATE_URL = "type.googleapis.com/gymrpc.test.FakeAgentState"


class FakeAgent(Participant):
    """An agent-kind participant: episodes at a boundary (their step count) and episodes between boundaries.

    The real agent participant lives in `servers/agent`; this one has only what the control plane
    needs, so a test can hold an episode "running" to make a prepare miss its deadline.
    """

    kind = Kind.AGENT

    def __init__(self) -> None:
        super().__init__()
        self.steps: dict[EpisodeKey, int] = {}
        self.running: set[EpisodeKey] = set()
        self.installed: list[EpisodeKey] = []
        self.fail_install = False

    def track(self, episode: EpisodeKey) -> None:
        """A new episode, at its first boundary."""
        self.marks.check(episode)
        self.steps.setdefault(episode, 0)

    def begin(self, episode: EpisodeKey) -> None:
        """The episode leaves its boundary: it blocks a prepare until `end`."""
        self.track(episode)
        self.running.add(episode)
        self.changed.notify()

    def end(self, episode: EpisodeKey) -> None:
        if episode in self.running:
            self.running.discard(episode)
            self.steps[episode] = self.steps.get(episode, 0) + 1
            self.changed.notify()

    def drop(self, episode: EpisodeKey) -> None:
        self.running.discard(episode)
        self.steps.pop(episode, None)
        self.changed.notify()

    def readiness(self) -> Report:
        return Report(blockers=tuple(sorted(self.running)), counts={"episodes": len(self.steps)})

    async def capture(self, scope: Scope) -> Capture:
        steps = dict(self.steps)  # ints: a copy is the capture; the scope is applied by the write
        return Capture(functools.partial(_fake_records, steps, scope), len(steps))

    def not_fresh(self) -> str | None:
        return f"it holds {len(self.steps)} episodes" if self.steps else super().not_fresh()

    async def stage(self, records: Sequence[rec_pb.CheckpointRecord], scope: frozenset[EpisodeKey]) -> Any:
        staged = {}
        for record in records:
            if record.WhichOneof("body") != "other" or record.other.type_url != AGENT_STATE_URL:
                raise DataLoss(f"a record of {record.episode_id.rollout_id!r} is not a fake agent state")
            try:
                steps = int(json.loads(record.other.value)["steps"])
            except (ValueError, KeyError, TypeError) as exc:
                raise DataLoss(f"a fake agent state does not decode: {exc}") from None
            staged[EpisodeKey.of(record.episode_id).next()] = steps
        return staged

    async def install(self, staged: Any) -> list[EpisodeKey]:
        if self.fail_install:
            raise FailedPrecondition("injected install failure", reason="BACKEND_FAILURE")
        self.steps.update(staged)
        self.installed = sorted(staged)
        return self.installed

    async def retire(self, episodes: Sequence[EpisodeKey]) -> None:
        for episode in list(self.steps):
            if self.marks.is_retired(episode):
                self.drop(episode)


def _fake_records(steps: dict[EpisodeKey, int], scope: Scope) -> Iterator[rec_pb.CheckpointRecord]:
    for episode, count in sorted(steps.items()):
        if scope is not None and episode not in scope:
            continue
        record = rec_pb.CheckpointRecord(episode_id=episode.to_pb())
        record.other.type_url = AGENT_STATE_URL
        record.other.value = json.dumps({"steps": count}).encode()
        yield record


@dataclass
class Node:
    """One participant server: its plane, participant, role servicer and gRPC server."""

    name: str
    plane: ControlPlane
    server: RunningServer
    servicer: Any = None
    alive: bool = True

    @property
    def participant(self) -> Any:
        return self.plane.participant

    @property
    def kind(self) -> Kind:
        return self.plane.kind

    @property
    def address(self) -> str:
        return self.server.address

    async def kill(self) -> None:
        """Stop at once (no grace), like a crash: in-flight calls fail, the state is gone."""
        if self.alive:
            self.alive = False
            await self.server.stop(0)
            await self.plane.close()
            if isinstance(self.servicer, ModelServicer):
                await self.servicer.close()
            elif isinstance(self.servicer, ResourcesServicer):
                self.servicer.host.shutdown()


def _bindings(plane: ControlPlane, extra: Sequence[ServiceBinding]) -> list[ServiceBinding]:
    return [*extra, participant_binding(plane)]


async def start_node(name: str, *, lease_grace: float = 60.0, token_delay: float = 0.0) -> Node:
    """Start a participant server; the role comes from the name (`resources/*`, `model/*`, `agent/*`)."""
    role = name.partition("/")[0]
    servicer: Any = None
    extra: list[ServiceBinding] = []
    participant: Participant
    if role == "resources":
        servicer = ResourcesServicer(CounterEnvironment(), workers=2)
        participant = ResourcesParticipant(servicer)
        gate_servicer(servicer, participant)
        extra.append(
            ServiceBinding(
                res_pb.DESCRIPTOR.services_by_name["ResourcesService"],
                servicer,
                res_grpc.add_ResourcesServiceServicer_to_server,
            )
        )
    elif role == "model":
        tokenizer = default_tokenizer()
        servicer = ModelServicer(ScriptedBackend(tokenizer, [CounterSolver()], token_delay=token_delay), tokenizer)
        participant = ModelParticipant(servicer)
        extra.append(
            ServiceBinding(
                model_pb.DESCRIPTOR.services_by_name["ModelService"],
                servicer,
                model_grpc.add_ModelServiceServicer_to_server,
            )
        )
    elif role == "agent":
        participant = FakeAgent()
    else:
        raise ValueError(f"no participant role for {name!r}")
    plane = ControlPlane(participant, name=name, lease_grace=lease_grace)
    plane.start()
    server = await start_server(ServerConfig(name=name, token=TOKEN, grace=0.0), _bindings(plane, extra))
    return Node(name, plane, server, servicer)


class _Stub:
    """A generated stub on one channel whose methods raise `gymrpc.errors`, like `Client`'s named stubs."""

    def __init__(self, channel: grpc.aio.Channel, stub_class: Callable[[grpc.aio.Channel], Any], control: bool) -> None:
        self._stub = stub_class(channel)
        self._metadata = auth.metadata(TOKEN)  # the stack token: control and data plane alike

    def __getattr__(self, method: str) -> Callable[..., Any]:
        impl = getattr(self._stub, method)
        metadata = self._metadata

        async def call(request: Any, *, timeout: float | None = None) -> Any:
            try:
                return await impl(request, timeout=timeout, metadata=metadata)
            except grpc.RpcError as exc:
                raise from_rpc_error(exc) from exc

        setattr(self, method, call)  # built once per method: later lookups skip __getattr__
        return call


@dataclass
class DirectClient(NamedDirectory):
    """What `Controller` uses of `gymrpc.Client` (a `Directory`), by address instead of registry.

    Like `Client`, it keeps one channel and one stub per address and service (`Client.stub_at`), with
    the channel options of a resolved address (`service_channel_options`: no transparent retries).
    """

    nodes: dict[str, Node] = field(default_factory=dict)
    _channels: dict[str, grpc.aio.Channel] = field(default_factory=dict)
    _stubs: dict[tuple[str, Any], _Stub] = field(default_factory=dict)

    def channel(self, name: str) -> grpc.aio.Channel:
        address = self.nodes[name].address
        if address not in self._channels:
            # A local subchannel pool: a new server may get the port of one just killed, and a shared
            # subchannel to it would still be backing off from "connection refused".
            self._channels[address] = grpc.aio.insecure_channel(
                address, options=[*service_channel_options(), ("grpc.use_local_subchannel_pool", 1)]
            )
        return self._channels[address]

    def _stub(self, name: str, stub_class: Callable[[grpc.aio.Channel], Any], control: bool) -> Any:
        key = (self.nodes[name].address, stub_class)
        stub = self._stubs.get(key)
        if stub is None:
            stub = self._stubs[key] = _Stub(self.channel(name), stub_class, control)
        return stub

    def participant_names(self) -> Iterable[str]:
        return self.nodes

    def participant(self, name: str, endpoint_id: str | None = None) -> Any:
        return self._stub(name, pb_grpc.ParticipantServiceStub, control=True)

    def resources(self, name: str) -> Any:
        return self._stub(name, res_grpc.ResourcesServiceStub, control=False)

    def model(self, name: str) -> Any:
        return self._stub(name, model_grpc.ModelServiceStub, control=False)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close(None)
        self._channels.clear()
        self._stubs.clear()


class Deployment:
    """A set of in-process participants and a `Controller` over them."""

    def __init__(self, nodes: dict[str, Node]) -> None:
        self.nodes = nodes
        self.client = DirectClient(nodes)
        self.controller = Controller(self.client, names=sorted(nodes))

    @classmethod
    async def start(cls, names: Sequence[str], **kwargs: Any) -> Deployment:
        nodes = {}
        for name in names:
            nodes[name] = await start_node(name, **kwargs)
        deployment = cls(nodes)
        await deployment.controller.discover()
        return deployment

    async def close(self) -> None:
        await self.client.close()
        for node in self.nodes.values():
            await node.kill()

    async def statuses(self) -> dict[str, pb.GetStatusResponse]:
        """GetStatus of every live participant, over gRPC."""
        out = {}
        for name, node in self.nodes.items():
            if node.alive:
                out[name] = await self.client.participant(name).GetStatus(pb.GetStatusRequest(), timeout=5)
        return out

    # -- the data plane of one counter episode -----------------------------------------------

    async def seed(self, resources: str, episode: EpisodeKey) -> None:
        request = res_pb.SeedSessionRequest(
            session_id=episode.rollout_id, episode_id=episode.to_pb(), task=counter_task("count", 0, 3)
        )
        await self.client.resources(resources).SeedSession(request, timeout=5)

    async def increment(self, resources: str, episode: EpisodeKey, call_id: str) -> None:
        call = common_pb2.ToolCall(id=call_id, name="increment_counter", arguments_json=json.dumps({"count": 1}))
        request = res_pb.CallToolRequest(session_id=episode.rollout_id, episode_id=episode.to_pb(), call=call)
        await self.client.resources(resources).CallTool(request, timeout=5)

    async def generate(self, model: str, episode: EpisodeKey, step: int) -> None:
        task = counter_tasks()[0]
        request = model_pb.GenerateRequest(
            request_id=f"{episode.rollout_id}/a{episode.attempt}/step{step}",
            episode_id=episode.to_pb(),
            messages=task.input,
            tools=task.tools,
        )
        await self.client.model(model).Generate(request, timeout=5)

    async def close_session(self, resources: str, episode: EpisodeKey) -> None:
        request = res_pb.CloseSessionRequest(session_id=episode.rollout_id, episode_id=episode.to_pb())
        await self.client.resources(resources).CloseSession(request, timeout=5)
