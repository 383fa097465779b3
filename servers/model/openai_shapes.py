"""OpenAI wire shapes to and from `GenerateRequest` / `GenerateResponse` (no HTTP here).

Chat Completions and the Responses API subset NeMo Gym agents use (message, function_call
and function_call_output input items; function tools) become one `GenerateRequest`, so
the model role's own template, tokenizer and tool-call parser do the rest. Replies carry
the vLLM-style extra fields RL code reads: `prompt_token_ids` and, per choice, `token_ids`
(the Responses API also puts `prompt_token_ids`, `generation_token_ids` and
`generation_log_probs` on each output item, as NeMo Gym's vLLM model server does).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gymrpc.errors import InvalidArgument
from gymrpc.messages import ROLES
from gymrpc.v1 import common_pb2
from gymrpc.v1 import model_service_pb2 as pb

MAX_JSON_DEPTH = 64
FINISH_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
    common_pb2.FINISH_REASON_ABORTED: "stop",
}


@dataclass
class Parsed:
    """A request in protocol terms, plus what the reply needs to echo."""

    request: pb.GenerateRequest
    stream: bool
    model: str
    logprobs: bool = False
    top_logprobs: int = 0
    include_usage: bool = False
    metadata: dict[str, str] | None = None


def bad(message: str, param: str | None = None) -> InvalidArgument:
    return InvalidArgument(message, metadata={"field": param} if param else None)


def check_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse JSON nested deeper than `limit` (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            raise bad(f"the request body is nested deeper than {limit} levels")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def _get(body: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise bad(f"{key} must be a number, got a boolean", key)
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise bad(f"{key} must be a {names}, got {type(value).__name__}", key)
    return value


def _text(content: Any, where: str) -> str:
    """A message's content: a string or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
                raise bad(f"{where}[{k}]: only text content parts are supported", where)
            text = part.get("text")
            if not isinstance(text, str):
                raise bad(f"{where}[{k}].text must be a string", where)
            parts.append(text)
        return "".join(parts)
    raise bad(f"{where} must be a string or a list of text parts", where)


def _sampling(body: Mapping[str, Any], max_key: tuple[str, ...]) -> common_pb2.SamplingParams:
    sampling = common_pb2.SamplingParams()
    temperature = _get(body, "temperature", (int, float))
    if temperature is not None:
        sampling.temperature = float(temperature)
    top_p = _get(body, "top_p", (int, float))
    if top_p is not None:
        sampling.top_p = float(top_p)
    seed = _get(body, "seed", int)
    if seed is not None:
        sampling.seed = seed
    for key in max_key:
        value = _get(body, key, int)
        if value is not None:
            if value < 1:
                raise bad(f"{key} must be at least 1, got {value}", key)
            sampling.max_tokens = value
            break
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad("stop must be a string or a list of strings", "stop")
        sampling.stop.extend(stops)
    return sampling


def _metadata(body: Mapping[str, Any]) -> dict[str, str] | None:
    metadata = _get(body, "metadata", dict)
    if metadata is not None and not all(isinstance(v, str) for v in metadata.values()):
        raise bad("metadata values must be strings", "metadata")
    return metadata


def _tool(spec: Any, where: str, *, nested: bool) -> common_pb2.ToolDefinition:
    if not isinstance(spec, dict) or spec.get("type", "function") != "function":
        raise bad(f"{where}: only function tools are supported", where)
    function = spec.get("function") if nested else spec
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad(f"{where} needs a function name", where)
    parameters = function.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise bad(f"{where}.parameters must be a JSON object", where)
    return common_pb2.ToolDefinition(
        name=function["name"],
        description=function.get("description") or "",
        parameters_json_schema=json.dumps(parameters, sort_keys=True),
        strict=bool(function.get("strict")),
    )


def _tools(body: Mapping[str, Any], *, nested: bool) -> list[common_pb2.ToolDefinition]:
    tools = _get(body, "tools", list, [])
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none", None):
        raise bad("tool_choice: only 'auto' and 'none' are supported", "tool_choice")
    if choice == "none":
        return []
    return [_tool(t, f"tools[{i}]", nested=nested) for i, t in enumerate(tools)]


