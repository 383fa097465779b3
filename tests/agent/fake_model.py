"""FAKE model server for fast agent tests: a scripted `ModelService` that plays the example tasks.

Not the real model role (`servers/model`): no templating, no tokenizer. It reads the task
text and answers deterministically from the conversation alone, so a repeated request
gets the same reply (idempotent per request id by construction):
- counter tasks ("add 1 then add 2 then get the count"): one `increment_counter` call per
  number, then `get_counter_value`, then a final answer quoting the count;
- no tools offered (blackjack, a text-turn game): `<action>stand</action>`.
Markers in the first user message inject model mistakes before the plan:
`[fake:unknown-tool]`, `[fake:bad-args]`, `[fake:nameless]`, `[fake:empty]`, `[fake:length]`.
`[fake:sampled]` gives every generation's tool call a fresh random id, as a sampling model's
generations differ: a repeated request is then not answered with the same reply.

Served as its own process: `python -m tests.agent.fake_model --name model/policy --registry ...`.
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
from dataclasses import dataclass

import grpc

from gymrpc.v1 import common_pb2
from gymrpc.v1 import model_service_pb2 as pb
from gymrpc.v1 import model_service_pb2_grpc as pb_grpc

WEIGHT_VERSION = "fake:0"
STAND = "I will stand. <action>stand</action>"


@dataclass(frozen=True)
class Action:
    """One scripted reply: text, at most one tool call, and how generation ended."""

    content: str = ""
    tool: str | None = None
    arguments: str = "{}"
    finish_reason: int = common_pb2.FINISH_REASON_STOP


_QUIRKS = {
    "unknown-tool": Action(tool="no_such_tool"),
    "bad-args": Action(tool="increment_counter", arguments='{"count": oops'),
    "nameless": Action(tool=""),
    "empty": Action(),
    "length": Action(content="I will add", finish_reason=common_pb2.FINISH_REASON_LENGTH),
}


def plan(request: pb.GenerateRequest) -> list[Action]:
    """The whole scripted episode for this conversation's task."""
    text = next((m.content for m in request.messages if m.role == common_pb2.ROLE_USER), "")
    actions = [_QUIRKS[q] for q in re.findall(r"\[fake:([a-z-]+)\]", text) if q in _QUIRKS]
    if not request.tools:
        return [*actions, Action(content=STAND)]
    actions += [
        Action(tool="increment_counter", arguments=json.dumps({"count": int(n)}))
        for n in re.findall(r"add (-?\d+)", text)
    ]
    actions.append(Action(tool="get_counter_value"))
    last = request.messages[-1].content if request.messages else ""
    actions.append(Action(content=f"Done. The counter says {last}"))
    return actions


def reply_for(request: pb.GenerateRequest) -> pb.GenerateResponse:
    step = sum(1 for m in request.messages if m.role == common_pb2.ROLE_ASSISTANT)
    actions = plan(request)
    action = actions[min(step, len(actions) - 1)]
    message = common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, content=action.content)
    finish = action.finish_reason
    if action.tool is not None:
        sampled = any("[fake:sampled]" in m.content for m in request.messages if m.role == common_pb2.ROLE_USER)
        call_id = f"fake_{step}_{secrets.token_hex(4)}" if sampled else f"fake_{step}"
        message.tool_calls.add(id=call_id, name=action.tool, arguments_json=action.arguments)
        finish = common_pb2.FINISH_REASON_TOOL_CALLS
    prompt = [len(m.content) % 1000 for m in request.messages]
    completion = list((action.content + (action.tool or "") + action.arguments).encode())[:32]
    return pb.GenerateResponse(
        message=message,
        tokens=common_pb2.TokenTrace(
            prompt_token_ids=prompt,
            completion_token_ids=completion,
            completion_logprobs=[-0.25] * len(completion),
        ),
        finish_reason=finish,
        weight_version=WEIGHT_VERSION,
        usage=common_pb2.Usage(input_tokens=len(prompt), output_tokens=len(completion)),
    )


class FakeModelServicer(pb_grpc.ModelServiceServicer):
    """FAKE `ModelService` (see the module docstring); keeps every request for assertions."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        self.requests.append(request)
        return reply_for(request)

    async def GenerateStream(self, request: pb.GenerateStreamRequest, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        yield pb.GenerateStreamResponse(final=reply_for(request.request))


def main() -> None:
    from gymrpc.servers.bootstrap import ServiceBinding, add_common_arguments, config_from_arguments, run, serve

    parser = argparse.ArgumentParser(prog="python -m tests.agent.fake_model", description=__doc__)
    add_common_arguments(parser, default_name="model/policy")
    args = parser.parse_args()
    config = config_from_arguments(args)

    async def main_async() -> None:
        binding = ServiceBinding(
            pb.DESCRIPTOR.services_by_name["ModelService"],
            FakeModelServicer(),
            pb_grpc.add_ModelServiceServicer_to_server,
        )
        await serve(config, [binding])

    run("model:fake", main_async, args)


if __name__ == "__main__":
    main()
