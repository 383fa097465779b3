"""The OpenAI-compatible upstream backend against a FAKE vLLM server (wire format only).

This is a fast test of the HTTP request and response shapes documented in
`reference/vllm.md` §3, not of vLLM itself: a small threaded HTTP server on
127.0.0.1:0 checks every request body and answers like vLLM's `/v1/completions`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from gymrpc.chat import default_tokenizer
from gymrpc.errors import Internal, InvalidArgument, Unavailable
from gymrpc.servers.model.backends.base import Finish, Sampling
from gymrpc.servers.model.backends.openai import OpenAIBackend
from gymrpc.servers.model.service import ModelServicer
from gymrpc.v1 import common_pb2
from gymrpc.v1 import model_service_pb2 as pb

REPLY = '<tool_call>\n{"name": "get_counter_value", "arguments": {}}\n</tool_call>'


class FakeVLLM:
    """State shared with the handler: what to answer, and every request seen."""

    def __init__(self) -> None:
        tok = default_tokenizer()
        self.reply_ids = [*tok.encode(REPLY), tok.im_end_id]
        self.requests: list[dict[str, Any]] = []
        self.aborted: set[str] = set()
        self.omit_token_ids = False
        self.chunk_delay = 0.0
        self.fail_with: tuple[int, str] | None = None
        self.bad_logprobs = False
        self.dev_calls: list[tuple[str, Any]] = []
        self.stage_error: str | None = None

    def shape_errors(self, body: dict[str, Any]) -> list[str]:
        problems = []
        if body.get("model") != "tiny":
            problems.append("model must be 'tiny'")
        prompt = body.get("prompt")
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            problems.append("prompt must be a non-empty list of token ids")
        for flag in ("return_token_ids", "return_tokens_as_token_ids"):
            if body.get(flag) is not True:
                problems.append(f"{flag} must be true")
        if not isinstance(body.get("logprobs"), int) or body["logprobs"] < 0:
            problems.append("logprobs must be a non-negative integer")
        if body.get("skip_special_tokens") is not False:
            problems.append("skip_special_tokens must be false")
        if body.get("stop_token_ids") != [2, 0]:
            problems.append("stop_token_ids must be [2, 0]")
        if not isinstance(body.get("max_tokens"), int) or not body.get("request_id"):
            problems.append("max_tokens and request_id are required")
        return problems

    def choice(self, ids: list[int], finish: str | None) -> dict[str, Any]:
        tok = default_tokenizer()
        logprobs = [-0.25 * (k + 1) for k in range(len(ids))]
        if self.bad_logprobs:
            logprobs = logprobs[:-1]
        choice: dict[str, Any] = {
            "index": 0,
            "text": tok.decode(ids),
            "logprobs": {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": logprobs,
                         "top_logprobs": [None] * len(ids), "text_offset": [0] * len(ids)},
            "finish_reason": finish,
            "stop_reason": None,
        }  # fmt: skip
        if not self.omit_token_ids:
            choice["token_ids"] = ids
        return choice


class Handler(BaseHTTPRequestHandler):
    fake: FakeVLLM

    def log_message(self, *args: Any) -> None:
        pass

    def _json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})
        else:
            self._json(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        fake = self.fake
        if self.path == "/abort_requests":
            fake.aborted.update(body["request_ids"])
            return self._json(200, {"status": "aborted", "aborted": len(body["request_ids"])})
        if self.path.split("?")[0] in ("/pause", "/resume", "/collective_rpc", "/update_weight_version"):
            fake.dev_calls.append((self.path, body))
            if self.path == "/collective_rpc" and body["method"] == "gymrpc_stage_weights" and fake.stage_error:
                return self._json(500, {"error": {"message": fake.stage_error}})
            return self._json(200, {"results": [None]} if self.path == "/collective_rpc" else {"status": "ok"})
        if self.path != "/v1/completions":
            return self._json(404, {"error": {"message": f"no route {self.path}"}})
        fake.requests.append(body)
        problems = fake.shape_errors(body)
        if problems:
            return self._json(400, {"error": {"message": "; ".join(problems), "type": "BadRequestError"}})
        if fake.fail_with is not None:
            return self._json(fake.fail_with[0], {"error": {"message": fake.fail_with[1]}})
        ids = fake.reply_ids[: body["max_tokens"]]
        finish = "stop" if len(ids) == len(fake.reply_ids) else "length"
        engine_id = f"cmpl-{body['request_id']}-0"
        if not body.get("stream"):
            choice = {**fake.choice(ids, finish), "prompt_token_ids": body["prompt"]}
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(ids)}
            payload = {"id": engine_id, "object": "text_completion", "model": "tiny", "choices": [choice]}
            return self._json(200, {**payload, "usage": usage})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for k, token in enumerate(ids):
            if engine_id in fake.aborted:
                self._event({"id": engine_id, "choices": [fake.choice([], "abort")]})
                break
            last = k == len(ids) - 1
            self._event({"id": engine_id, "choices": [fake.choice([token], finish if last else None)]})
            time.sleep(fake.chunk_delay)
        self._event({"id": engine_id, "choices": [], "usage": {"completion_tokens": len(ids)}})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _event(self, payload: Any) -> None:
        self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
        self.wfile.flush()


@pytest.fixture
def upstream() -> Iterator[tuple[str, FakeVLLM]]:
    fake = FakeVLLM()
    handler = type("BoundHandler", (Handler,), {"fake": fake})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", fake
    server.shutdown()
    server.server_close()


SAMPLING = Sampling(max_tokens=64, temperature=0.0, seed=3, stop_token_ids=(2, 0))


def test_generate_sends_token_ids_and_parses_ids_and_logprobs(upstream: tuple[str, FakeVLLM]) -> None:
    url, fake = upstream

    async def main() -> None:
        backend = OpenAIBackend(url + "/v1", weight_version="iteration:7")
        completion = await backend.generate([1, 5, 9], SAMPLING, "ep/a0/step0")
        await backend.close()
        assert completion.token_ids == tuple(fake.reply_ids)
        assert completion.logprobs == tuple(-0.25 * (k + 1) for k in range(len(fake.reply_ids)))
        assert completion.finish is Finish.STOP
        assert completion.weight_version == "iteration:7"
        sent = fake.requests[-1]
        assert sent["prompt"] == [1, 5, 9]
        assert sent["request_id"] == "ep/a0/step0"
        assert (sent["temperature"], sent["seed"], sent["stream"]) == (0.0, 3, False)
        assert "top_p" not in sent
        assert "stop" not in sent

    asyncio.run(main())


def test_token_ids_fall_back_to_token_id_strings(upstream: tuple[str, FakeVLLM]) -> None:
    url, fake = upstream
    fake.omit_token_ids = True

    async def main() -> None:
        backend = OpenAIBackend(url, model="tiny")
        completion = await backend.generate([1], SAMPLING, "x")
        await backend.close()
        assert completion.token_ids == tuple(fake.reply_ids)

    asyncio.run(main())


def test_stream_yields_one_delta_per_chunk(upstream: tuple[str, FakeVLLM]) -> None:
    url, fake = upstream

    async def main() -> None:
        backend = OpenAIBackend(url, model="tiny")
        deltas = [d async for d in backend.stream([1, 2], SAMPLING, "s")]
        await backend.close()
        assert [t for d in deltas for t in d.token_ids] == fake.reply_ids
        assert [d.finish for d in deltas if d.finish] == [Finish.STOP]
        assert fake.requests[-1]["stream"] is True

    asyncio.run(main())


def test_length_finish(upstream: tuple[str, FakeVLLM]) -> None:
    url, fake = upstream

    async def main() -> None:
        backend = OpenAIBackend(url, model="tiny")
        completion = await backend.generate([1], Sampling(max_tokens=4, stop_token_ids=(2, 0)), "len")
        await backend.close()
        assert completion.finish is Finish.LENGTH
        assert completion.token_ids == tuple(fake.reply_ids[:4])

    asyncio.run(main())


@pytest.mark.parametrize("dev_abort", [False, True])
def test_abort_mid_stream_keeps_the_tokens_so_far(upstream: tuple[str, FakeVLLM], dev_abort: bool) -> None:
    url, fake = upstream
    fake.chunk_delay = 0.05

    async def main() -> None:
        backend = OpenAIBackend(url, model="tiny", dev_abort=dev_abort)
        deltas = []
        async for delta in backend.stream([1], SAMPLING, "cut-me"):
            deltas.append(delta)
            if len(deltas) == 2:
                assert await backend.abort("cut-me")
        await backend.close()
        assert deltas[-1].finish is Finish.ABORT
        received = [t for d in deltas for t in d.token_ids]
        assert 2 <= len(received) < len(fake.reply_ids)
        assert received == fake.reply_ids[: len(received)]
        assert ("cmpl-cut-me-0" in fake.aborted) is dev_abort

    asyncio.run(main())


def test_upstream_errors_map_to_gymrpc_errors(upstream: tuple[str, FakeVLLM]) -> None:
    url, fake = upstream

    async def main() -> None:
        wrong_model = OpenAIBackend(url, model="other")
        with pytest.raises(InvalidArgument, match="model must be 'tiny'"):
            await wrong_model.generate([1], SAMPLING, "a")
        await wrong_model.close()
        backend = OpenAIBackend(url, model="tiny")
        fake.fail_with = (503, "engine dead")
        with pytest.raises(Unavailable, match="503: engine dead"):
            await backend.generate([1], SAMPLING, "b")
        fake.fail_with, fake.bad_logprobs = None, True
        with pytest.raises(Internal, match="logprobs"):
            await backend.generate([1], SAMPLING, "c")
        await backend.close()
        nobody = OpenAIBackend("http://127.0.0.1:9", model="tiny", timeout=2.0)
        with pytest.raises(Unavailable, match="unreachable"):
            await nobody.generate([1], SAMPLING, "d")
        await nobody.close()

    asyncio.run(main())


def test_servicer_over_the_openai_backend(upstream: tuple[str, FakeVLLM]) -> None:
    url, fake = upstream
    tok = default_tokenizer()
    tools = [common_pb2.ToolDefinition(name="get_counter_value", parameters_json_schema="{}")]
    request = pb.GenerateRequest(
        request_id="ep/a0/step0",
        messages=[common_pb2.Message(role=common_pb2.ROLE_USER, content="what is the count?")],
        tools=tools,
    )

    async def main() -> None:
        servicer = ModelServicer(OpenAIBackend(url, weight_version="iteration:7"), tok)
        reply = await servicer.Generate(request, None)  # type: ignore[arg-type]
        await servicer.close()
        assert fake.requests[-1]["prompt"] == list(reply.tokens.prompt_token_ids)
        assert servicer.template.render([{"role": "user", "content": "what is the count?"}],
                                        [{"name": "get_counter_value", "description": "", "parameters": {}}]
                                        ).token_ids == list(reply.tokens.prompt_token_ids)  # fmt: skip
        assert list(reply.tokens.completion_token_ids) == fake.reply_ids
        assert len(reply.tokens.completion_logprobs) == len(fake.reply_ids)
        assert reply.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
        assert [(c.id, c.name, c.arguments_json) for c in reply.message.tool_calls] == [
            ("call_0_0", "get_counter_value", "{}")
        ]
        assert reply.weight_version == "iteration:7"
        assert fake.requests[-1]["max_tokens"] == 1024  # the server default when the request leaves it 0

    asyncio.run(main())


def _folder(root: Any, shape: tuple[int, ...] = (4, 4)) -> Any:
    from gymrpc.testing.safetensors_files import write_safetensors

    root.mkdir()
    write_safetensors(root / "model.safetensors", {"w": ("F32", shape, None)})
    return root


def test_weight_updates_without_the_dev_endpoints_are_unimplemented_naming_what_is_missing(
    upstream: tuple[str, FakeVLLM], tmp_path: Any
) -> None:
    from gymrpc.errors import Unimplemented
    from gymrpc.servers.model.weights.service import WeightsServicer
    from gymrpc.servers.model.weights.switch import Mode, WeightSwitch

    url, fake = upstream
    backend = OpenAIBackend(url, model="tiny")

    async def scenario() -> None:
        servicer = WeightsServicer(WeightSwitch(backend))
        with pytest.raises(Unimplemented) as caught:
            await servicer._update(_folder(tmp_path / "w"), "it:1", Mode.KEEP)
        for needed in ("VLLM_SERVER_DEV_MODE=1", "--worker-extension-cls", "/collective_rpc", "--upstream-weights"):
            assert needed in caught.value.message
        assert fake.dev_calls == []
        assert backend.weight_version == "upstream"
        await backend.close()

    asyncio.run(scenario())


def test_weight_updates_go_through_the_dev_endpoints_in_order(upstream: tuple[str, FakeVLLM], tmp_path: Any) -> None:
    from gymrpc.servers.model.weights.folder import open_folder
    from gymrpc.servers.model.weights.switch import Mode, WeightSwitch

    url, fake = upstream
    model = _folder(tmp_path / "model")
    backend = OpenAIBackend(url, model="tiny", weights_model=model)
    assert backend.weights_unsupported() is None
    new = open_folder(_folder(tmp_path / "new"))

    async def scenario() -> None:
        switch = WeightSwitch(backend)
        staged = await switch.stage(new)
        applied = await switch.apply(staged, "it:1", Mode.KEEP)
        assert (applied.previous, applied.version) == ("upstream", "it:1")
        assert backend.weight_version == "it:1"
        paths = [p for p, _ in fake.dev_calls]
        assert paths == [
            "/collective_rpc",
            "/pause?mode=keep&clear_cache=false",
            "/collective_rpc",
            "/update_weight_version",
            "/resume",
        ]
        stage, apply = fake.dev_calls[0][1], fake.dev_calls[2][1]
        assert stage["method"] == "gymrpc_stage_weights"
        assert json.loads(stage["args"][0]) == [str(new.files[0])]
        assert apply == {"method": "gymrpc_apply_weights"}
        assert fake.dev_calls[3][1] == {"new_version": "it:1"}
        fake.dev_calls.clear()
        fake.stage_error = "safetensors: invalid header"
        with pytest.raises(InvalidArgument, match="could not read"):
            await switch.stage(new)
        assert [p for p, _ in fake.dev_calls] == ["/collective_rpc"]  # never paused
        assert backend.weight_version == "it:1"
        await backend.close()

    asyncio.run(scenario())