def _call(call: Any, where: str) -> common_pb2.ToolCall:
    if not isinstance(call, dict):
        raise bad(f"{where} must be an object", where)
    function = call.get("function", call)
    arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise bad(f"{where} needs a function name and arguments as a JSON string", where)
    return common_pb2.ToolCall(id=str(call.get("id") or call.get("call_id") or ""), name=name, arguments_json=arguments)


def _role(role: Any, where: str) -> int:
    if role not in ROLES:
        raise bad(f"{where}.role {role!r} is not one of {sorted(ROLES)}", f"{where}.role")
    return ROLES[role]


def _common(body: Any) -> tuple[str, bool]:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = _get(body, "model", str)
    if not model:
        raise bad("model is required", "model")
    n = _get(body, "n", int, 1)
    if n != 1:
        raise bad("n: only one choice per request is supported", "n")
    return model, bool(_get(body, "stream", bool, False))


# -- Chat Completions ------------------------------------------------------------------------


def chat_request(body: Any) -> Parsed:
    model, stream = _common(body)
    raw = _get(body, "messages", list)
    if not raw:
        raise bad("messages is required and must not be empty", "messages")
    messages = []
    for i, item in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object", where)
        message = common_pb2.Message(
            role=_role(item.get("role"), where),  # type: ignore[arg-type]
            content=_text(item.get("content"), f"{where}.content"),
            tool_call_id=str(item.get("tool_call_id") or ""),
            name=str(item.get("name") or ""),
            reasoning_content=str(item.get("reasoning_content") or item.get("reasoning") or ""),
        )
        message.tool_calls.extend(
            _call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(item.get("tool_calls") or ())
        )
        messages.append(message)
    sampling = _sampling(body, ("max_completion_tokens", "max_tokens"))
    logprobs = bool(_get(body, "logprobs", bool, False))
    top = _get(body, "top_logprobs", int, 0)
    if top and not logprobs:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    sampling.top_logprobs = max(top, 1) if logprobs else 0
    options = _get(body, "stream_options", dict, {})
    request = pb.GenerateRequest(messages=messages, tools=_tools(body, nested=True), sampling=sampling)
    return Parsed(request, stream, model, logprobs, top, bool(options.get("include_usage")), _metadata(body))


