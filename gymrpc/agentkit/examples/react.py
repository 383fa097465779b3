"""A minimal ReAct agent written against the openai SDK only: think, call tools, repeat, answer.

    role: agent
    args: {entrypoint: "gymrpc.agentkit.examples.react:solve", resources: resources/counter}

Nothing here knows about gymrpc beyond the `Episode` it is given: the client is a plain
`openai.AsyncOpenAI`, and the loop is what one would write for any OpenAI-compatible server.
"""

from __future__ import annotations

from typing import Any

from gymrpc.agentkit import Episode

MAX_TURNS = 8


async def solve(episode: Episode) -> list[dict[str, Any]]:
    """Chat Completions with tools until the model answers without calling one (or turns run out)."""
    messages: list[dict[str, Any]] = list(episode.messages)
    for _ in range(MAX_TURNS):
        reply = await episode.client.chat.completions.create(
            model=episode.model, messages=messages, tools=episode.tools or None, **episode.sampling
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            output = await episode.call_tool(call)
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": output})
    return messages


async def solve_responses(episode: Episode) -> list[dict[str, Any]]:
    """The same loop over the Responses API, the way NeMo Gym agents talk to a model."""
    items: list[dict[str, Any]] = [
        {"type": "message", "role": m["role"], "content": m["content"]} for m in episode.messages
    ]
    messages: list[dict[str, Any]] = list(episode.messages)
    for _ in range(MAX_TURNS):
        response = await episode.client.responses.create(
            model=episode.model, input=items, tools=episode.response_tools or None
        )
        calls = [item for item in response.output if item.type == "function_call"]
        text = response.output_text
        messages.append(
            {
                "role": "assistant",
                "content": text,
                **({"tool_calls": [_chat_call(c) for c in calls]} if calls else {}),
            }
        )
        if not calls:
            break
        if text:
            items.append({"type": "message", "role": "assistant", "content": text})
        # The calls first, then their outputs: the order the model made them in (one assistant turn).
        items += [
            {"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments} for c in calls
        ]
        for call in calls:
            output = await episode.call_tool(call)
            items.append({"type": "function_call_output", "call_id": call.call_id, "output": output})
            messages.append({"role": "tool", "tool_call_id": call.call_id, "name": call.name, "content": output})
    return messages


def _chat_call(call: Any) -> dict[str, Any]:
    return {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
