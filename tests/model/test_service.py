"""`ModelService` over real gRPC: Generate, GenerateStream, idempotency, input validation, the CLI."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from gymrpc.chat import default_tokenizer
from gymrpc.errors import from_rpc_error
from gymrpc.servers.model.backends.base import CompletionDelta, Conversation, Sampling
from gymrpc.servers.model.backends.scripted import ScriptedBackend
from gymrpc.servers.model.backends.sources import CounterSolver
from gymrpc.servers.model.requests import Limits, check_request
from gymrpc.servers.model.service import ModelServicer
from gymrpc.v1 import common_pb2
from gymrpc.v1 import model_service_pb2 as pb
from gymrpc.v1 import model_service_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
USER = common_pb2.ROLE_USER
TOOLS = [common_pb2.ToolDefinition(name="increment_counter", parameters_json_schema='{"type": "object"}'),
         common_pb2.ToolDefinition(name="get_counter_value", parameters_json_schema="{}")]  # fmt: skip


class CountingBackend(ScriptedBackend):
    """Scripted, counting how many generations really ran."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(default_tokenizer(), [CounterSolver()], **kwargs)
        self.runs = 0

    async def stream(
        self, prompt_token_ids: Sequence[int], sampling: Sampling, request_id: str, *,
        conversation: Conversation | None = None,
    ) -> AsyncIterator[CompletionDelta]:  # fmt: skip
        self.runs += 1
        async for delta in super().stream(prompt_token_ids, sampling, request_id, conversation=conversation):
            yield delta


def _request(request_id: str = "ep/a0/step0", text: str = "add 4 then add 5 then get the count",
             **sampling: Any) -> pb.GenerateRequest:  # fmt: skip
    return pb.GenerateRequest(
        request_id=request_id,
        episode_id=common_pb2.EpisodeId(rollout_id="ep"),
        messages=[common_pb2.Message(role=USER, content=text)],
        tools=TOOLS,
        sampling=common_pb2.SamplingParams(**sampling),
    )


def _servicer(**kwargs: Any) -> tuple[ModelServicer, CountingBackend]:
    backend = CountingBackend(token_delay=kwargs.pop("token_delay", 0.0))
    return ModelServicer(backend, default_tokenizer(), **kwargs), backend


def test_counter_episodes_over_grpc(serve_model: Any, play_counter: Any, counter_rows: list[dict[str, Any]]) -> None:
    async def main() -> None:
        servicer, _ = _servicer()
        async with serve_model(servicer) as stub:
            for index, row in enumerate(counter_rows):
                episode = await play_counter(stub.Generate, row, f"grpc{index}")
                assert episode.reward == 1.0

    asyncio.run(main())


def test_stream_sends_deltas_then_the_final_response(serve_model: Any) -> None:
    async def main() -> None:
        servicer, _ = _servicer()
        async with serve_model(servicer) as stub:
            events = [e async for e in stub.GenerateStream(pb.GenerateStreamRequest(request=_request()))]
        kinds = [e.WhichOneof("event") for e in events]
        assert kinds[-1] == "final"
        assert set(kinds[:-1]) == {"delta"}
        final = events[-1].final
        deltas = [e.delta for e in events[:-1]]
        assert [t for d in deltas for t in d.token_ids] == list(final.tokens.completion_token_ids)
        assert [x for d in deltas for x in d.logprobs] == list(final.tokens.completion_logprobs)
        text = "".join(d.text for d in deltas)
        assert text == default_tokenizer().decode(final.tokens.completion_token_ids[:-1])
        assert "<tool_call>" in text
        assert "<|im_end|>" not in text
        assert [json.loads(c.arguments_json) for c in final.message.tool_calls] == [
            {"count": 4},
            {"count": 5},
        ]
        assert final.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS

    asyncio.run(main())


