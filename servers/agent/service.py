"""`gymrpc.v1.AgentService`: request validation, episode setup and deadlines around `EpisodeLoop`.

Bad input is refused with INVALID_ARGUMENT before any downstream call; downstream errors
reach the caller as the same error class with the failing call named (the loop adds it).
Every episode is a few awaits on the one event loop, so hundreds run concurrently.
With durable resume on (`AgentConfig.resume` and a store), episodes go through
`gymrpc.servers.agent.durable`, which checkpoints every boundary and continues retried runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from gymrpc import tracing
from gymrpc.errors import Aborted, DeadlineExceeded, InvalidArgument
from gymrpc.ids import check_attempt, check_id
from gymrpc.messages import ROLE_NAMES, parse_json_object
from gymrpc.pbtime import request_seconds
from gymrpc.servers.agent.checkpoint import fingerprint
from gymrpc.servers.agent.durable import DurableEpisodes, ResumeConfig
from gymrpc.servers.agent.faults import CrashPlan
from gymrpc.servers.agent.loop import EpisodeLoop
from gymrpc.servers.agent.participant import AgentParticipant
from gymrpc.servers.agent.state import EpisodeState, Phase
from gymrpc.store import EpisodeStore
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import agent_service_pb2_grpc as agent_grpc
from gymrpc.v1 import common_pb2
from gymrpc.v1 import resources_service_pb2 as resources_pb

MAX_TEXT_ID_LEN = 256
"""Bound on free-form ids that are echoed back and logged (`task_id`, `policy_version`)."""
LEASE_RETRY_DELAY = 1.0


@dataclass(frozen=True)
class AgentConfig:
    """What an agent serves and its limits; `RunOptions` may override the defaults per run."""

    resources_name: str = "resources/counter"
    model_name: str = "model/policy"
    max_steps: int = 8
    """Model calls per episode when the request does not say."""
    max_steps_limit: int = 1000
    """Largest `options.max_steps` a request may ask for."""
    episode_timeout: float = 3600.0
    """Seconds an episode may run when the request does not say."""
    call_timeout: float = 300.0
    """Seconds one downstream call may take, retries after UNAVAILABLE included."""
    resume: ResumeConfig | None = None
    """Durable resume options; None runs episodes without checkpoints."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_steps <= self.max_steps_limit:
            raise ValueError(f"max_steps must be in 1..{self.max_steps_limit}, got {self.max_steps}")
        if self.episode_timeout <= 0 or self.call_timeout <= 0:
            raise ValueError("episode_timeout and call_timeout must be positive")


