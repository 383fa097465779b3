"""`AgentService` around one agent function: seed, run the function, verify, report a trajectory.

Every `Run` resolves the model's front door afresh (the `openai_url` label of its registry
endpoint), so a model server that restarted on another port is found again. The session id
is derived from the episode, so a retried `Run` seeds (idempotently) the same session and its
known tool call ids return their recorded results. Each `Run` sends a fresh run id: the model
role numbers that run's calls and answers those it has recorded (`gymrpc.servers.model.replay`).

The trajectory is assembled from what the kit saw: every non-streamed model reply (its
token ids are in the vLLM-style extra fields), every tool call, and the conversation of the
function's last model call plus its reply (or the messages the function returned).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import logging
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import httpx

from gymrpc.agentkit.episode import Episode, ToolCaller, ToolOutput
from gymrpc.control import EpisodeKey
from gymrpc.errors import Aborted, FailedPrecondition, GymrpcError, InvalidArgument, NotFound, Unavailable, session_lost
from gymrpc.ids import check_id
from gymrpc.messages import message_from_dict, message_to_dict, parse_json_object, tool_definition_to_dict
from gymrpc.pbtime import duration
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import agent_service_pb2_grpc as agent_grpc
from gymrpc.v1 import common_pb2
from gymrpc.v1 import resources_service_pb2 as resources_pb

log = logging.getLogger(__name__)
OPENAI_LABEL = "openai_url"
AgentFunction = Callable[[Episode], Awaitable[Any]]
_FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "tool_calls": common_pb2.FINISH_REASON_TOOL_CALLS,
}


def load_entrypoint(spec: str) -> AgentFunction:
    """`module:function` → the async function (a clear error for every way that fails)."""
    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr:
        raise ValueError(f"entrypoint {spec!r} must be module:function")
    module = importlib.import_module(module_name)
    function = getattr(module, attr, None)
    if function is None or not inspect.iscoroutinefunction(function):
        raise ValueError(f"entrypoint {spec!r} is not an async function")
    return function  # type: ignore[no-any-return]


def session_id_of(episode: EpisodeKey) -> str:
    """A session id that is the same on every run of the attempt, within the id pattern."""
    plain = f"{episode.rollout_id}.a{episode.attempt}"
    if len(plain) <= 128:
        return plain
    return "kit-" + hashlib.sha256(plain.encode()).hexdigest()[:40]


class _Observed(httpx.AsyncBaseTransport):
    """Sees each model exchange: the kit builds the trajectory from them; crash tests hook in."""

    def __init__(
        self,
        inner: httpx.AsyncBaseTransport,
        on_reply: Callable[[dict[str, Any], dict[str, Any]], None],
        before: Callable[[], None],
    ) -> None:
        self.inner, self.on_reply, self.before = inner, on_reply, before

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.before()
        response = await self.inner.handle_async_request(request)
        path = request.url.path
        json_reply = response.headers.get("content-type", "").startswith("application/json")
        if response.status_code == 200 and json_reply and path.endswith(("/chat/completions", "/responses")):
            content = await response.aread()
            self.on_reply(json.loads(request.content or b"{}"), json.loads(content))
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


class _Run:
    """One `Run` of the function: the records the trajectory is made of."""

    def __init__(self, crash: Any) -> None:
        self.crash = crash
        self.model_calls: list[agent_pb.ModelCallRecord] = []
        self.tool_calls: list[agent_pb.ToolCallRecord] = []
        self.last_exchange: tuple[dict[str, Any], dict[str, Any]] | None = None
        self.usage = common_pb2.Usage()
        self._tool_done: int | None = None

    def before_call(self) -> None:
        if self._tool_done is not None and self.crash is not None:
            self.crash.at("after_tool", self._tool_done)
        self._tool_done = None

    def on_reply(self, request: dict[str, Any], reply: dict[str, Any]) -> None:
        step = len(self.model_calls)
        if "choices" in reply:
            choice = (reply.get("choices") or [{}])[0]
            completion = choice.get("token_ids") or []
            finish = _FINISH.get(choice.get("finish_reason") or "", common_pb2.FINISH_REASON_STOP)
            logprobs = [c["logprob"] for c in ((choice.get("logprobs") or {}).get("content") or [])]
            usage = reply.get("usage") or {}
            self.usage.input_tokens += usage.get("prompt_tokens", 0)
            self.usage.output_tokens += usage.get("completion_tokens", 0)
        else:
            completion = reply.get("token_ids") or []
            calls = any(item.get("type") == "function_call" for item in reply.get("output") or ())
            finish = common_pb2.FINISH_REASON_TOOL_CALLS if calls else common_pb2.FINISH_REASON_STOP
            logprobs = []
            usage = reply.get("usage") or {}
            self.usage.input_tokens += usage.get("input_tokens", 0)
            self.usage.output_tokens += usage.get("output_tokens", 0)
        self.model_calls.append(
            agent_pb.ModelCallRecord(
                step=step,
                tokens=common_pb2.TokenTrace(
                    prompt_token_ids=reply.get("prompt_token_ids") or [],
                    completion_token_ids=completion,
                    completion_logprobs=logprobs if len(logprobs) == len(completion) else [],
                ),
                finish_reason=finish,  # type: ignore[arg-type]
                weight_version=reply.get("weight_version", ""),
            )
        )
        self.last_exchange = (request, reply)
        if self.crash is not None:
            self.crash.at("after_model", step)

    def tool_done(self, index: int) -> None:
        if self.crash is not None:
            self.crash.at("during_tool", index)
        self._tool_done = index


class AgentKitServicer(agent_grpc.AgentServiceServicer):
    """Serves `function` as an agent; `client` is a `gymrpc.Client` (registry and resources stub)."""

    def __init__(
        self,
        function: AgentFunction,
        client: Any,
        *,
        resources_name: str,
        model_name: str,
        call_timeout: float = 300.0,
        divergence: str = "fail",
        crash: Any = None,
        api_key: str = "gymrpc",
    ) -> None:
        self.function, self.client, self.api_key = function, client, api_key
        """`api_key`: the credential the model's front door checks (the agent's role token)."""
        self.resources = client.resources(resources_name)
        self.resources_name, self.model_name = resources_name, model_name
        self.call_timeout, self.divergence, self.crash = call_timeout, divergence, crash
        self._running: set[EpisodeKey] = set()

    async def Run(self, request: agent_pb.RunRequest, context: grpc.aio.ServicerContext) -> agent_pb.RunResponse:
        return agent_pb.RunResponse(trajectory=await self.run_once(request))

    async def RunStream(self, request: agent_pb.RunStreamRequest, context: grpc.aio.ServicerContext) -> Any:
        yield agent_pb.RunStreamResponse(trajectory=await self.run_once(request.request))

    async def run_once(self, request: agent_pb.RunRequest) -> agent_pb.Trajectory:
        """One run per episode attempt at a time: two would drive the same session and record."""
        episode = _episode(request)
        if episode in self._running:
            raise Aborted(
                f"episode {episode} is already running on this agent; retry after it finishes",
                reason="LEASE_HELD",
                metadata={"rollout_id": episode.rollout_id, "attempt": str(episode.attempt)},
                retry_delay=1.0,
            )
        self._running.add(episode)
        try:
            return await self.run(request, episode)
        finally:
            self._running.discard(episode)

    async def front_door(self, episode: EpisodeKey) -> str:
        """The base URL of the replica that keeps this episode's record: the same one on every run.

        Replicas of the model each keep their own record, so an episode sticks to one, chosen
        by its rollout id among the replicas serving a front door (sorted by endpoint id).
        """
        endpoints = await self.client.registry.resolve(self.model_name)
        urls = [
            e.labels[OPENAI_LABEL] for e in sorted(endpoints, key=lambda e: e.endpoint_id) if e.labels.get(OPENAI_LABEL)
        ]
        if not urls:
            raise FailedPrecondition(
                f"model {self.model_name!r} serves no OpenAI front door; start it with --openai-port 0",
                metadata={"model": self.model_name},
            )
        pick = int(hashlib.sha256(episode.rollout_id.encode()).hexdigest()[:8], 16) % len(urls)
        return str(urls[pick])

    async def run(self, request: agent_pb.RunRequest, episode: EpisodeKey) -> agent_pb.Trajectory:
        """The function run once; once more in a fresh session if the resources role lost the session
        (its server restarted: the run retraces itself, as a retried `Run` would), or, with
        `divergence="go_live"`, if it refused a tool call the earlier run did not make (its session
        holds that run's effects, which going on live would build on)."""
        task = request.task
        if not task.input:
            raise InvalidArgument(
                "task.input is empty: an episode starts from at least one message", metadata={"field": "task.input"}
            )
        env = parse_json_object(task.env_json, "task.env_json")
        session = session_id_of(episode)
        try:
            return await self._run_function(request, episode, env)
        except GymrpcError as err:
            diverged = err.reason == "REPLAY_DIVERGENCE" and err.metadata.get("session_id") == session
            if not (session_lost(err, session) or (diverged and self.divergence == "go_live")):
                raise
            why = "went another way than the earlier one" if diverged else "lost its resources session"
            log.warning(
                f"the run {why}; running it again in a fresh session",
                extra={"episode": f"{episode.rollout_id}/a{episode.attempt}", "error": err.message},
            )
        discard = resources_pb.DiscardSessionRequest(session_id=session, episode_id=episode.to_pb())
        await self._resources("DiscardSession", discard)
        trajectory = await self._run_function(request, episode, env)
        trajectory.restart_count = 1
        return trajectory

    async def _run_function(
        self, request: agent_pb.RunRequest, episode: EpisodeKey, env: dict[str, Any]
    ) -> agent_pb.Trajectory:
        import openai

        task = request.task
        session = session_id_of(episode)
        episode_pb = episode.to_pb()
        seeded = await self._resources(
            "SeedSession", resources_pb.SeedSessionRequest(session_id=session, episode_id=episode_pb, task=task)
        )
        messages = [message_to_dict(m) for m in task.input]
        messages += [{"role": "user", "content": m.content} for m in seeded.observations]
        tools = [tool_definition_to_dict(t) for t in (task.tools or seeded.tools)]
        run = _Run(self.crash)

        async def send(call: common_pb2.ToolCall) -> ToolOutput:
            run.before_call()
            started = time.perf_counter()
            if not call.name:
                output = ToolOutput(call, "Error: the tool call has no function name", True)
            else:
                reply = await self._resources(
                    "CallTool", resources_pb.CallToolRequest(session_id=session, episode_id=episode_pb, call=call)
                )
                output = ToolOutput(call, reply.output, reply.is_error)
            run.tool_calls.append(
                agent_pb.ToolCallRecord(
                    step=max(len(run.model_calls) - 1, 0),
                    call=call,
                    output=output.output,
                    is_error=output.is_error,
                    latency=duration(time.perf_counter() - started),
                )
            )
            run.tool_done(len(run.tool_calls) - 1)
            return output

        headers = {
            "x-gymrpc-episode": f"{episode.rollout_id}/{episode.attempt}",
            "x-gymrpc-run": uuid.uuid4().hex,
            "x-gymrpc-divergence": self.divergence,
        }
        nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]  # else a POST body waits ~40 ms for an ACK
        transport = _Observed(httpx.AsyncHTTPTransport(socket_options=nodelay), run.on_reply, run.before_call)
        http = httpx.AsyncClient(transport=transport, timeout=self.call_timeout)
        client = openai.AsyncOpenAI(
            base_url=await self.front_door(episode), api_key=self.api_key, default_headers=headers, http_client=http
        )
        context = Episode(
            episode_id=episode,
            task=task,
            messages=messages,
            tools=tools,
            client=client,
            model=self.model_name,
            call_tool=ToolCaller(send),
            env=env,
        )
        started = time.perf_counter()
        try:
            result = await self.function(context)
        except openai.APIStatusError as exc:
            raise _from_openai(exc) from exc
        except openai.APIConnectionError as exc:
            raise Unavailable(f"model {self.model_name!r}: {exc}", metadata={"model": self.model_name}) from exc
        finally:
            await client.close()
        final = _conversation(result, messages, run)
        verify = await self._resources(
            "Verify", resources_pb.VerifyRequest(session_id=session, episode_id=episode_pb, messages=final)
        )
        await self._resources(
            "CloseSession", resources_pb.CloseSessionRequest(session_id=session, episode_id=episode_pb)
        )
        return agent_pb.Trajectory(
            episode_id=episode_pb,
            task_id=task.task_id,
            messages=final,
            model_calls=run.model_calls,
            tool_calls=run.tool_calls,
            reward=verify.reward,
            verify_details_json=verify.details_json,
            mask_sample=verify.mask_sample,
            steps=len(run.model_calls),
            stop_reason=agent_pb.STOP_REASON_FINAL_ANSWER,
            policy_version=request.policy_version,
            usage=run.usage,
            timing=common_pb2.Timing(total=duration(time.perf_counter() - started)),
        )

    async def _resources(self, method: str, request: Any) -> Any:
        try:
            return await getattr(self.resources, method)(request, timeout=self.call_timeout)
        except GymrpcError as err:
            raise type(err)(
                f"{self.resources_name} {method}: {err.message}",
                reason=err.reason,
                metadata=err.metadata,
                retry_delay=err.retry_delay,
            ) from err