def test_retries_return_the_first_response_and_generate_once(serve_model: Any) -> None:
    async def main() -> None:
        servicer, backend = _servicer(token_delay=0.002)
        async with serve_model(servicer) as stub:
            concurrent = await asyncio.gather(*(stub.Generate(_request()) for _ in range(4)))
            again = await stub.Generate(_request())
            streamed = [e async for e in stub.GenerateStream(pb.GenerateStreamRequest(request=_request()))]
        assert backend.runs == 1
        assert all(r == again for r in concurrent)
        assert streamed[-1].final == again
        assert [t for e in streamed[:-1] for t in e.delta.token_ids] == list(again.tokens.completion_token_ids)

    asyncio.run(main())


def test_a_dropped_stream_keeps_generating_for_its_retry(serve_model: Any) -> None:
    async def main() -> None:
        servicer, backend = _servicer(token_delay=0.01)
        request = pb.GenerateStreamRequest(request=_request())
        async with serve_model(servicer) as stub:
            call = stub.GenerateStream(request)
            seen = 0
            async for _ in call:
                seen += 1
                if seen == 3:
                    call.cancel()
                    break
            retry = [e async for e in stub.GenerateStream(request)]
        assert backend.runs == 1
        final = retry[-1].final
        # Every token from the first (one delta per token while running, one merged delta once done).
        assert [t for e in retry[:-1] for t in e.delta.token_ids] == list(final.tokens.completion_token_ids)
        assert final.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS

    asyncio.run(main())


def test_a_timed_out_call_keeps_generating_for_its_retry(serve_model: Any) -> None:
    async def main() -> None:
        servicer, backend = _servicer(token_delay=0.01)
        async with serve_model(servicer) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Generate(_request(), timeout=0.1)
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            reply = await stub.Generate(_request(), timeout=10)
        assert backend.runs == 1
        assert reply.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS

    asyncio.run(main())


def test_same_request_id_with_other_content_is_already_exists(serve_model: Any) -> None:
    async def main() -> None:
        servicer, _ = _servicer()
        async with serve_model(servicer) as stub:
            await stub.Generate(_request())
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Generate(_request(text="add 1 then get the count"))
            assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert from_rpc_error(caught.value).reason == "REQUEST_ID_REUSED"
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Generate(_request(temperature=0.5))  # sampling is part of the request too
            assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS

    asyncio.run(main())


def test_the_cache_is_bounded_and_failures_are_not_cached(serve_model: Any) -> None:
    async def main() -> None:
        servicer, backend = _servicer(cache_size=2)
        async with serve_model(servicer) as stub:
            for k in range(3):
                await stub.Generate(_request(f"r{k}"))
            assert len(servicer.flights) == 2
            await stub.Generate(_request("r0", text="add 7 then get the count"))  # r0 was evicted: a new call
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Generate(_request("joke", text="tell me a joke"))
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert from_rpc_error(caught.value).reason == "NO_SCRIPTED_REPLY"
            backend.fallback = "No jokes today."
            reply = await stub.Generate(_request("joke", text="tell me a joke"))
            assert reply.message.content == "No jokes today."
            assert reply.finish_reason == common_pb2.FINISH_REASON_STOP

    asyncio.run(main())


def _bad(edit: Any) -> pb.GenerateRequest:
    request = _request()
    edit(request)
    return request


