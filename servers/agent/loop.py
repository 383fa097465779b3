"""The episode loop: one transition per boundary over an explicit `EpisodeState`.

`EpisodeLoop.advance` performs exactly one transition (seed, one model call, one tool
call or text turn, verify) and leaves the state at the next boundary, where a later
checkpoint store can save it; `steps` and `run` just repeat it. The loop depends only on
the protocol: `resources` and `model` are anything with the generated stubs' async
methods (a `gymrpc.Client` stub, a plain generated stub, or an in-process fake).

Behaviour follows the reference's Simple Agent (reference §1.3): a tool failure goes back
to the model as the tool's result; the loop stops on an answer without tool calls, on a
truncated or empty generation, or after `max_steps` model calls (the tools of the last
call still run). Text-turn environments get every reply through `Step` instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

import grpc

from gymrpc import tracing
from gymrpc.errors import GymrpcError, from_rpc_error, session_lost
from gymrpc.pbtime import duration
from gymrpc.servers.agent.state import EpisodeState, Phase, caller_retries
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2
from gymrpc.v1 import model_service_pb2 as model_pb
from gymrpc.v1 import resources_service_pb2 as resources_pb

log = logging.getLogger(__name__)
CLOSE_TIMEOUT = 5.0
"""Seconds a best-effort `CloseSession` after a failed episode may take."""
NO_NAME_ERROR = "Error: the tool call has no function name"


def with_context(err: GymrpcError, service: str, method: str) -> GymrpcError:
    """The same error class, reason and retry hint, with the downstream call named in the message."""
    metadata = dict(err.metadata)
    metadata.setdefault("service", service)
    metadata.setdefault("method", method)
    return type(err)(
        f"{service} {method}: {err.message}",
        reason=err.reason,
        metadata=metadata,
        retry_delay=err.retry_delay,
    )


class EpisodeLoop:
    """Moves episodes between boundaries; one instance serves every episode of an agent.

    Args:
        resources, model: stubs of `ResourcesService` and `ModelService`.
        resources_name, model_name: their stable names, used in error messages.
        call_timeout: seconds one downstream call may take, retries included.
        failovers: how many of an episode's calls this process's client has moved to another
            replica so far (`gymrpc.balancing.Balancer.failovers`); what it adds between two looks
            (`count_failovers`) goes into the state's checkpointed `failovers`, so a continued
            episode reports the moves of every process that ran it (`Trajectory.failovers`).
    """

    def __init__(
        self,
        resources: Any,
        model: Any,
        *,
        resources_name: str = "resources",
        model_name: str = "model",
        call_timeout: float = 300.0,
        failovers: Callable[[EpisodeState], int] | None = None,
    ) -> None:
        self.resources, self.model = resources, model
        self.failovers = failovers
        self.resources_name, self.model_name = resources_name, model_name
        self.call_timeout = call_timeout
        self.snapshots_in_replies = False
        """Ask `SeedSession`, `CallTool` and `Step` for the session's snapshot in their replies (durable
        resume sets it once the resources server advertises support); kept in `state.session_snapshot`."""
        self._cleanups: set[asyncio.Task[None]] = set()

    # -- driving -----------------------------------------------------------------------------

    async def steps(self, state: EpisodeState) -> AsyncGenerator[common_pb2.Message | None, None]:
        """Advance to COMPLETED, yielding the newest message (or None) at every boundary.

        If the episode fails or the consumer stops early after seeding, the session is closed
        in the background (best effort) so the resources server does not keep it forever; a restored
        episode whose caller will retry keeps it (`EpisodeState.keeps_session_for_retry`).
        """
        started, base = time.monotonic(), state.elapsed_s
        try:
            while state.phase is not Phase.COMPLETED:
                try:
                    message = await self.advance(state)
                except GymrpcError as err:
                    # Once per run: a fresh session diverges from nothing; one lost twice is a crash loop.
                    if state.run_nonce or not (_replay_diverged(err, state) or session_lost(err, state.session_id)):
                        raise
                    await self._start_over(state, err)
                    continue
                state.elapsed_s = base + time.monotonic() - started
                yield message
        except BaseException as exc:
            kept = state.keeps_session_for_retry and caller_retries(exc)
            if state.phase not in (Phase.NEW, Phase.COMPLETED) and not kept:
                self.close_in_background(state)
            raise

    async def _start_over(self, state: EpisodeState, err: GymrpcError) -> None:
        """Start the episode over in a fresh session, when the one it ran in cannot take it further.

        A retried run replays the earlier run's calls (the model's and the resources' replies by their
        ids); one that went another way (a sampling model whose generations were lost, say) cannot go on
        in the session the earlier run changed. Without a saved boundary (durable resume) to go back
        to, a session the resources server lost (it restarted) cannot be rebuilt either.
        """
        why = "went another way than the earlier one" if _replay_diverged(err, state) else "lost its resources session"
        log.warning(
            f"the run {why}; starting the episode over in a fresh session",
            extra={"episode": state.label, "error": err.message},
        )
        await self.discard_session(state)
        state.start_over()

    async def discard_session(self, state: EpisodeState) -> None:
        """Drop the episode's resources session, whatever it holds (the next seed makes a fresh one)."""
        request = resources_pb.DiscardSessionRequest(session_id=state.session_id, episode_id=state.episode_id)
        await self.call_resources("DiscardSession", request)

    async def run(self, state: EpisodeState) -> agent_pb.Trajectory:
        """Run the episode to the end and return its trajectory."""
        async for _ in self.steps(state):
            pass
        return state.trajectory()

    async def advance(self, state: EpisodeState) -> common_pb2.Message | None:
        """One transition from the current boundary to the next; returns the message it added last."""
        self.count_failovers(state)
        try:
            return await self._transition(state)
        finally:
            self.count_failovers(state)

    def count_failovers(self, state: EpisodeState) -> None:
        """Add the moves this process's client counted since it last looked at `state`.

        The first look only takes the baseline: the client's count may include moves of an earlier
        run of the episode in this process, which the restored `failovers` already holds. Call it
        right after restoring a state and before any call of the episode, so those count too.
        """
        if self.failovers is None:
            return
        now = self.failovers(state)
        if state.failovers_seen is not None:
            state.failovers += max(now - state.failovers_seen, 0)
        state.failovers_seen = now

    async def _transition(self, state: EpisodeState) -> common_pb2.Message | None:
        match state.phase:
            case Phase.NEW:
                return await self._seed(state)
            case Phase.READY_FOR_MODEL:
                return await self._generate(state)
            case Phase.READY_FOR_TOOL:
                return await (self._text_turn(state) if state.text_turns else self._tool_call(state))
            case Phase.READY_FOR_VERIFY:
                await self._verify(state)
                return None
        raise RuntimeError(f"episode {state.label} is already {state.phase.name}")

    # -- transitions ---------------------------------------------------------------------------

    async def _seed(self, state: EpisodeState) -> common_pb2.Message | None:
        request = resources_pb.SeedSessionRequest(
            session_id=state.session_id,
            episode_id=state.episode_id,
            task=state.task,
            return_snapshot=self.snapshots_in_replies,
        )
        with tracing.span("seed"):
            reply = await self.call_resources("SeedSession", request)
        state.session_snapshot = _snapshot(reply)
        state.messages = [*state.task.input, *(_as_role(m, common_pb2.ROLE_USER) for m in reply.observations)]
        state.tools = list(state.task.tools or reply.tools)
        state.phase = Phase.READY_FOR_MODEL
        return state.messages[-1] if reply.observations else None

    async def _generate(self, state: EpisodeState) -> common_pb2.Message:
        step = state.step
        request = model_pb.GenerateRequest(
            request_id=state.request_id(step),
            episode_id=state.episode_id,
            messages=state.messages,
            tools=state.tools,
            sampling=state.task.sampling,
        )
        started = time.perf_counter()
        with tracing.span("model.generate", **{"gymrpc.step": step}) as span:
            reply = await self._model("Generate", request)
            if span is not None:
                span.set_attribute("gymrpc.output_tokens", reply.usage.output_tokens)
        latency = time.perf_counter() - started
        message = _as_role(reply.message, common_pb2.ROLE_ASSISTANT)
        _number_tool_calls(message, step, _used_call_ids(state.messages))
        state.messages.append(message)
        state.step = step + 1
        state.model_calls.append(
            agent_pb.ModelCallRecord(
                step=step,
                tokens=reply.tokens,
                finish_reason=reply.finish_reason,
                weight_version=reply.weight_version,
                latency=duration(latency),
                weight_versions=reply.weight_versions,
            )
        )
        state.usage.input_tokens += reply.usage.input_tokens
        state.usage.output_tokens += reply.usage.output_tokens
        stop = self._stop_after_generation(state, message, reply.finish_reason)
        if stop is not None:
            _end_loop(state, stop)
        else:
            state.phase = Phase.READY_FOR_TOOL
            state.pending_tool_calls = [] if state.text_turns else list(message.tool_calls)
            state.next_tool_index = 0
        return message

    @staticmethod
    def _stop_after_generation(state: EpisodeState, message: common_pb2.Message, finish_reason: int) -> int | None:
        if not message.content.strip() and not message.tool_calls:
            return agent_pb.STOP_REASON_EMPTY_OUTPUT  # nothing to act on (also: reasoning only)
        if finish_reason == common_pb2.FINISH_REASON_LENGTH:
            return agent_pb.STOP_REASON_LENGTH  # cut off: its tool calls may be incomplete
        if not state.text_turns and not message.tool_calls:
            return agent_pb.STOP_REASON_FINAL_ANSWER
        return None

    async def _tool_call(self, state: EpisodeState) -> common_pb2.Message:
        call = state.pending_tool_calls[state.next_tool_index]
        started = time.perf_counter()
        with tracing.span("tool.call", **{"gymrpc.tool": call.name, "gymrpc.step": state.step - 1}) as span:
            if call.name:
                request = resources_pb.CallToolRequest(
                    session_id=state.session_id,
                    episode_id=state.episode_id,
                    call=call,
                    return_snapshot=self.snapshots_in_replies,
                )
                reply = await self.call_resources("CallTool", request)
                output, is_error = reply.output, reply.is_error
                state.session_snapshot = _snapshot(reply)
            else:  # the resources server refuses nameless calls; the model should hear why instead
                output, is_error = NO_NAME_ERROR, True
                state.session_snapshot = None
            if span is not None:
                span.set_attribute("gymrpc.tool_error", is_error)
        latency = time.perf_counter() - started
        result = common_pb2.Message(role=common_pb2.ROLE_TOOL, tool_call_id=call.id, name=call.name, content=output)
        state.messages.append(result)
        state.tool_calls.append(
            agent_pb.ToolCallRecord(
                step=state.step - 1, call=call, output=output, is_error=is_error, latency=duration(latency)
            )
        )
        state.next_tool_index += 1
        if state.next_tool_index == len(state.pending_tool_calls):
            state.pending_tool_calls, state.next_tool_index = [], 0
            _after_actions(state)
        return result

    async def _text_turn(self, state: EpisodeState) -> common_pb2.Message | None:
        request = resources_pb.StepRequest(
            session_id=state.session_id,
            episode_id=state.episode_id,
            turn_id=state.turn_id(state.step - 1),
            message=state.messages[-1],
            return_snapshot=self.snapshots_in_replies,
        )
        with tracing.span("env.step", **{"gymrpc.step": state.step - 1}):
            reply = await self.call_resources("Step", request)
        state.session_snapshot = _snapshot(reply)
        state.messages.extend(_as_role(m, common_pb2.ROLE_USER) for m in reply.observations)
        if reply.terminated:
            # The protocol has no dedicated reason (yet): a natural end is the text-env final answer.
            _end_loop(state, agent_pb.STOP_REASON_FINAL_ANSWER)
        elif reply.truncated:
            _end_loop(state, agent_pb.STOP_REASON_MAX_STEPS)  # the environment's own turn limit
        else:
            _after_actions(state)
        return state.messages[-1] if reply.observations else None

    async def _verify(self, state: EpisodeState) -> None:
        request = resources_pb.VerifyRequest(
            session_id=state.session_id, episode_id=state.episode_id, messages=state.messages
        )
        with tracing.span("verify"):
            state.verify = await self.call_resources("Verify", request)
            await self.call_resources(
                "CloseSession",
                resources_pb.CloseSessionRequest(session_id=state.session_id, episode_id=state.episode_id),
            )
        state.phase = Phase.COMPLETED

    # -- downstream calls ------------------------------------------------------------------------

    async def list_tools(self) -> resources_pb.ListToolsResponse:
        """The environment's description: its tools and whether it takes text turns."""
        return await self.call_resources("ListTools", resources_pb.ListToolsRequest())

    async def call_resources(self, method: str, request: Any, seconds: float | None = None) -> Any:
        """`method` on the resources server, with the call timeout; errors name the call."""
        return await _call(self.resources, self.resources_name, method, request, seconds or self.call_timeout)

    async def _model(self, method: str, request: Any) -> Any:
        return await _call(self.model, self.model_name, method, request, self.call_timeout)

    def close_in_background(self, state: EpisodeState) -> None:
        """Free the session of an episode that will not complete; the failure itself is the caller's."""

        async def close() -> None:
            request = resources_pb.CloseSessionRequest(session_id=state.session_id, episode_id=state.episode_id)
            try:
                await self.call_resources("CloseSession", request, seconds=CLOSE_TIMEOUT)
            except Exception as exc:
                log.warning(
                    "could not close the session of a failed episode: %s",
                    exc,
                    extra={"episode": state.label, "session_id": state.session_id},
                )

        task = asyncio.get_running_loop().create_task(close())
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)


