"""Chat mode against the real vLLM OpenAI server, its completions route blocked by a proxy.

vLLM serves `/v1/chat/completions` with tools when started with `--enable-auto-tool-choice
--tool-call-parser hermes`; a small HTTP proxy on loopback in front of it passes `/v1/models`
and `/v1/chat/completions` and answers 404 to `/v1/completions`, as a chat-only server does.
The backend must find that out by itself (mode auto -> chat) and play a counter episode through
vLLM's chat route, streamed and whole, its replies re-tokenised here, with vLLM's logprobs kept
as the sampler's (asserted present and finite for every reply).

The counter model must score 1 through vLLM's chat route as it does in tokens mode. That needs
vLLM to tokenise the rendered prompt as the model was trained: the server loads the tokenizer from
the model folder's `tokenizer/` copy (`tests/vllm/helpers.py`), since transformers 5 loads the
tokenizer of any qwen2 model folder as `Qwen2Tokenizer`, splitting digits one by one.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from gymrpc.chat import default_tokenizer
from gymrpc.servers.model.backends.openai import OpenAIBackend
from gymrpc.servers.model.service import ModelServicer
from gymrpc.v1 import common_pb2
from tests.model.conftest import counter_rows, play_counter  # noqa: F401 - fixtures used below
from tests.vllm.helpers import OpenAIServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


class ChatOnlyProxy:
    """Forwards GET /v1/models and POST /v1/chat/completions (streamed through); everything else is 404."""

    def __init__(self, upstream: str) -> None:
        self.paths: list[str] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self, method: str) -> None:
                proxy.paths.append(self.path)
                if self.path not in ("/v1/models", "/v1/chat/completions"):
                    body = b'{"detail":"Not Found"}'
                    self.send_response(404)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                length = int(self.headers.get("Content-Length") or 0)
                content = self.rfile.read(length) if length else None
                headers = {"Content-Type": "application/json"}
                with (
                    httpx.Client(base_url=upstream, timeout=300) as client,
                    client.stream(method, self.path, content=content, headers=headers) as r,
                ):
                    self.send_response(r.status_code)
                    self.send_header("Content-Type", r.headers.get("content-type", "application/json"))
                    self.send_header("Connection", "close")
                    self.end_headers()
                    for chunk in r.iter_raw():
                        self.wfile.write(chunk)
                        self.wfile.flush()
                self.close_connection = True

            def do_GET(self) -> None:
                self._forward("GET")

            def do_POST(self) -> None:
                self._forward("POST")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture(scope="module")
def chat_only(counter_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChatOnlyProxy]:
    log = tmp_path_factory.mktemp("chat") / "vllm.log"
    server = OpenAIServer(counter_model, log, extra_args=("--enable-auto-tool-choice", "--tool-call-parser", "hermes"))
    proxy = ChatOnlyProxy(server.url)
    yield proxy
    proxy.stop()
    server.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_only_vllm_is_detected_and_plays_a_counter_episode(
    chat_only: ChatOnlyProxy,
    counter_rows: list[dict[str, Any]],  # noqa: F811
    play_counter: Any,  # noqa: F811
    stream: bool,
) -> None:
    tokenizer = default_tokenizer()
    chat_only.paths.clear()

    async def main() -> tuple[str, Any]:
        backend = OpenAIBackend(chat_only.url, mode="auto", tokenizer=tokenizer, chat_stream=stream)
        mode = await backend.probe()
        servicer = ModelServicer(backend, tokenizer)
        try:
            return mode, await play_counter(lambda r: servicer.Generate(r, None), counter_rows[0])
        finally:
            await servicer.close()

    mode, episode = asyncio.run(main())
    assert mode == "chat"
    assert "/v1/completions" in chat_only.paths  # probed, refused by the proxy
    assert episode.replies
    assert all(r.tokens.token_source == common_pb2.TOKEN_SOURCE_RETOKENIZED for r in episode.replies)
    assert all(r.tokens.completion_token_ids for r in episode.replies)
    assert all(not r.tokens.completion_logprobs for r in episode.replies)
    for reply in episode.replies:  # vLLM's own logprobs, one per token it generated
        assert reply.tokens.sampler_logprobs
        assert len(reply.tokens.sampler_tokens) == len(reply.tokens.sampler_logprobs)
        assert all(math.isfinite(x) and x <= 0 for x in reply.tokens.sampler_logprobs)
    said = [tokenizer.decode(list(r.tokens.completion_token_ids)) for r in episode.replies]
    assert episode.reward == 1.0, f"chat mode ({'streamed' if stream else 'whole'}) said {said}"
    assert chat_only.paths.count("/v1/chat/completions") == 1 + len(episode.replies)  # the probe, then each call