def _episode(request: agent_pb.RunRequest) -> EpisodeKey:
    if not request.HasField("task"):
        raise InvalidArgument("task is required", metadata={"field": "task"})
    rollout_id = request.episode_id.rollout_id
    if not rollout_id:
        if request.episode_id.attempt:
            raise InvalidArgument(
                "episode_id.attempt is set but episode_id.rollout_id is empty",
                metadata={"field": "episode_id.rollout_id"},
            )
        return EpisodeKey(uuid.uuid4().hex, 0)
    return EpisodeKey(check_id(rollout_id, "episode_id.rollout_id"), request.episode_id.attempt)


def _conversation(result: Any, opening: list[dict[str, Any]], run: _Run) -> list[common_pb2.Message]:
    """The episode's messages: what the function returned, else its last model call and reply."""
    if isinstance(result, list):
        dicts = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in result]
    elif run.last_exchange is not None and "messages" in run.last_exchange[0]:
        request, reply = run.last_exchange
        message = (reply.get("choices") or [{}])[0].get("message") or {}
        dicts = [*request["messages"], {k: v for k, v in message.items() if v is not None}]
    else:
        dicts = [*opening, {"role": "assistant", "content": "" if result is None else str(result)}]
    out = []
    for item in dicts:
        content = item.get("content")
        if isinstance(content, list):
            item = {**item, "content": "".join(p.get("text", "") for p in content if isinstance(p, dict))}
        out.append(message_from_dict(item))
    return out


def _from_openai(exc: Any) -> GymrpcError:
    body = exc.body if isinstance(exc.body, dict) else {}
    body = body.get("error", body) if isinstance(body.get("error"), dict) else body
    reason = str(body.get("code") or "").upper() or None
    metadata = {str(k): str(v) for k, v in (body.get("metadata") or {}).items()}
    message = f"model call: {body.get('message') or exc.message}"
    status = exc.status_code
    if status == 400:
        return InvalidArgument(message, reason=reason, metadata=metadata)
    if status == 404:
        return NotFound(message, reason=reason, metadata=metadata)
    if status == 409:
        return FailedPrecondition(message, reason=reason, metadata=metadata)
    return Unavailable(message, reason=reason or "BACKEND_FAILURE", metadata=metadata)
