"""The model role's OpenAI-compatible HTTP front door (aiohttp, in the server's own asyncio loop).

`POST /v1/chat/completions`, `POST /v1/responses` and `GET /v1/models`, served next to
grpc.aio on a port of its own. Every call becomes a `GenerateRequest` admitted by
`ModelServicer` exactly as `ModelService.Generate` admits it: the same template, tokenizer,
capture ledger, held responses, cuts and weight version. The episode comes from the
`x-gymrpc-episode: <rollout_id>/<attempt>` header, else from the body's
`metadata.gymrpc_episode`; a call without one is served but not captured or recorded.

With an episode and a run id (`x-gymrpc-run`, one per agent run) calls go through the
replay record (`gymrpc.servers.model.replay`): a retried run is answered from it until its first
call past the record. `x-gymrpc-divergence: go_live` continues live after a divergence.

Errors are OpenAI error bodies with the HTTP status of the gRPC code; ones a retry cannot
fix say `x-should-retry: false`, so the openai SDK does not retry them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from aiohttp import web

from gymrpc.control import EpisodeKey
from gymrpc.errors import GymrpcError, InvalidArgument
from gymrpc.ids import check_id
from gymrpc.messages import message_to_dict
from gymrpc.servers.credentials import DataPlaneCredentials
from gymrpc.servers.model import openai_shapes as shapes
from gymrpc.servers.model.replay import FAIL, GO_LIVE, ReplayRecord
from gymrpc.servers.model.service import ModelServicer
from gymrpc.v1 import model_service_pb2 as pb

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_EPISODE_STATS = 100_000
EPISODE_HEADER = "x-gymrpc-episode"
RUN_HEADER = "x-gymrpc-run"
DIVERGENCE_HEADER = "x-gymrpc-divergence"
METADATA_EPISODE = "gymrpc_episode"
GENERATE_METHOD = "/gymrpc.v1.ModelService/Generate"
"""The front door admits whoever may call this over gRPC."""
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.ABORTED: (409, "conflict_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
}
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}


def error_response(err: GymrpcError) -> web.Response:
    status, kind = _STATUS.get(err.code, (500, "server_error"))
    body = {
        "error": {
            "message": err.message,
            "type": kind,
            "param": err.metadata.get("field"),
            "code": err.reason.lower(),
            "metadata": err.metadata,
        }
    }
    headers = {"x-should-retry": "true" if err.code in _RETRYABLE else "false"}
    if err.retry_delay is not None:
        headers["retry-after-ms"] = str(int(err.retry_delay * 1000))
    return web.json_response(body, status=status, headers=headers)


def parse_episode(value: str, where: str) -> EpisodeKey:
    rollout_id, slash, attempt = value.rpartition("/")
    if not slash or not attempt.isdigit():
        raise InvalidArgument(f"{where} must be <rollout_id>/<attempt>, got {value[:80]!r}", metadata={"field": where})
    return EpisodeKey(check_id(rollout_id, where), int(attempt))


class OpenAIFrontDoor:
    """The aiohttp application over one `ModelServicer`; `start` binds, `close` stops."""

    def __init__(
        self,
        servicer: ModelServicer,
        *,
        model_name: str,
        replay: ReplayRecord | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        credentials: DataPlaneCredentials | None = None,
    ) -> None:
        self.servicer = servicer
        self.credentials = credentials
        """With a stack token: every route needs `Authorization: Bearer` with the stack or an agent token,
        as `ModelService` does over gRPC (the openai SDK sends its `api_key` so)."""
        self.model_name = model_name
        self.replay = replay or ReplayRecord()
        self.stats = {"generated": 0, "replayed": 0}
        self.episode_stats: OrderedDict[EpisodeKey, dict[str, int]] = OrderedDict()
        """Per episode attempt (LRU): calls generated and calls answered from the record."""
        self.app = web.Application(client_max_size=max_body_bytes, middlewares=[self._authenticate])
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_post("/v1/chat/completions", self._guarded(self._chat))
        self.app.router.add_post("/v1/responses", self._guarded(self._responses))
        self.app.router.add_get("/gymrpc/stats", self._stats)
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        advertised = "127.0.0.1" if host in ("", "0.0.0.0") else host
        self.url = f"http://{advertised}:{bound}/v1"
        log.info("openai front door serving", extra={"url": self.url})
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- plumbing --------------------------------------------------------------------------

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.credentials is not None:
            refusal = self.credentials.refusal(GENERATE_METHOD, request.headers.get("Authorization"))
            if refusal is not None:
                return error_response(refusal)
        return await handler(request)

    def _guarded(self, handler: Callable[[web.Request, Any], Awaitable[web.StreamResponse]]) -> Any:
        async def run(request: web.Request) -> web.StreamResponse:
            try:
                try:
                    body = json.loads(await request.read())
                except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                    raise shapes.bad(f"the request body is not valid JSON: {exc}") from None
                except RecursionError:
                    raise shapes.bad("the request body is nested too deeply") from None
                shapes.check_depth(body)
                return await handler(request, body)
            except web.HTTPRequestEntityTooLarge:
                err = shapes.bad(f"the request body exceeds {self.app._client_max_size} bytes")
                response = error_response(err)
                response.set_status(413)
                return response
            except GymrpcError as err:
                return error_response(err)

        return run

    def _episode(self, request: web.Request, metadata: dict[str, str] | None) -> EpisodeKey | None:
        header = request.headers.get(EPISODE_HEADER)
        if header:
            return parse_episode(header, EPISODE_HEADER)
        if metadata and metadata.get(METADATA_EPISODE):
            return parse_episode(metadata[METADATA_EPISODE], f"metadata.{METADATA_EPISODE}")
        return None

    async def _generate(
        self, request: web.Request, parsed: shapes.Parsed, streaming: bool
    ) -> tuple[AsyncIterator[pb.TokenDelta], Awaitable[pb.GenerateResponse], dict[str, Any]]:
        """Deltas, the final response, and the `gymrpc` extra field: from the record or the servicer."""
        generate = parsed.request
        episode = self._episode(request, parsed.metadata)
        canonical: dict[str, Any] = {}
        run_id = request.headers.get(RUN_HEADER, "")
        divergence = request.headers.get(DIVERGENCE_HEADER, FAIL)
        if divergence not in (FAIL, GO_LIVE):
            raise InvalidArgument(f"{DIVERGENCE_HEADER} must be {FAIL} or {GO_LIVE}", metadata={"field": "divergence"})
        extra: dict[str, Any] = {}
        position = None
        if episode is not None:
            generate.episode_id.rollout_id, generate.episode_id.attempt = episode.rollout_id, episode.attempt
            canonical = json.loads(json.dumps(_comparable(generate)))
            if run_id:
                if len(run_id) > 128 or not run_id.isprintable():
                    raise InvalidArgument(f"{RUN_HEADER} must be printable, at most 128 characters")
                position = self.replay.position(episode, run_id, canonical, divergence)
                extra = {"gymrpc": {"episode": str(episode), "position": position.index, "replayed": False}}
                if position.entry is not None:
                    self._count(episode, "replayed")
                    extra["gymrpc"]["replayed"] = True
                    recorded = position.entry.response
                    tokens = recorded.tokens  # the next turn renders this reply from its exact ids
                    self.servicer.memory.remember(
                        tokens.prompt_token_ids, message_to_dict(recorded.message), tokens.completion_token_ids
                    )
                    return _one_delta(recorded), _ready(recorded), extra
            digest = hashlib.sha256(
                json.dumps([str(episode), run_id, position and position.index, canonical]).encode()
            ).hexdigest()
            generate.request_id = f"http-{digest[:40]}"
        else:
            generate.request_id = f"http-{uuid.uuid4().hex}"
        flight = self.servicer._admit(generate, streaming=streaming)
        self._count(episode, "generated")

        async def final() -> pb.GenerateResponse:
            response = await flight.result()
            if episode is not None and position is not None:
                self.replay.record(episode, position.index, canonical, response)
            return response

        # Recorded even when the agent hung up: a retried run is then answered from the record.
        task = asyncio.get_running_loop().create_task(final())
        return flight.events(), asyncio.shield(task), extra

    def _count(self, episode: EpisodeKey | None, what: str) -> None:
        self.stats[what] += 1
        if episode is None:
            return
        counts = self.episode_stats.setdefault(episode, {"generated": 0, "replayed": 0})
        counts[what] += 1
        self.episode_stats.move_to_end(episode)
        while len(self.episode_stats) > MAX_EPISODE_STATS:
            self.episode_stats.popitem(last=False)

    # -- routes ----------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "gymrpc"}
        return web.json_response({"object": "list", "data": [model]})

    async def _stats(self, request: web.Request) -> web.Response:
        """Counts for benchmarks and tests; `?episode=<rollout_id>/<attempt>` for one episode."""
        wanted = request.query.get("episode")
        if wanted is None:
            return web.json_response({**self.stats, "record": self.replay.stats})
        try:
            episode = parse_episode(wanted, "episode")
        except GymrpcError as err:
            return error_response(err)
        counts = self.episode_stats.get(episode, {"generated": 0, "replayed": 0})
        return web.json_response({**counts, "recorded": len(self.replay.entries(episode))})

    async def _chat(self, request: web.Request, body: Any) -> web.StreamResponse:
        parsed = shapes.chat_request(body)
        deltas, final, extra = await self._generate(request, parsed, parsed.stream)
        ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        tokenizer = self.servicer.tokenizer
        if not parsed.stream:
            response = await final
            return web.json_response(
                shapes.chat_response(parsed, response, ident=ident, created=created, tokenizer=tokenizer, extra=extra)
            )
        stream = await _sse(request)
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}
        await _send(stream, shapes.chat_chunk(parsed, ident, created, first, **extra))
        live_text = not parsed.request.tools  # with tools the text may be call markup: sent once parsed
        try:
            async for delta in deltas:
                if live_text:
                    choice = {
                        "index": 0,
                        "delta": {"content": delta.text},
                        "finish_reason": None,
                        "logprobs": shapes.chat_delta_logprobs(parsed, tokenizer, delta),
                        "token_ids": list(delta.token_ids),
                    }
                    await _send(stream, shapes.chat_chunk(parsed, ident, created, choice))
            response = await final
        except GymrpcError as err:
            await _send(stream, {"error": {"message": err.message, "type": "server_error", "code": err.reason.lower()}})
            await stream.write_eof()
            return stream
        message = shapes.chat_message(response.message)
        tail: dict[str, Any] = {}
        if not live_text:
            tokens = response.tokens
            tail = {"content": message["content"]}
            if "tool_calls" in message:
                tail["tool_calls"] = [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]
            done = {
                "index": 0,
                "delta": tail,
                "finish_reason": None,
                "logprobs": shapes.chat_delta_logprobs(
                    parsed,
                    tokenizer,
                    pb.TokenDelta(token_ids=tokens.completion_token_ids, logprobs=tokens.completion_logprobs),
                ),
                "token_ids": list(tokens.completion_token_ids),
            }
            await _send(stream, shapes.chat_chunk(parsed, ident, created, done))
        last = {
            "index": 0,
            "delta": {},
            "finish_reason": shapes.FINISH_NAMES.get(response.finish_reason, "stop"),
            "logprobs": None,
        }
        await _send(
            stream,
            shapes.chat_chunk(
                parsed,
                ident,
                created,
                last,
                prompt_token_ids=list(response.tokens.prompt_token_ids),
                weight_version=response.weight_version,
            ),
        )
        if parsed.include_usage:
            await _send(stream, shapes.chat_chunk(parsed, ident, created, None, usage=shapes.usage(response)))
        await stream.write(b"data: [DONE]\n\n")
        await stream.write_eof()
        return stream

    async def _responses(self, request: web.Request, body: Any) -> web.StreamResponse:
        parsed = shapes.responses_request(body)
        deltas, final, extra = await self._generate(request, parsed, parsed.stream)
        ident, created = uuid.uuid4().hex, int(time.time())
        if not parsed.stream:
            response = await final
            return web.json_response(
                shapes.responses_object(parsed, response, ident=ident, created=created, extra=extra)
            )
        stream = await _sse(request)
        events = _ResponseEvents(stream)
        shell = shapes.responses_object(parsed, None, ident=ident, created=created, extra=extra)
        await events.send("response.created", response=shell)
        await events.send("response.in_progress", response=shell)
        live_text = not parsed.request.tools
        message_id, text = f"msg_{ident}", ""
        try:
            async for delta in deltas:
                if live_text and delta.text:
                    if not text:
                        await _open_message(events, message_id)
                    text += delta.text
                    await events.send(
                        "response.output_text.delta",
                        item_id=message_id,
                        output_index=0,
                        content_index=0,
                        delta=delta.text,
                        logprobs=[],
                    )
            response = await final
        except GymrpcError as err:
            await events.send("error", message=err.message, code=err.reason.lower(), param=None)
            await stream.write_eof()
            return stream
        done = shapes.responses_object(parsed, response, ident=ident, created=created, extra=extra)
        for index, item in enumerate(done["output"]):
            if item["type"] == "message":
                if not (live_text and text):
                    await _open_message(events, item["id"], index)
                    part_text = item["content"][0]["text"]
                    if part_text:
                        await events.send(
                            "response.output_text.delta",
                            item_id=item["id"],
                            output_index=index,
                            content_index=0,
                            delta=part_text,
                            logprobs=[],
                        )
                part = item["content"][0]
                await events.send(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
                await events.send(
                    "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
                )
            else:
                opened = {**item, "status": "in_progress"}
                if item["type"] == "function_call":
                    opened["arguments"] = ""
                await events.send("response.output_item.added", output_index=index, item=opened)
                if item["type"] == "function_call":
                    await events.send(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=index,
                        delta=item["arguments"],
                    )
                    await events.send(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        arguments=item["arguments"],
                    )
            await events.send("response.output_item.done", output_index=index, item=item)
        kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
        await events.send(kind, response=done)
        await stream.write_eof()
        return stream


class _ResponseEvents:
    def __init__(self, stream: web.StreamResponse) -> None:
        self.stream, self.sequence = stream, 0

    async def send(self, kind: str, **fields: Any) -> None:
        data = json.dumps({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        await self.stream.write(f"event: {kind}\ndata: {data}\n\n".encode())


async def _open_message(events: _ResponseEvents, item_id: str, index: int = 0) -> None:
    item = {"type": "message", "id": item_id, "role": "assistant", "status": "in_progress", "content": []}
    await events.send("response.output_item.added", output_index=index, item=item)
    part = {"type": "output_text", "text": "", "annotations": []}
    await events.send("response.content_part.added", item_id=item_id, output_index=index, content_index=0, part=part)


def _comparable(request: pb.GenerateRequest) -> dict[str, Any]:
    """What replay compares: the conversation, the tools and the sampling (not ids)."""
    from google.protobuf.json_format import MessageToDict

    return {
        "messages": [MessageToDict(m, preserving_proto_field_name=True) for m in request.messages],
        "tools": [MessageToDict(t, preserving_proto_field_name=True) for t in request.tools],
        "sampling": MessageToDict(request.sampling, preserving_proto_field_name=True),
    }


async def _sse(request: web.Request) -> web.StreamResponse:
    stream = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
    await stream.prepare(request)
    return stream


async def _send(stream: web.StreamResponse, payload: dict[str, Any]) -> None:
    await stream.write(f"data: {json.dumps(payload)}\n\n".encode())


async def _one_delta(response: pb.GenerateResponse) -> AsyncIterator[pb.TokenDelta]:
    tokens = response.tokens
    if tokens.completion_token_ids:
        yield pb.TokenDelta(
            text=response.message.content,
            token_ids=tokens.completion_token_ids,
            logprobs=tokens.completion_logprobs,
        )


def _ready(response: pb.GenerateResponse) -> Awaitable[pb.GenerateResponse]:
    future: asyncio.Future[pb.GenerateResponse] = asyncio.get_running_loop().create_future()
    future.set_result(response)
    return future
