"""Conversions between protocol messages and the plain dicts environments and templates use."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from gymrpc import safejson
from gymrpc.envkit import TaskSpec, ToolSpec
from gymrpc.errors import InvalidArgument
from gymrpc.v1 import common_pb2

ROLE_NAMES = {
    common_pb2.ROLE_SYSTEM: "system",
    common_pb2.ROLE_USER: "user",
    common_pb2.ROLE_ASSISTANT: "assistant",
    common_pb2.ROLE_TOOL: "tool",
    common_pb2.ROLE_DEVELOPER: "developer",
}
ROLES = {v: k for k, v in ROLE_NAMES.items()}


def message_to_dict(message: common_pb2.Message) -> dict[str, Any]:
    """OpenAI chat shape; only fields that are set."""
    if message.role not in ROLE_NAMES:
        raise InvalidArgument(f"message role {message.role} is not a known Role", metadata={"field": "role"})
    out: dict[str, Any] = {"role": ROLE_NAMES[message.role], "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
            for c in message.tool_calls
        ]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.name:
        out["name"] = message.name
    if message.reasoning_content:
        out["reasoning_content"] = message.reasoning_content
    return out


def message_from_dict(data: Mapping[str, Any]) -> common_pb2.Message:
    role = data.get("role")
    if role not in ROLES:
        raise InvalidArgument(f"message role {role!r} is not one of {sorted(ROLES)}", metadata={"field": "role"})
    content = data.get("content") or ""
    if not isinstance(content, str):
        raise InvalidArgument("message content must be a string", metadata={"field": "content"})
    calls = []
    for call in data.get("tool_calls") or ():
        function = call.get("function", call)
        arguments = function.get("arguments", "{}")
        calls.append(
            common_pb2.ToolCall(
                id=str(call.get("id", "")),
                name=str(function.get("name", "")),
                arguments_json=arguments if isinstance(arguments, str) else json.dumps(arguments),
            )
        )
    return common_pb2.Message(
        role=ROLES[role],
        content=content,
        tool_calls=calls,
        tool_call_id=data.get("tool_call_id", ""),
        name=data.get("name", ""),
        reasoning_content=data.get("reasoning_content", ""),
    )


def tool_definition(spec: ToolSpec) -> common_pb2.ToolDefinition:
    return common_pb2.ToolDefinition(
        name=spec.name,
        description=spec.description,
        parameters_json_schema=json.dumps(spec.parameters, sort_keys=True),
        strict=spec.strict,
    )


def tool_definition_to_dict(tool: common_pb2.ToolDefinition) -> dict[str, Any]:
    """OpenAI function-tool shape, as chat templates expect it."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": parse_json_object(tool.parameters_json_schema, "parameters_json_schema"),
        },
    }


def parse_json_object(text: str, field: str) -> dict[str, Any]:
    """Parse a JSON object sent as text; INVALID_ARGUMENT naming the field otherwise."""
    if not text:
        return {}
    try:
        value = safejson.loads(text)
    except safejson.JsonLimit as exc:
        raise InvalidArgument(f"{field} is refused: {exc}", metadata={"field": field}) from None
    except ValueError as exc:
        raise InvalidArgument(f"{field} is not valid JSON: {exc}", metadata={"field": field}) from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{field} must be a JSON object, got {type(value).__name__}", metadata={"field": field})
    return value


def task_spec(task: common_pb2.Task) -> TaskSpec:
    return TaskSpec(
        task_id=task.task_id,
        input=[message_to_dict(m) for m in task.input],
        fields=parse_json_object(task.env_json, "task.env_json"),
    )


def messages_to_dicts(messages: Iterable[common_pb2.Message]) -> list[dict[str, Any]]:
    return [message_to_dict(m) for m in messages]


def fingerprint(message: Any) -> str:
    """sha256 of a message's deterministic encoding: equal content, equal fingerprint."""
    return "sha256:" + hashlib.sha256(message.SerializeToString(deterministic=True)).hexdigest()


def task_from_row(row: Mapping[str, Any], task_id: str = "") -> common_pb2.Task:
    """A protocol `Task` from a reference JSONL row (`responses_create_params` plus env fields)."""
    from gymrpc.envkit import task_from_row as spec_from_row

    spec = spec_from_row(row, task_id)
    params = row.get("responses_create_params") or {}
    tools = []
    for tool in params.get("tools") or ():
        function = tool.get("function", tool)
        tools.append(
            common_pb2.ToolDefinition(
                name=function["name"],
                description=function.get("description", ""),
                parameters_json_schema=json.dumps(function.get("parameters", {}), sort_keys=True),
                strict=bool(function.get("strict", False)),
            )
        )
    sampling = common_pb2.SamplingParams()
    if params.get("temperature") is not None:
        sampling.temperature = float(params["temperature"])
    if params.get("top_p") is not None:
        sampling.top_p = float(params["top_p"])
    if params.get("max_output_tokens"):
        sampling.max_tokens = int(params["max_output_tokens"])
    return common_pb2.Task(
        task_id=spec.task_id,
        input=[message_from_dict(m) for m in spec.input],
        tools=tools,
        env_json=json.dumps(dict(spec.fields), sort_keys=True),
        sampling=sampling,
    )
