"""What an agent function gets: the task in OpenAI shapes, a ready client, and a tool caller."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gymrpc.control import EpisodeKey
from gymrpc.v1 import common_pb2


@dataclass(frozen=True)
class ToolOutput:
    """One tool call's result as the resources role gave it."""

    call: common_pb2.ToolCall
    output: str
    is_error: bool


class ToolCaller:
    """`await call_tool(call)` or `await call_tool(name, arguments)`: the tool's output text.

    `call` is an openai chat tool call (`.id`, `.function.name/.arguments`), a Responses
    function call item (`.call_id`, `.name`, `.arguments`) or a dict of either shape. Its id
    is what makes a retried run safe: the resources role returns the recorded result of a
    known call id without running the tool again. Calls given by name get `kit_<n>` ids
    (n counts this run's calls), which a deterministic agent repeats on every run.
    """

    def __init__(self, send: Callable[[common_pb2.ToolCall], Awaitable[ToolOutput]]) -> None:
        self._send = send
        self._count = 0
        self.results: list[ToolOutput] = []

    async def __call__(self, call: Any, arguments: Any = None, *, call_id: str | None = None) -> str:
        return (await self.call(call, arguments, call_id=call_id)).output

    async def call(self, call: Any, arguments: Any = None, *, call_id: str | None = None) -> ToolOutput:
        """Like calling the caller, with `is_error` too."""
        import json

        index, self._count = self._count, self._count + 1
        name: Any
        if isinstance(call, str):
            name, args, ident = call, arguments, call_id
        else:
            data = call if isinstance(call, dict) else _as_dict(call)
            function = data.get("function") or data
            name, args = function.get("name"), function.get("arguments")
            ident = call_id or data.get("call_id") or data.get("id")
        if not isinstance(args, str):
            args = json.dumps(args if args is not None else {}, sort_keys=True)
        result = await self._send(common_pb2.ToolCall(id=ident or f"kit_{index}", name=name or "", arguments_json=args))
        self.results.append(result)
        return result


def _as_dict(call: Any) -> dict[str, Any]:
    if hasattr(call, "model_dump"):
        return call.model_dump()
    return {k: getattr(call, k) for k in ("id", "call_id", "name", "arguments", "function") if hasattr(call, k)}


@dataclass
class Episode:
    """The episode an agent function runs."""

    episode_id: EpisodeKey
    task: common_pb2.Task
    messages: list[dict[str, Any]]
    """The task's input (and the environment's opening observations), in the chat shape."""
    tools: list[dict[str, Any]]
    """The episode's tools in the Chat Completions shape (`{"type": "function", "function": {...}}`)."""
    client: Any
    """`openai.AsyncOpenAI` pointed at the model role, episode and run in its default headers."""
    model: str
    """The model name to pass to `client` (the model role's stable name)."""
    call_tool: ToolCaller
    env: dict[str, Any] = field(default_factory=dict)
    """The task's `env_json`, parsed."""

    @property
    def response_tools(self) -> list[dict[str, Any]]:
        """The tools in the Responses API shape (`{"type": "function", "name": ...}`)."""
        return [{"type": "function", **t["function"]} for t in self.tools]

    @property
    def sampling(self) -> dict[str, Any]:
        """The task's sampling parameters as Chat Completions keyword arguments."""
        params = self.task.sampling
        out: dict[str, Any] = {}
        if params.HasField("temperature"):
            out["temperature"] = params.temperature
        if params.HasField("top_p"):
            out["top_p"] = params.top_p
        if params.HasField("seed"):
            out["seed"] = params.seed
        if params.max_tokens:
            out["max_tokens"] = params.max_tokens
        if params.stop:
            out["stop"] = list(params.stop)
        return out
