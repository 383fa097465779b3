"""Fake OpenAI-compatible model servers on loopback: chat-only with tool calling, and token-level without abort.

Real HTTP servers (`ThreadingHTTPServer` on 127.0.0.1:0, one thread per connection) that
the backend, a model server process or a benchmark talk to over sockets. The "model" is a
scripted policy (`gymrpc.servers.model.backends.sources`: the counter solver, script files), so
episodes have known rewards:

- the chat route takes `messages` and `tools` and streams the reply as OpenAI does:
  content pieces, then structured `tool_calls` whose arguments arrive in fragments;
- the completions route takes a token-id prompt, reads the conversation back out of the
  rendered ChatML, and streams one token per chunk with `token_ids` and logprobs, like
  vLLM. It is greedy in the sense that matters: a prompt that is an earlier prompt plus
  a prefix of its reply gets the rest of that reply, so a continuation is exact. It has
  no abort endpoint; a client that disconnects ends the generation.

Every request is recorded; `regenerations` counts completions requests that started again
from a prompt whose reply had already been streamed (what continuation must avoid).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from gymrpc.chat import ChatTokenizer, default_tokenizer, parse_reply
from gymrpc.servers.model.backends.base import Conversation
from gymrpc.servers.model.backends.sources import CounterSolver, ReplySource

_TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.S)
_TOOLS = re.compile(r"<tools>(\n\{.*?)\n</tools>", re.S)


def conversation_of_prompt(text: str) -> Conversation:
    """The messages and tools a ChatML prompt (gymrpc's template) was rendered from; the open turn is dropped."""
    messages: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []
    turn = 0
    for block in text.split("<|im_start|>")[1:]:
        role, _, rest = block.partition("\n")
        if role == "user" and not rest:  # tool results: `<|im_start|>user\n<tool_response>...`
            role, rest = "user", block.removeprefix("user")
        closed = "<|im_end|>" in rest
        body = rest.split("<|im_end|>")[0]
        if role == "system":
            found = _TOOLS.search(body)
            if found:
                tools = [json.loads(line) for line in found.group(1).splitlines() if line.strip()]
            continue
        if role == "assistant":
            if not closed:
                break  # the generation prompt (and any partial reply)
            reply = parse_reply(body, id_prefix=f"call_{turn}")
            messages.append(reply.to_message())
            turn += 1
        elif body.lstrip("\n").startswith("<tool_response>"):
            messages += [{"role": "tool", "content": c} for c in _TOOL_RESPONSE.findall(body)]
        else:
            messages.append({"role": role, "content": body})
    return Conversation(messages, tools)


@dataclass
class _Served:
    """One base prompt's reply and how much of it the server has written so far (over all requests)."""

    reply: list[int]
    written: int = 0


@dataclass
class FakeUpstream:
    completions: bool = True
    """Serve `/v1/completions` with token ids (vLLM-style); False: a chat-only server."""
    chat: bool = True
    chat_logprobs: bool = True
    """Chat replies carry `logprobs.content` when asked; False: a request asking for them is refused (400)."""
    model: str = "fake-model"
    api_key: str | None = None
    token_delay: float = 0.0
    """Seconds between streamed tokens (chunks)."""
    max_context: int = 100_000
    hold_at: int | None = None
    """Pause every fresh (not continued) streamed generation after this many tokens until `hold` is set
    (a streamed chat reply: after its first chunk)."""
    hold: threading.Event = field(default_factory=threading.Event)
    holding: threading.Event = field(default_factory=threading.Event)
    """Set when a generation first pauses at `hold_at`."""
    sources: Sequence[ReplySource] = field(default_factory=lambda: [CounterSolver()])
    tokenizer: ChatTokenizer = field(default_factory=default_tokenizer)
    requests: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    failures: list[tuple[int, str, dict[str, str]]] = field(default_factory=list)
    """(status, message, headers) answered, in order, to the next POSTs instead of a reply."""
    regenerations: int = 0
    """Completions requests that began from scratch a reply the server had already streamed some of."""
    regenerated_tokens: int = 0
    """Tokens streamed again: a request whose prompt ended before what was already written."""
    continuations: int = 0
    generated_tokens: int = 0
    _served: dict[tuple[int, ...], _Served] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def reply_text(self, conversation: Conversation) -> str:
        for source in self.sources:
            text = source.reply(conversation)
            if text is not None:
                return text
        return "I do not know."

    def completion_plan(self, prompt: list[int]) -> tuple[_Served, int]:
        """The reply this prompt continues and the offset it continues at (0: a new generation)."""
        with self._lock:
            for base, served in self._served.items():
                k = len(prompt) - len(base)
                if k >= 0 and tuple(prompt[: len(base)]) == base and prompt[len(base) :] == served.reply[:k]:
                    if k == 0 and served.written > 0:
                        self.regenerations += 1
                    if k > 0:
                        self.continuations += 1
                    self.regenerated_tokens += max(0, served.written - k)
                    return served, k
        text = self.tokenizer.decode(prompt)
        ids = [*self.tokenizer.encode(self.reply_text(conversation_of_prompt(text))), self.tokenizer.im_end_id]
        with self._lock:
            served = self._served.setdefault(tuple(prompt), _Served(ids))
        return served, 0


class _Handler(BaseHTTPRequestHandler):
    sampled: int | None = None
    """Logprob entries this chat reply has streamed so far; None: not asked for."""
    fake: FakeUpstream
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _json(self, status: int, payload: Any, headers: Mapping[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        fake = self.fake
        if fake.api_key is None or self.headers.get("Authorization") == f"Bearer {fake.api_key}":
            return True
        message = "Incorrect API key provided. You can find your API key at your provider's console."
        self._json(401, {"error": {"message": message, "type": "invalid_request_error", "code": "invalid_api_key"}})
        return False

    def do_GET(self) -> None:
        if self.path == "/_stats":  # the counters, for a benchmark running this server in another process
            fake = self.fake
            keys = ("regenerations", "regenerated_tokens", "continuations", "generated_tokens")
            return self._json(200, {"requests": len(fake.requests), **{k: getattr(fake, k) for k in keys}})
        if not self._authorized():
            return
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": self.fake.model, "object": "model"}]})
        else:
            self._json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        fake = self.fake
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if not self._authorized():
            return
        fake.requests.append((self.path, body))
        if fake.failures:
            status, message, headers = fake.failures.pop(0)
            return self._json(status, {"error": {"message": message, "type": "error", "code": status}}, headers)
        served = {"/v1/completions": fake.completions, "/v1/chat/completions": fake.chat}
        if not served.get(self.path):
            return self._json(404, {"detail": "Not Found"})
        if body.get("model") != fake.model:
            message = f"The model `{body.get('model')}` does not exist."
            return self._json(404, {"error": {"message": message, "type": "NotFoundError", "code": 404}})
        if self.path == "/v1/completions":
            return self._completions(body)
        return self._chat(body)

    # -- /v1/completions, token ids --------------------------------------------------------

    def _completions(self, body: dict[str, Any]) -> None:
        fake = self.fake
        prompt = body.get("prompt")
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            return self._json(400, {"error": {"message": "prompt must be a list of token ids"}})
        if len(prompt) + int(body.get("max_tokens") or 16) > fake.max_context:
            message = (
                f"This model's maximum context length is {fake.max_context} tokens. However, you requested "
                f"{len(prompt) + int(body.get('max_tokens') or 16)} tokens."
            )
            return self._json(400, {"error": {"message": message, "code": "context_length_exceeded"}})
        served, k = fake.completion_plan(prompt)
        ids = served.reply[k : k + int(body.get("max_tokens") or 16)]
        finish = "stop" if k + len(ids) == len(served.reply) else "length"
        if not body.get("stream"):
            served.written = max(served.written, k + len(ids))
            fake.generated_tokens += len(ids)
            return self._json(200, {"choices": [self._token_choice(ids, k, finish)]})
        self._start_events()
        try:
            for n, token in enumerate(ids):
                if k == 0 and n == fake.hold_at:
                    fake.holding.set()
                    fake.hold.wait(120)
                last = n == len(ids) - 1
                self._event({"choices": [self._token_choice([token], k + n, finish if last else None)]})
                served.written = max(served.written, k + n + 1)
                fake.generated_tokens += 1
                if fake.token_delay and not last:
                    time.sleep(fake.token_delay)
            self._done()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away: that is the only abort this server knows

    @staticmethod
    def _token_choice(ids: list[int], at: int, finish: str | None) -> dict[str, Any]:
        logprobs = [-0.125 * ((at + j) % 7 + 1) for j in range(len(ids))]  # a function of the position only
        return {
            "index": 0,
            "text": "",
            "token_ids": ids,
            "logprobs": {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": logprobs},
            "finish_reason": finish,
        }

    # -- /v1/chat/completions, structured ----------------------------------------------------

    def _chat(self, body: dict[str, Any]) -> None:
        fake = self.fake
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return self._json(400, {"error": {"message": "messages must be a non-empty list"}})
        if sum(len(str(m.get("content") or "")) for m in messages) > fake.max_context:
            message = f"This model's maximum context length is {fake.max_context} tokens."
            return self._json(400, {"error": {"message": message, "code": "context_length_exceeded"}})
        if body.get("logprobs") and not fake.chat_logprobs:
            return self._json(400, {"error": {"message": "logprobs is not supported by this server"}})
        self.sampled = 0 if body.get("logprobs") else None
        conversation = Conversation(messages, body.get("tools") or [])
        reply = parse_reply(fake.reply_text(conversation))
        calls = [
            {"id": f"call_up_{k}", "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
            for k, c in enumerate(reply.tool_calls)
        ]
        finish = "tool_calls" if calls else "stop"
        if int(body.get("max_tokens") or 1 << 30) <= 1:
            calls, finish, reply = [], "length", parse_reply(reply.content[:5])
        if not body.get("stream"):
            message = {
                "role": "assistant",
                "content": reply.content or None,
                **({"tool_calls": calls} if calls else {}),
            }
            choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
            if self.sampled is not None:  # one "token" per 8 characters of content, then of arguments
                text = reply.content + "".join(c["function"]["arguments"] for c in calls)
                pieces = [text[i : i + 8] for i in range(0, len(text), 8)]
                content = [
                    {"token": p, "logprob": -0.0625 * (k % 5 + 1), "bytes": list(p.encode())}
                    for k, p in enumerate(pieces)
                ]
                choice["logprobs"] = {"content": content}
            return self._json(200, {"choices": [choice]})
        self._start_events()
        try:
            self._chat_delta({"role": "assistant", "content": ""})
            if fake.hold_at is not None:  # a chat reply pauses after its first chunk
                fake.holding.set()
                fake.hold.wait(120)
            for start in range(0, len(reply.content), 8):
                self._chat_delta({"content": reply.content[start : start + 8]}, reply.content[start : start + 8])
                if fake.token_delay:
                    time.sleep(fake.token_delay)
            for k, call in enumerate(calls):
                head = {
                    "index": k,
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["function"]["name"]},
                }
                self._chat_delta({"tool_calls": [{**head, "function": {**head["function"], "arguments": ""}}]})
                arguments = call["function"]["arguments"]
                for start in range(0, len(arguments), 5):
                    piece = {"index": k, "function": {"arguments": arguments[start : start + 5]}}
                    self._chat_delta({"tool_calls": [piece]}, arguments[start : start + 5])
            self._event({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
            self._done()
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _chat_delta(self, delta: dict[str, Any], token: str = "") -> None:
        """One chunk; with `token` and logprobs asked for, that piece is one sampled "token" (OpenAI's shape)."""
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
        if token and self.sampled is not None:
            logprob = -0.0625 * (self.sampled % 5 + 1)  # a function of the position only
            choice["logprobs"] = {"content": [{"token": token, "logprob": logprob, "bytes": list(token.encode())}]}
            self.sampled += 1
        self._event({"object": "chat.completion.chunk", "choices": [choice]})

    # -- server-sent events ------------------------------------------------------------------

    def _start_events(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    def _event(self, payload: Any) -> None:
        self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
        self.wfile.flush()

    def _done(self) -> None:
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


class RunningUpstream:
    """A `FakeUpstream` served on 127.0.0.1 in a background thread; `url` ends in `/v1`."""

    def __init__(self, fake: FakeUpstream) -> None:
        self.fake = fake
        handler = type("BoundHandler", (_Handler,), {"fake": fake})
        server_class = type("Server", (ThreadingHTTPServer,), {"request_queue_size": 1024})  # as uvicorn's backlog
        self._server = server_class(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def main() -> None:
    """Serve one fake upstream until SIGTERM; print its URL on the first line of stdout."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chat-only", action="store_true")
    parser.add_argument("--tokens-only", action="store_true")
    parser.add_argument("--token-delay", type=float, default=0.0)
    args = parser.parse_args()
    upstream = RunningUpstream(
        FakeUpstream(completions=not args.chat_only, chat=not args.tokens_only, token_delay=args.token_delay)
    )
    print(upstream.url, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    upstream.stop()


if __name__ == "__main__":
    main()