async def _call(stub: Any, service: str, method: str, request: Any, seconds: float) -> Any:
    """`stub.method(request)` with a timeout; errors keep their class and gain the call's name."""
    try:
        return await getattr(stub, method)(request, timeout=seconds)
    except GymrpcError as err:
        raise with_context(err, service, method) from err
    except grpc.RpcError as exc:  # a plain generated stub rather than a gymrpc.Client one
        raise with_context(from_rpc_error(exc), service, method) from exc


def _snapshot(reply: Any) -> common_pb2.SessionSnapshot | None:
    """The session snapshot a `SeedSession`, `CallTool` or `Step` reply carries; None from a server that sent none."""
    return reply.snapshot if reply.HasField("snapshot") else None


def _end_loop(state: EpisodeState, reason: int) -> None:
    state.stop_reason = reason
    state.pending_tool_calls, state.next_tool_index = [], 0
    state.phase = Phase.READY_FOR_VERIFY


def _after_actions(state: EpisodeState) -> None:
    """Every action of the current step is done: ask the model again, unless steps ran out."""
    if state.step >= state.max_steps:
        _end_loop(state, agent_pb.STOP_REASON_MAX_STEPS)
    else:
        state.phase = Phase.READY_FOR_MODEL


def _as_role(message: common_pb2.Message, default: int) -> common_pb2.Message:
    """A copy with a role: servers that leave it unset would make the next request invalid."""
    out = common_pb2.Message()
    out.CopyFrom(message)
    if out.role == common_pb2.ROLE_UNSPECIFIED:
        out.role = default  # type: ignore[assignment]
    return out


def _used_call_ids(messages: list[common_pb2.Message]) -> set[str]:
    return {call.id for m in messages for call in m.tool_calls}


def _number_tool_calls(message: common_pb2.Message, step: int, used: set[str]) -> None:
    """Give every call an id unique in the episode (`call_<step>_<index>` when missing or reused).

    Resources de-duplicate `CallTool` by call id, so a model that repeats ids across steps
    would otherwise get a stale result instead of running the new call.
    """
    for index, call in enumerate(message.tool_calls):
        if not call.id or call.id in used:
            call.id = f"call_{step}_{index}"
            while call.id in used:
                call.id += "_"
        used.add(call.id)


def _replay_diverged(err: GymrpcError, state: EpisodeState) -> bool:
    """The resources role refused a call of this retried run: the earlier run did not make it."""
    return err.reason == "REPLAY_DIVERGENCE" and err.metadata.get("session_id") == state.session_id