class AgentServicer(agent_grpc.AgentServiceServicer):
    """Runs episodes against one resources server and one model, both given as stubs.

    `store` is required when `config.resume` is set; `crash` is fault injection for tests.
    `participant` (coordinated checkpoints, not with durable resume) gates and parks episodes.
    `failovers` counts an episode's calls that moved replica (`EpisodeLoop`).
    """

    def __init__(
        self,
        config: AgentConfig,
        resources: Any,
        model: Any,
        *,
        store: EpisodeStore | None = None,
        crash: CrashPlan | None = None,
        participant: AgentParticipant | None = None,
        failovers: Callable[[EpisodeState], int] | None = None,
    ) -> None:
        self.config = config
        self.loop = EpisodeLoop(
            resources,
            model,
            resources_name=config.resources_name,
            model_name=config.model_name,
            call_timeout=config.call_timeout,
            failovers=failovers,
        )
        self._environment: resources_pb.ListToolsResponse | None = None
        self._environment_lock = asyncio.Lock()
        self._running: set[tuple[str, int]] = set()
        self.durable: DurableEpisodes | None = None
        self.participant = participant
        if config.resume is not None and participant is not None:
            raise ValueError("durable resume and coordinated checkpoints are exclusive; pick one")
        if config.resume is not None:
            if store is None:
                raise ValueError("durable resume needs an episode store")
            self.durable = DurableEpisodes(self.loop, store, config.resume, crash=crash)

    async def Run(self, request: agent_pb.RunRequest, context: grpc.aio.ServicerContext) -> agent_pb.RunResponse:
        state, timeout = await self._prepare(request)
        with _episode_span(state):
            if self.durable is not None:
                trajectory = None
                run = self.durable.run(state, progress=False)
                async with _deadline(state, timeout), contextlib.aclosing(run) as events:
                    async for event in events:
                        if isinstance(event, agent_pb.Trajectory):
                            trajectory = event
                return agent_pb.RunResponse(trajectory=trajectory)
            with self._hold(state):
                async with (
                    self._admitted(state),
                    _deadline(state, timeout) as scope,
                    contextlib.aclosing(self._steps(state, scope)) as steps,
                ):
                    async for _ in steps:
                        pass
            return agent_pb.RunResponse(trajectory=state.trajectory())

    async def RunStream(
        self, request: agent_pb.RunStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[agent_pb.RunStreamResponse]:
        state, timeout = await self._prepare(request.request)
        with _episode_span(state):
            if self.durable is not None:
                async with _deadline(state, timeout), contextlib.aclosing(self.durable.run(state)) as events:
                    async for event in events:
                        if isinstance(event, agent_pb.Trajectory):
                            yield agent_pb.RunStreamResponse(trajectory=event)
                        else:
                            yield agent_pb.RunStreamResponse(progress=event)
                return
            with self._hold(state):
                async with (
                    self._admitted(state),
                    _deadline(state, timeout) as scope,
                    contextlib.aclosing(self._steps(state, scope)) as steps,
                ):
                    async for message in steps:
                        yield agent_pb.RunStreamResponse(progress=state.progress(message))
            yield agent_pb.RunStreamResponse(trajectory=state.trajectory())

    def _admitted(self, state: EpisodeState) -> contextlib.AbstractAsyncContextManager[None]:
        """Coordinated checkpoints: wait for admission and pick up a restored boundary (else nothing)."""
        if self.participant is None:
            return contextlib.nullcontext()
        return self.participant.admitted(state, fingerprint(state.task))

    def _steps(self, state: EpisodeState, deadline: asyncio.Timeout) -> AsyncGenerator[common_pb2.Message | None, None]:
        """The episode's boundaries; parked at each while a checkpoint is open (with a participant)."""
        steps = self.loop.steps(state)
        return steps if self.participant is None else self.participant.drive(state, steps, deadline)

    # -- setup -------------------------------------------------------------------------------

    async def _prepare(self, request: agent_pb.RunRequest) -> tuple[EpisodeState, float]:
        """Validate the request and build the episode's initial state (no episode side effects)."""
        _check_task(request)
        if self.config.resume is not None:
            _check_resumable(request, self.config.resume)
        rollout_id, attempt = _episode_identity(request)
        options = request.options
        max_steps = options.max_steps or self.config.max_steps
        if max_steps > self.config.max_steps_limit:
            raise InvalidArgument(
                f"options.max_steps {max_steps} exceeds this agent's limit of {self.config.max_steps_limit}",
                metadata={"field": "options.max_steps"},
            )
        timeout = self.config.episode_timeout
        if options.HasField("episode_timeout"):
            timeout = request_seconds(options.episode_timeout, "options.episode_timeout")
            if timeout <= 0:
                raise InvalidArgument(
                    f"options.episode_timeout must be positive, got {timeout}s",
                    metadata={"field": "options.episode_timeout"},
                )
        _check_text(request.policy_version, "policy_version")
        environment = await self.environment()
        return EpisodeState(
            rollout_id=rollout_id,
            attempt=attempt,
            task=request.task,
            max_steps=max_steps,
            text_turns=environment.interaction_style == resources_pb.INTERACTION_STYLE_TEXT_TURNS,
            policy_version=request.policy_version,
        ), timeout

    async def environment(self) -> resources_pb.ListToolsResponse:
        """The resources server's description (interaction style, tools), asked once."""
        if self._environment is None:
            async with self._environment_lock:
                if self._environment is None:
                    self._environment = await self.loop.list_tools()
                    if self.participant is not None:
                        replay = self._environment.checkpoint_verify == resources_pb.CHECKPOINT_VERIFY_REPLAY
                        self.participant.replay_verify = replay
        return self._environment

    @contextlib.contextmanager
    def _hold(self, state: EpisodeState) -> Iterator[None]:
        """One run per episode attempt at a time: a second would drive the same session twice."""
        key = (state.rollout_id, state.attempt)
        if key in self._running:
            raise Aborted(
                f"episode {state.label} is already running on this agent; retry after it finishes",
                reason="LEASE_HELD",
                metadata={"rollout_id": state.rollout_id, "attempt": str(state.attempt)},
                retry_delay=LEASE_RETRY_DELAY,
            )
        self._running.add(key)
        try:
            yield
        finally:
            self._running.discard(key)


@contextlib.contextmanager
def _episode_span(state: EpisodeState) -> Iterator[None]:
    """The episode's span (tracing on): the model, tool and resources calls of this run are its children."""
    identity = {
        "gymrpc.rollout_id": state.rollout_id,
        "gymrpc.attempt": state.attempt,
        "gymrpc.task_id": state.task.task_id,
    }
    with tracing.span("episode", **identity) as span:
        state.traceparent = tracing.traceparent()
        try:
            yield
        finally:
            if span is not None:
                span.set_attribute("gymrpc.resume_count", state.resume_count)
                span.set_attribute("gymrpc.steps", state.step)
                span.set_attribute("gymrpc.phase", state.phase.name)


@contextlib.asynccontextmanager
async def _deadline(state: EpisodeState, seconds: float) -> AsyncIterator[asyncio.Timeout]:
    """The episode's overall deadline as DEADLINE_EXCEEDED naming where the episode stood.

    Yields the scope, so time parked for a checkpoint can be added back (`AgentParticipant`).
    """
    scope = asyncio.timeout(seconds)
    try:
        async with scope:
            yield scope
    except TimeoutError:
        if not scope.expired():
            raise
        raise DeadlineExceeded(
            f"episode {state.label} ran past its timeout of {seconds:g}s in phase {state.phase.name} "
            f"at step {state.step}",
            metadata={"rollout_id": state.rollout_id, "attempt": str(state.attempt)},
        ) from None


def _check_task(request: agent_pb.RunRequest) -> None:
    if not request.HasField("task"):
        raise InvalidArgument("task is required", metadata={"field": "task"})
    task = request.task
    if not task.input:
        raise InvalidArgument(
            "task.input is empty: an episode starts from at least one message",
            metadata={"field": "task.input"},
        )
    for i, message in enumerate(task.input):
        if message.role not in ROLE_NAMES:
            raise InvalidArgument(
                f"task.input[{i}].role {message.role} is not a known Role",
                metadata={"field": f"task.input[{i}].role"},
            )
    for i, tool in enumerate(task.tools):
        if not tool.name:
            raise InvalidArgument(f"task.tools[{i}].name is empty", metadata={"field": f"task.tools[{i}].name"})
    parse_json_object(task.env_json, "task.env_json")
    _check_text(task.task_id, "task.task_id")


def _check_text(value: str, field: str) -> None:
    if len(value) > MAX_TEXT_ID_LEN or not value.isprintable():
        raise InvalidArgument(
            f"{field} must be printable and at most {MAX_TEXT_ID_LEN} characters", metadata={"field": field}
        )


def _check_resumable(request: agent_pb.RunRequest, resume: ResumeConfig) -> None:
    """With durable resume the caller names the episode (and the weights): a retry must find it again."""
    if not request.episode_id.rollout_id:
        raise InvalidArgument(
            "durable resume is on: episode_id.rollout_id is required, so that a retried Run continues the episode",
            metadata={"field": "episode_id.rollout_id"},
        )
    if resume.require_policy_version and not request.policy_version:
        raise InvalidArgument(
            "durable resume is on: policy_version is required (a checkpoint made with other weights is archived); "
            "name it (`gymrpc rollouts --policy-version V`, or RunRequest.policy_version), or start the agent "
            "with --no-require-policy-version (stack args `require_policy_version: false`) to allow runs without one",
            metadata={"field": "policy_version"},
        )


def _episode_identity(request: agent_pb.RunRequest) -> tuple[str, int]:
    """The request's episode id, or a fresh random one when it has none."""
    episode = request.episode_id
    if episode.rollout_id:
        return check_id(episode.rollout_id, "episode_id.rollout_id"), check_attempt(
            episode.attempt, "episode_id.attempt"
        )
    if episode.attempt:
        raise InvalidArgument(
            "episode_id.attempt is set but episode_id.rollout_id is empty",
            metadata={"field": "episode_id.rollout_id"},
        )
    return uuid.uuid4().hex, 0


__all__ = ["AgentConfig", "AgentServicer", "Phase"]