def _logprobs(tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[float]) -> dict[str, Any] | None:
    if len(logprobs) != len(token_ids):
        return None
    content = []
    for token, logprob in zip(token_ids, logprobs, strict=True):
        text = tokenizer.decode([token])
        content.append({"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []})
    return {"content": content, "refusal": None}


def chat_message(message: common_pb2.Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": message.content or None}
    if message.reasoning_content:
        out["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
            for c in message.tool_calls
        ]
    return out


def usage(response: pb.GenerateResponse) -> dict[str, int]:
    prompt, completion = response.usage.input_tokens, response.usage.output_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_response(
    parsed: Parsed, response: pb.GenerateResponse, *, ident: str, created: int, tokenizer: Any, extra: dict[str, Any]
) -> dict[str, Any]:
    tokens = response.tokens
    choice: dict[str, Any] = {
        "index": 0,
        "message": chat_message(response.message),
        "finish_reason": FINISH_NAMES.get(response.finish_reason, "stop"),
        "logprobs": _logprobs(tokenizer, tokens.completion_token_ids, tokens.completion_logprobs)
        if parsed.logprobs
        else None,
        "token_ids": list(tokens.completion_token_ids),
    }
    return {
        "id": ident,
        "object": "chat.completion",
        "created": created,
        "model": parsed.model,
        "choices": [choice],
        "usage": usage(response),
        "prompt_token_ids": list(tokens.prompt_token_ids),
        "weight_version": response.weight_version,
        **extra,
    }


def chat_chunk(parsed: Parsed, ident: str, created: int, choice: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    return {
        "id": ident,
        "object": "chat.completion.chunk",
        "created": created,
        "model": parsed.model,
        "choices": [] if choice is None else [choice],
        **extra,
    }


def chat_delta_logprobs(parsed: Parsed, tokenizer: Any, delta: pb.TokenDelta) -> dict[str, Any] | None:
    return _logprobs(tokenizer, delta.token_ids, delta.logprobs) if parsed.logprobs else None


# -- Responses API ---------------------------------------------------------------------------


def responses_request(body: Any) -> Parsed:
    model, stream = _common(body)
    if body.get("previous_response_id"):
        raise bad("previous_response_id is not supported: send the whole conversation in input", "previous_response_id")
    messages: list[common_pb2.Message] = []
    instructions = _get(body, "instructions", str)
    if instructions:
        messages.append(common_pb2.Message(role=common_pb2.ROLE_SYSTEM, content=instructions))
    raw = body.get("input")
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad("input is required: a string or a non-empty list of items", "input")
    names: dict[str, str] = {}
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(
                common_pb2.Message(
                    role=_role(item.get("role"), where),  # type: ignore[arg-type]
                    content=_text(item.get("content"), f"{where}.content"),
                )
            )
        elif kind == "function_call":
            call = _call(item, where)
            names[call.id] = call.name
            last = messages[-1] if messages else None
            if last is None or last.role != common_pb2.ROLE_ASSISTANT or last.tool_call_id:
                last = common_pb2.Message(role=common_pb2.ROLE_ASSISTANT)
                messages.append(last)
            last.tool_calls.append(call)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            output = item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, str):
                raise bad(f"{where} needs call_id and output as strings", where)
            messages.append(
                common_pb2.Message(
                    role=common_pb2.ROLE_TOOL, tool_call_id=call_id, name=names.get(call_id, ""), content=output
                )
            )
        elif kind == "reasoning":
            continue  # the model role re-renders its own replies from their token ids
        else:
            raise bad(f"{where}.type {kind!r} is not supported (message, function_call, function_call_output)", where)
    sampling = _sampling(body, ("max_output_tokens",))
    request = pb.GenerateRequest(messages=messages, tools=_tools(body, nested=False), sampling=sampling)
    return Parsed(request, stream, model, metadata=_metadata(body))


def response_items(response: pb.GenerateResponse, ident: str) -> list[dict[str, Any]]:
    message, tokens = response.message, response.tokens
    extra = {
        "prompt_token_ids": list(tokens.prompt_token_ids),
        "generation_token_ids": list(tokens.completion_token_ids),
        "generation_log_probs": list(tokens.completion_logprobs),
    }
    items: list[dict[str, Any]] = []
    if message.reasoning_content:
        items.append(
            {
                "type": "reasoning",
                "id": f"rs_{ident}",
                "summary": [{"type": "summary_text", "text": message.reasoning_content}],
            }
        )
    if message.content or not message.tool_calls:
        items.append(
            {
                "type": "message",
                "id": f"msg_{ident}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": message.content, "annotations": []}],
            }
        )
    for call in message.tool_calls:
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{call.id}",
                "call_id": call.id,
                "name": call.name,
                "arguments": call.arguments_json,
                "status": "completed",
            }
        )
    for item in items:
        item.update(extra)
    return items


def responses_object(
    parsed: Parsed,
    response: pb.GenerateResponse | None,
    *,
    ident: str,
    created: int,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """A Response; `response` None is the in-progress shell a stream starts with."""
    out: dict[str, Any] = {
        "id": f"resp_{ident}",
        "object": "response",
        "created_at": created,
        "model": parsed.model,
        "status": "in_progress",
        "output": [],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [
            {
                "type": "function",
                "name": t.name,
                "description": t.description,
                "parameters": json.loads(t.parameters_json_schema or "{}"),
                "strict": t.strict,
            }
            for t in parsed.request.tools
        ],
        "metadata": parsed.metadata or {},
        "error": None,
        "incomplete_details": None,
        **extra,
    }
    if response is None:
        return out
    length = response.finish_reason == common_pb2.FINISH_REASON_LENGTH
    out["status"] = "incomplete" if length else "completed"
    out["incomplete_details"] = {"reason": "max_output_tokens"} if length else None
    out["output"] = response_items(response, ident)
    prompt, completion = response.usage.input_tokens, response.usage.output_tokens
    out["usage"] = {
        "input_tokens": prompt,
        "output_tokens": completion,
        "total_tokens": prompt + completion,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0},
    }
    out["prompt_token_ids"] = list(response.tokens.prompt_token_ids)
    out["token_ids"] = list(response.tokens.completion_token_ids)
    out["weight_version"] = response.weight_version
    return out