BAD_REQUESTS = {
    "empty request_id": (lambda r: setattr(r, "request_id", ""), "request_id is empty"),
    "bad rollout_id": (lambda r: setattr(r.episode_id, "rollout_id", "../etc"), "episode_id.rollout_id"),
    "no messages": (lambda r: r.ClearField("messages"), "messages is empty"),
    "unspecified role": (lambda r: r.messages.add(content="x"), "ROLE_UNSPECIFIED"),
    "ends with assistant": (lambda r: r.messages.add(role=common_pb2.ROLE_ASSISTANT, content="x"),
                            "last message is a assistant"),
    "orphan tool result": (lambda r: r.messages.insert(0, common_pb2.Message(role=common_pb2.ROLE_TOOL)),
                           "no assistant message precedes it"),
    "user with tool calls": (lambda r: r.messages[0].tool_calls.add(name="f"), "only assistant messages"),
    "nameless call": (lambda r: (r.messages.insert(0, common_pb2.Message(role=common_pb2.ROLE_ASSISTANT)),
                                 r.messages[0].tool_calls.add()), "tool_calls[0].name is empty"),
    "hot temperature": (lambda r: setattr(r.sampling, "temperature", 2.5), "temperature 2.5 is out of range"),
    "nan temperature": (lambda r: setattr(r.sampling, "temperature", math.nan), "temperature nan"),
    "zero top_p": (lambda r: setattr(r.sampling, "top_p", 0.0), "top_p 0.0 is out of range"),
    "big top_p": (lambda r: setattr(r.sampling, "top_p", 1.5), "top_p 1.5"),
    "huge max_tokens": (lambda r: setattr(r.sampling, "max_tokens", 10**6), "exceeds this server's limit"),
    "many top_logprobs": (lambda r: setattr(r.sampling, "top_logprobs", 50), "top_logprobs 50"),
    "empty stop": (lambda r: r.sampling.stop.append(""), "non-empty strings"),
    "bad schema": (lambda r: setattr(r.tools[0], "parameters_json_schema", "{oops"), "not valid JSON"),
    "duplicate tool": (lambda r: r.tools.append(common_pb2.ToolDefinition(name="get_counter_value")),
                       "listed twice"),
}  # fmt: skip


def test_a_tool_list_is_parsed_once_and_each_call_gets_its_own_list() -> None:
    first, again = (check_request(_request(f"r{k}"), Limits(), ()) for k in range(2))
    assert first.tools == again.tools
    assert first.tools is not again.tools, "a caller may extend its list without touching the next call's"
    assert all(a is b for a, b in zip(first.tools, again.tools, strict=True)), "the parsed schemas are shared"


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_input_is_invalid_argument_and_reserves_nothing(serve_model: Any, case: str) -> None:
    edit, message = BAD_REQUESTS[case]

    async def main() -> None:
        servicer, backend = _servicer()
        async with serve_model(servicer) as stub:
            bad = _bad(edit)
            for call in (
                stub.Generate(bad),
                _drain(stub.GenerateStream(pb.GenerateStreamRequest(request=bad))),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
                assert message in (caught.value.details() or "")
            assert backend.runs == 0
            assert len(servicer.flights) == 0
            if bad.request_id:
                await stub.Generate(_request(bad.request_id))  # the id is still free

    asyncio.run(main())


async def _drain(call: Any) -> list[Any]:
    return [event async for event in call]


def test_prompt_over_the_limit_is_invalid_argument(serve_model: Any) -> None:
    async def main() -> None:
        servicer, _ = _servicer(limits=Limits(max_prompt_tokens=50))
        async with serve_model(servicer) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Generate(_request())
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "at most 50" in (caught.value.details() or "")

    asyncio.run(main())


def test_server_process_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "gymrpc.servers.model", "--policy", "counter", "--weight-version", "iteration:3",
            "--ready-file", str(ready)]  # fmt: skip
    process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert process.poll() is None, process.communicate()[0].decode()
            assert time.monotonic() < deadline, "server never became ready"
            time.sleep(0.05)
        address = json.loads(ready.read_text())["address"]

        async def call() -> pb.GenerateResponse:
            async with grpc.aio.insecure_channel(address) as channel:
                return await pb_grpc.ModelServiceStub(channel).Generate(_request(), timeout=10)

        reply = asyncio.run(call())
        assert reply.weight_version == "iteration:3"
        assert len(reply.message.tool_calls) == 2
    finally:
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=30)[0].decode()
    assert process.returncode == 0, output


def test_cli_refuses_a_scripted_backend_without_sources() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "gymrpc.servers.model"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "needs --script, --recorded, --policy or --fallback" in done.stderr
