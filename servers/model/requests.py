"""Validation of `GenerateRequest`s: every refusal is INVALID_ARGUMENT naming the field and the fix.

Checked before anything is rendered or generated, so a bad request costs nothing
and changes nothing (in particular, it never takes a `request_id` in the cache).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from gymrpc.errors import InvalidArgument
from gymrpc.ids import check_attempt, check_id
from gymrpc.messages import ROLE_NAMES, parse_json_object
from gymrpc.servers.model.backends.base import Sampling
from gymrpc.v1 import common_pb2
from gymrpc.v1 import model_service_pb2 as pb

MAX_REQUEST_ID = 256
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
TEMPERATURE_RANGE = (0.0, 2.0)


@dataclass(frozen=True)
class Limits:
    default_max_tokens: int = 1024
    max_tokens: int = 32768
    """The largest `max_tokens` a request may ask for."""
    max_prompt_tokens: int = 131072
    max_prompt_bytes: int = 4 << 20
    """The largest request, in bytes, that is rendered at all: checked before tokenising, so an
    oversized prompt is refused at once instead of occupying the server while it is tokenised."""


@dataclass(frozen=True)
class Checked:
    """A validated request in the shapes the template and the backends take."""

    request_id: str
    rollout_id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    sampling: Sampling


def _bad(message: str, field: str) -> InvalidArgument:
    return InvalidArgument(message, metadata={"field": field})


def check_request(request: pb.GenerateRequest, limits: Limits, stop_token_ids: tuple[int, ...]) -> Checked:
    size = request.ByteSize()
    if size > limits.max_prompt_bytes:
        raise _bad(
            f"the request is {size} bytes; this server renders requests of at most {limits.max_prompt_bytes} bytes "
            "(--max-prompt-bytes); shorten the conversation",
            "messages",
        )
    request_id = request.request_id
    if not request_id:
        raise _bad("request_id is empty; give every model call a unique id (retries reuse it)", "request_id")
    if len(request_id) > MAX_REQUEST_ID or not request_id.isprintable():
        raise _bad(f"request_id must be printable and at most {MAX_REQUEST_ID} characters", "request_id")
    rollout_id = request.episode_id.rollout_id
    if rollout_id:
        check_id(rollout_id, "episode_id.rollout_id")
    check_attempt(request.episode_id.attempt, "episode_id.attempt")
    return Checked(
        request_id=request_id,
        rollout_id=rollout_id,
        messages=_messages(request.messages),
        tools=_tools(request.tools),
        sampling=_sampling(request.sampling, limits, stop_token_ids),
    )


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not messages:
        raise _bad("messages is empty; send at least the user's opening message", "messages")
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if message.role == common_pb2.ROLE_UNSPECIFIED:
            raise _bad(f"{where}.role is ROLE_UNSPECIFIED; set a Role (USER, ASSISTANT, TOOL, ...)", f"{where}.role")
        # The protocol says unknown (newer) roles are treated as user text.
        role = ROLE_NAMES.get(message.role, "user")
        item: dict[str, Any] = {"role": role, "content": message.content}
        if role == "assistant":
            if message.reasoning_content:
                item["reasoning_content"] = message.reasoning_content
            calls = []
            for k, call in enumerate(message.tool_calls):
                if not call.name:
                    raise _bad(f"{where}.tool_calls[{k}].name is empty", f"{where}.tool_calls")
                calls.append(
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments_json or "{}"},
                    }
                )
            if calls:
                item["tool_calls"] = calls
        elif message.tool_calls:
            raise _bad(f"{where} has tool_calls but role {role}; only assistant messages call tools", where)
        if role == "tool":
            previous = out[-1]["role"] if out else None
            if previous not in ("assistant", "tool"):
                raise _bad(f"{where} is a tool result, but no assistant message precedes it", f"{where}.role")
            item["tool_call_id"] = message.tool_call_id
            if message.name:
                item["name"] = message.name
        out.append(item)
    if out[-1]["role"] not in ("user", "tool"):
        raise _bad(
            f"the last message is a {out[-1]['role']} message; Generate answers a user or tool turn "
            "(continuing an assistant message is not supported)",
            f"messages[{len(out) - 1}].role",
        )
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    """The tools in the template's shape, parsed once per distinct tool list.

    Every call of every episode of a task set sends the same list (workplace: 27 schemas, about half
    a millisecond to parse and depth-check): the parsed dicts are shared between calls, read only.
    """
    return list(_parsed_tools(tuple((t.name, t.description, t.parameters_json_schema) for t in tools)))


@functools.lru_cache(maxsize=256)
def _parsed_tools(tools: tuple[tuple[str, str, str], ...]) -> tuple[dict[str, Any], ...]:
    out, seen = [], set()
    for index, (name, description, schema) in enumerate(tools):
        where = f"tools[{index}]"
        if not name:
            raise _bad(f"{where}.name is empty", f"{where}.name")
        if name in seen:
            raise _bad(f"{where}.name {name!r} is listed twice", f"{where}.name")
        seen.add(name)
        parameters = parse_json_object(schema or "{}", f"{where}.parameters_json_schema")
        function = {"name": name, "description": description, "parameters": parameters}
        out.append({"type": "function", "function": function})
    return tuple(out)


def _sampling(params: common_pb2.SamplingParams, limits: Limits, stop_token_ids: tuple[int, ...]) -> Sampling:
    temperature = params.temperature if params.HasField("temperature") else None
    low, high = TEMPERATURE_RANGE
    if temperature is not None and not (math.isfinite(temperature) and low <= temperature <= high):
        raise _bad(f"sampling.temperature {temperature} is out of range [{low}, {high}]", "sampling.temperature")
    top_p = params.top_p if params.HasField("top_p") else None
    if top_p is not None and not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise _bad(f"sampling.top_p {top_p} is out of range (0, 1]", "sampling.top_p")
    if params.max_tokens > limits.max_tokens:
        raise _bad(
            f"sampling.max_tokens {params.max_tokens} exceeds this server's limit {limits.max_tokens}",
            "sampling.max_tokens",
        )
    if params.top_logprobs > MAX_TOP_LOGPROBS:
        raise _bad(f"sampling.top_logprobs {params.top_logprobs} exceeds {MAX_TOP_LOGPROBS}", "sampling.top_logprobs")
    if len(params.stop) > MAX_STOP_STRINGS or any(not s for s in params.stop):
        raise _bad(f"sampling.stop takes at most {MAX_STOP_STRINGS} non-empty strings", "sampling.stop")
    return Sampling(
        max_tokens=params.max_tokens or limits.default_max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=params.seed if params.HasField("seed") else None,
        stop=tuple(params.stop),
        top_logprobs=params.top_logprobs,
        stop_token_ids=stop_token_ids,
    )
