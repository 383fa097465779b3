"""A backend that forwards model calls to an OpenAI-compatible server, in one of two modes.

`tokens` (vLLM and other token-level servers): the rendered prompt goes to
`/v1/completions` as a list of token ids, so the trajectory holds the sampler's own
ids and logprobs. Per `reference/vllm.md` §3 (verified with vLLM 0.32):
`return_token_ids: true` adds `choices[].token_ids` (per chunk when streaming),
`logprobs: k` gives `choices[].logprobs.token_logprobs`, `return_tokens_as_token_ids:
true` writes the logprob tokens as `token_id:N` (used when `token_ids` is missing),
`request_id` in the body names the engine request `cmpl-<request_id>-0`, and `POST
/abort_requests` (dev mode) aborts it keeping the partial. A cut generation continues
from the tokens already streamed (`ModelBackend.continue_stream`: prompt + partial).

`chat` (OpenAI itself, hosted endpoints, servers without token-id completions): the
structured messages and tools (with the server's system prompt when the conversation has
none) go to `/v1/chat/completions` (streamed, or whole with `chat_stream=False`) and the reply's
content and structured tool calls are written back in this server's template format
and tokenised by this server, so the ids are honest only as text: they are flagged
`TOKEN_SOURCE_RETOKENIZED` (`retokenized`) and `completion_logprobs` stays empty. Where
the upstream accepts `logprobs: true` (probed; refused: asked without, logged once), its
streamed `choices[].logprobs.content[]` (token piece, `bytes`, `logprob`) are kept as the
trace's `sampler_tokens`/`sampler_logprobs`: the sampler's logprobs, in the sampler's own
tokenisation, which the re-tokenised ids do not align with. Replies are whole messages:
a cut chat generation keeps nothing and is generated again.

`probe()` (run by the server before it binds) probes the upstream (`/v1/models`, a one-token token-id completion, a
one-token chat completion), picks the mode for `auto`, refuses a forced mode the
upstream cannot serve naming the missing route, and logs one line saying what the
upstream can and cannot do.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from gymrpc.chat import ChatTokenizer, assistant_body
from gymrpc.errors import (
    FailedPrecondition,
    GymrpcError,
    Internal,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from gymrpc.servers.model.backends.base import (
    Completion,
    CompletionDelta,
    Conversation,
    Finish,
    ModelBackend,
    Sampling,
)
from gymrpc.servers.model.backends.vllm_weights import WEIGHTS_EXTENSION
from gymrpc.servers.model.weights.folder import TensorSpec, WeightsFolder, open_folder
from gymrpc.servers.model.weights.transfer import unsupported

log = logging.getLogger(__name__)

MODES = ("auto", "tokens", "chat")
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
_FINISH = {"stop": Finish.STOP, "length": Finish.LENGTH, "abort": Finish.ABORT, "tool_calls": Finish.STOP}
_CONTEXT_LENGTH = re.compile(r"context[ _-]?length|maximum context|context window|too many tokens|too long", re.I)
_MODEL_MISSING = re.compile(r"model.*(does not exist|not found|unknown|no such)|model_not_found|unknown model", re.I)
DRAIN_GRACE, DRAIN_LIMIT = 0.002, 0.02
"""After an abort, lines keep being read while each comes within DRAIN_GRACE s, for DRAIN_LIMIT s at most."""
MAX_RETRY_AFTER = 60.0
"""A Retry-After longer than this is not waited for, whatever the deadline."""


@dataclass(frozen=True)
class Capabilities:
    """What the probe found the upstream can do (None: not probed)."""

    models: tuple[str, ...] = ()
    token_completions: bool | None = None
    """`/v1/completions` takes a token-id prompt and returns token ids."""
    token_completions_why: str = ""
    chat: bool | None = None
    chat_why: str = ""
    chat_logprobs: bool | None = None
    """`/v1/chat/completions` accepts `logprobs: true` (None: not probed)."""

    def summary(self, mode: str, dev_abort: bool) -> str:
        def say(ok: bool | None, what: str, why: str) -> str:
            if ok is None:
                return f"{what}: not probed"
            return f"{what}: yes" if ok else f"{what}: NO ({why})"

        return "; ".join(
            (
                f"mode {mode}",
                say(self.token_completions, "token-id completions", self.token_completions_why),
                say(self.chat, "chat completions", self.chat_why),
                say(self.chat_logprobs, "chat logprobs", "refused; chat traces carry none"),
                f"abort: {'/abort_requests' if dev_abort else 'by disconnecting (partials kept from the stream)'}",
                f"models: {', '.join(self.models[:5]) or '-'}",
            )
        )


class OpenAIBackend(ModelBackend):
    name = "openai"

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        weight_version: str = "upstream",
        api_key: str | None = None,
        timeout: float = 600.0,
        dev_abort: bool = False,
        mode: str = "tokens",
        tokenizer: ChatTokenizer | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        weights_model: Path | None = None,
        chat_logprobs: bool | None = None,
        chat_stream: bool = True,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode != "tokens" and tokenizer is None:
            raise ValueError("chat (and auto) mode needs the server's tokenizer to write replies as token ids")
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.weight_version = weight_version
        self.dev_abort = dev_abort
        """Also call the upstream's `/abort_requests` (vLLM with VLLM_SERVER_DEV_MODE=1)."""
        self.requested_mode = mode
        self.mode = mode if mode != "auto" else ""
        """`tokens` or `chat` once known (`probe` resolves `auto`)."""
        self.tokenizer = tokenizer
        self.timeout = timeout
        self.capabilities = Capabilities()
        self.chat_logprobs: bool | None = chat_logprobs
        """Ask chat upstreams for `logprobs` (None: yes, unless the probe or a reply says they refuse)."""
        self._chat_logprobs_ok = False
        self.chat_stream = chat_stream
        """Stream chat replies; False: one whole reply per request (upstreams that do not stream)."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout, transport=transport)
        self._aborts: dict[str, asyncio.Event] = {}
        self._model_lock = asyncio.Lock()
        self._start_lock = asyncio.Lock()
        self._specs: dict[str, TensorSpec] | None = None
        if weights_model is not None:
            self._specs = open_folder(weights_model.resolve()).specs()
        """Tensors of the model the upstream loaded (`--upstream-weights`); None: updates are off."""

    @property
    def retokenized(self) -> bool:
        """True when token ids are this server's tokenisation of the upstream's text (chat mode)."""
        return self.mode == "chat"

    def status_details(self) -> dict[str, str]:
        """Facts for `GetStatus.details` and `gymrpc ctl status`."""
        caps = self.capabilities

        def yes(ok: bool | None) -> str:
            return "unknown" if ok is None else ("yes" if ok else "no")

        return {
            "upstream_mode": self.mode or "auto (not probed yet)",
            "upstream_token_completions": yes(caps.token_completions),
            "upstream_chat": yes(caps.chat),
        }

    # -- capability probe ----------------------------------------------------------------

    async def probe(self) -> str:
        """Probe the upstream, settle the mode, log what it can do; raise if the mode cannot work."""
        async with self._start_lock:
            models = await self._list_models()
            where = f"upstream {self.base_url}"
            if self.model is None:
                self.model = models[0]
            elif self.model not in models:
                raise FailedPrecondition(
                    f"{where} does not serve model {self.model!r} (GET /v1/models lists: "
                    f"{', '.join(models[:10])}); fix --upstream-model",
                    reason="UPSTREAM_MODEL_NOT_FOUND",
                    metadata={"model": self.model[:200]},
                )
            tokens_ok, tokens_why = await self._probe_token_completions(self.model)
            chat_ok: bool | None = None
            chat_why = ""
            if self.requested_mode != "tokens" or not tokens_ok:
                chat_ok, chat_why = await self._probe_chat(self.model)
                if chat_ok and self.chat_logprobs is None:
                    self.chat_logprobs = self._chat_logprobs_ok
            self.capabilities = Capabilities(
                models, tokens_ok, tokens_why, chat_ok, chat_why, self.chat_logprobs if chat_ok else None
            )
            if self.requested_mode == "tokens" and not tokens_ok:
                raise FailedPrecondition(
                    f"--upstream-mode tokens: {where} has no working POST {COMPLETIONS} with token-id prompts "
                    f"({tokens_why}); use a vLLM-style server or --upstream-mode chat",
                    reason="UPSTREAM_NOT_FOUND",
                    metadata={"route": COMPLETIONS},
                )
            if self.requested_mode == "chat" and not chat_ok:
                raise FailedPrecondition(
                    f"--upstream-mode chat: {where} has no working POST {CHAT} ({chat_why})",
                    reason="UPSTREAM_NOT_FOUND",
                    metadata={"route": CHAT},
                )
            if self.requested_mode == "auto":
                if not (tokens_ok or chat_ok):
                    raise FailedPrecondition(
                        f"{where} serves neither POST {COMPLETIONS} with token ids ({tokens_why}) "
                        f"nor POST {CHAT} ({chat_why})",
                        reason="UPSTREAM_NOT_FOUND",
                        metadata={"route": f"{COMPLETIONS} {CHAT}"},
                    )
                self.mode = "tokens" if tokens_ok else "chat"
            log.info("%s: %s", where, self.capabilities.summary(self.mode, self.dev_abort))
            return self.mode

    async def _probe_token_completions(self, model: str) -> tuple[bool, str]:
        prompt = self.tokenizer.encode("Hello") if self.tokenizer is not None else [1]
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0.0,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        try:
            choice = _first_choice(await self._post_json(COMPLETIONS, body))
            parse_choice(choice, self.weight_version)
        except (Unauthenticated, PermissionDenied):
            raise
        except GymrpcError as exc:
            return False, f"POST {COMPLETIONS}: {exc.message}"
        if choice.get("token_ids") is None and not (choice.get("logprobs") or {}).get("tokens"):
            return False, f"POST {COMPLETIONS} returns text, not token ids"
        return True, ""

    async def _probe_chat(self, model: str) -> tuple[bool, str]:
        """A one-token chat completion, asking for logprobs first, then (refused) without."""
        body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1}
        self._chat_logprobs_ok = False
        if self.chat_logprobs is not False:
            try:
                _first_choice(await self._post_json(CHAT, {**body, "logprobs": True}))
                self._chat_logprobs_ok = True
                return True, ""
            except (Unauthenticated, PermissionDenied):
                raise
            except GymrpcError as exc:
                if exc.reason != "UPSTREAM_REJECTED":
                    return False, f"POST {CHAT}: {exc.message}"
                log.warning("upstream %s refuses chat logprobs (%s); traces carry none", self.base_url, exc.message)
        try:
            _first_choice(await self._post_json(CHAT, body))
        except (Unauthenticated, PermissionDenied):
            raise
        except GymrpcError as exc:
            return False, f"POST {CHAT}: {exc.message}"
        return True, ""

    async def _mode(self) -> str:
        if not self.mode:
            await self.probe()
        return self.mode

    # -- tokens mode ---------------------------------------------------------------------

    def request_body(
        self,
        prompt_token_ids: Sequence[int],
        sampling: Sampling,
        request_id: str,
        model: str,
        *,
        stream: bool,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "prompt": list(prompt_token_ids),
            "max_tokens": sampling.max_tokens,
            "logprobs": sampling.top_logprobs,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "request_id": request_id,
            "stream": stream,
        }
        if sampling.stop_token_ids:
            body["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        for key in ("temperature", "top_p", "seed"):
            value = getattr(sampling, key)
            if value is not None:
                body[key] = value
        return body

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling: Sampling,
        request_id: str,
        *,
        conversation: Conversation | None = None,
    ) -> Completion:
        if await self._mode() == "chat":
            return await super().generate(prompt_token_ids, sampling, request_id, conversation=conversation)
        body = self.request_body(prompt_token_ids, sampling, request_id, await self._model(), stream=False)
        aborted = self._aborts.setdefault(request_id, asyncio.Event())
        post = asyncio.ensure_future(self._post_json(COMPLETIONS, body))
        waiter = asyncio.ensure_future(aborted.wait())
        try:
            done, _ = await asyncio.wait({post, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if post not in done and not self.dev_abort:
                # Without the dev endpoint, dropping the connection is the abort; a unary call has no partial.
                return Completion((), (), Finish.ABORT, self.weight_version)
            choice = _first_choice(await post)
        finally:
            waiter.cancel()
            post.cancel()
            self._aborts.pop(request_id, None)
        delta = parse_choice(choice, self.weight_version)
        return Completion(delta.token_ids, delta.logprobs, delta.finish or Finish.STOP, self.weight_version)

    async def stream(
        self,
        prompt_token_ids: Sequence[int],
        sampling: Sampling,
        request_id: str,
        *,
        conversation: Conversation | None = None,
    ) -> AsyncIterator[CompletionDelta]:
        if await self._mode() == "chat":
            async for delta in self._chat_stream(sampling, request_id, conversation):
                yield delta
            return
        body = self.request_body(prompt_token_ids, sampling, request_id, await self._model(), stream=True)
        aborted = self._aborts.setdefault(request_id, asyncio.Event())
        finished = False
        try:
            async with self._open_stream(COMPLETIONS, body, aborted) as r:
                async for data in _events(r, None if self.dev_abort else aborted):
                    if not data.get("choices"):
                        continue  # a usage-only chunk
                    delta = parse_choice(_first_choice(data), self.weight_version)
                    finished = finished or delta.finish is not None
                    yield delta
        finally:
            self._aborts.pop(request_id, None)
        if not finished:
            yield CompletionDelta((), (), Finish.ABORT, self.weight_version)

    # -- chat mode -----------------------------------------------------------------------

    def chat_body(self, conversation: Conversation, sampling: Sampling, model: str) -> dict[str, Any]:
        messages = [_upstream_message(m) for m in conversation.messages]
        if conversation.default_system and not (messages and messages[0].get("role") in ("system", "developer")):
            # The prompt tokens mode would render: the upstream's own template default may differ.
            messages.insert(0, {"role": "system", "content": conversation.default_system})
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": sampling.max_tokens,
            "stream": True,
        }
        if self.chat_logprobs is not False:
            body["logprobs"] = True
            if sampling.top_logprobs:
                body["top_logprobs"] = sampling.top_logprobs
        if conversation.tools:
            body["tools"] = [dict(t) for t in conversation.tools]
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        for key in ("temperature", "top_p", "seed"):
            value = getattr(sampling, key)
            if value is not None:
                body[key] = value
        return body

    async def _chat_stream(
        self, sampling: Sampling, request_id: str, conversation: Conversation | None
    ) -> AsyncIterator[CompletionDelta]:
        """One whole message: the reply is tokenised once complete, so a cut keeps nothing."""
        if conversation is None:
            raise Internal("chat mode needs the structured conversation")
        assert self.tokenizer is not None
        body = self.chat_body(conversation, sampling, await self._model())
        aborted = self._aborts.setdefault(request_id, asyncio.Event())
        reply = _ChatReply()
        try:
            try:
                await self._chat_reply(body, aborted, reply)
            except InvalidArgument as exc:
                if "logprobs" not in body or exc.reason != "UPSTREAM_REJECTED" or self.chat_logprobs:
                    raise
                self.chat_logprobs = False  # not probed: refused once, asked without from now on
                log.warning("upstream %s refuses chat logprobs (%s); traces carry none", self.base_url, exc.message)
                body = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")}
                await self._chat_reply(body, aborted, reply)
        finally:
            self._aborts.pop(request_id, None)
        if reply.finish is None:
            yield CompletionDelta((), None, Finish.ABORT, self.weight_version)
            return
        ids = self.tokenizer.encode(assistant_body(reply.message()))
        if reply.finish is not Finish.LENGTH:
            ids.append(self.tokenizer.im_end_id)
        yield CompletionDelta(tuple(ids), None, reply.finish, self.weight_version, tuple(reply.sampler))

    async def _chat_reply(self, body: dict[str, Any], aborted: asyncio.Event, reply: _ChatReply) -> None:
        """Fill `reply` from one chat request, streamed or (`chat_stream` False) whole; an abort leaves it open."""
        if self.chat_stream:
            async with self._open_stream(CHAT, body, aborted) as r:
                async for data in _events(r, aborted):
                    if data.get("choices"):
                        reply.add(data["choices"][0])
            return
        post = asyncio.ensure_future(self._post_json(CHAT, {**body, "stream": False}))
        waiter = asyncio.ensure_future(aborted.wait())
        try:
            await asyncio.wait({post, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if post.done():  # else aborted: dropping the request is the abort
                reply.add(_first_choice(await post))
        finally:
            waiter.cancel()
            post.cancel()

    async def continue_stream(
        self,
        prompt_token_ids: Sequence[int],
        prefix_token_ids: Sequence[int],
        sampling: Sampling,
        request_id: str,
        *,
        conversation: Conversation | None = None,
    ) -> AsyncIterator[CompletionDelta]:
        if await self._mode() == "chat":
            # A chat upstream cannot continue a message it never saw: the restored prefix (from a
            # tokens-mode run) is kept and the rest ends here, rather than stitching two replies.
            raise FailedPrecondition(
                "a chat-mode upstream cannot continue a generation cut in tokens mode; restore onto a "
                "tokens-mode model server",
                reason="UPSTREAM_NOT_FOUND",
                metadata={"route": COMPLETIONS},
            )
        async for delta in super().continue_stream(
            prompt_token_ids, prefix_token_ids, sampling, request_id, conversation=conversation
        ):
            yield delta

    # -- shared --------------------------------------------------------------------------

    async def abort(self, request_id: str) -> bool:
        event = self._aborts.get(request_id)
        if event is None:
            return False
        if self.dev_abort and self.mode == "tokens":
            with contextlib.suppress(GymrpcError):
                await self._post_json("/abort_requests", {"request_ids": [f"cmpl-{request_id}-0"]})
        event.set()
        return True

    async def close(self) -> None:
        await self._http.aclose()

    # -- weight updates through vLLM's dev endpoints ---------------------------------------------

    def weights_unsupported(self) -> str | None:
        if self._specs is None:
            return (
                "the openai backend changes weights only on a vLLM upstream in dev mode "
                "(VLLM_SERVER_DEV_MODE=1, for POST /pause, /resume, /collective_rpc and "
                f"/update_weight_version) started with --worker-extension-cls {WEIGHTS_EXTENSION}; "
                "run the model server with --upstream-weights MODEL_DIR (the folder the upstream loaded, "
                "on a filesystem both see) to use it"
            )
        return None

    def weight_specs(self) -> Mapping[str, TensorSpec] | None:
        return self._specs

    def transfer_unsupported(self, engine: str | None = None) -> GymrpcError | None:
        return unsupported(
            "the openai backend has no weight-transfer engine: a vllm serve upstream's own (its dev-mode "
            "/init_weight_transfer_engine and /update_weights routes) is driven by the trainer directly with vLLM's "
            "HTTPVLLMWeightSyncClient, outside gymrpc; through gymrpc, update by path (--upstream-weights), or run "
            "the model in-process (--backend vllm --weight-transfer nccl)",
            "weight_transfer_engine",
        )

    async def stage_weights(self, folder: WeightsFolder) -> Any:
        files = json.dumps([str(f) for f in folder.files])
        try:
            await self._post_json("/collective_rpc", {"method": "gymrpc_stage_weights", "args": [files]})
        except GymrpcError as exc:
            raise InvalidArgument(
                f"the upstream could not read the new weights: {exc.message}; nothing was loaded",
                reason="CORRUPT_WEIGHTS",
            ) from None
        return folder

    async def apply_weights(self, staged: Any, version: str) -> None:
        await self._post_json("/collective_rpc", {"method": "gymrpc_apply_weights"})
        await self._post_json("/update_weight_version", {"new_version": version})
        self.weight_version = version

    async def freeze(self) -> None:
        await self._post_json("/pause?mode=keep&clear_cache=false", {})

    async def thaw(self) -> None:
        await self._post_json("/resume", {})

    async def _model(self) -> str:
        if self.model is None:
            async with self._model_lock:
                if self.model is None:
                    self.model = (await self._list_models())[0]
        return self.model

    async def _list_models(self) -> tuple[str, ...]:
        async with self._errors("/v1/models"):
            response = await self._http.get("/v1/models")
            await _raise_for_status(response, self.base_url, "/v1/models")
            models = tuple(str(m["id"]) for m in response.json().get("data") or [])
        if not models:
            raise FailedPrecondition(f"upstream {self.base_url} serves no models")
        return models

    async def _post_json(self, path: str, body: Mapping[str, Any]) -> Any:
        deadline = time.monotonic() + self.timeout
        async with self._errors(path):
            while True:
                response = await self._http.post(path, json=body)
                delay = _retry_after(response, deadline)
                if delay is None:
                    break
                await asyncio.sleep(delay)
            await _raise_for_status(response, self.base_url, path)
            return response.json()

    @contextlib.asynccontextmanager
    async def _open_stream(self, path: str, body: Mapping[str, Any], aborted: asyncio.Event) -> AsyncIterator[Any]:
        """A streaming POST, retried on 429 within the call's deadline (the upstream timeout)."""
        deadline = time.monotonic() + self.timeout
        async with self._errors(path):
            while True:
                async with self._http.stream("POST", path, json=body) as response:
                    delay = _retry_after(response, deadline)
                    if delay is None:
                        await _raise_for_status(response, self.base_url, path)
                        yield response
                        return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(aborted.wait(), delay)
                if aborted.is_set():
                    yield _NoResponse()
                    return

    @contextlib.asynccontextmanager
    async def _errors(self, path: str) -> AsyncIterator[None]:
        try:
            yield
        except httpx.TimeoutException as exc:
            raise Unavailable(f"upstream {self.base_url}{path} timed out: {exc!r}") from None
        except httpx.TransportError as exc:
            raise Unavailable(f"upstream {self.base_url}{path} is unreachable: {exc!r}") from None
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise Internal(f"upstream {self.base_url}{path} sent a malformed response: {exc!r}") from None


class _NoResponse:
    """Stands in for a response when the call was aborted while it waited out a 429."""

    async def aiter_lines(self) -> AsyncIterator[str]:
        return
        yield  # pragma: no cover


async def _events(response: Any, aborted: asyncio.Event | None) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of an SSE stream; ends at `[DONE]`, or soon after `aborted` is set.

    Racing the abort against the next line ends a cut without waiting for a token that may
    be slow to come; leaving the `stream` block closes the connection, which is the abort.
    Lines that already arrived when the abort came are still read (`DRAIN_GRACE`): they
    are tokens the upstream generated, and each one kept is one the continuation need not.
    """
    lines = response.aiter_lines().__aiter__()
    waiter = asyncio.ensure_future(aborted.wait()) if aborted is not None else None
    loop = asyncio.get_running_loop()
    drain_until: float | None = None
    try:
        while True:
            step = asyncio.ensure_future(lines.__anext__())
            if waiter is not None:
                if drain_until is None:
                    await asyncio.wait({step, waiter}, return_when=asyncio.FIRST_COMPLETED)
                    if waiter.done():
                        drain_until = loop.time() + DRAIN_LIMIT
                if drain_until is not None and not step.done():
                    budget = min(DRAIN_GRACE, drain_until - loop.time())
                    if budget > 0:
                        await asyncio.wait({step}, timeout=budget)
                if not step.done():
                    step.cancel()
                    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, httpx.HTTPError):
                        await step
                    return
            try:
                line = await step
            except StopAsyncIteration:
                return
            if not line.startswith("data:"):
                continue
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if isinstance(chunk, Mapping) and "error" in chunk:
                raise Unavailable(f"upstream stream failed: {chunk['error']}")
            yield chunk
    finally:
        if waiter is not None:
            waiter.cancel()


class _ChatReply:
    """A chat completion assembled from its streamed deltas (or one whole `message`)."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish: Finish | None = None
        self.sampler: list[tuple[bytes, float]] = []
        """The upstream's (token bytes, logprob) for each token it streamed logprobs for."""

    def add(self, choice: Mapping[str, Any]) -> None:
        delta = choice.get("delta") or choice.get("message") or {}
        if delta.get("content"):
            self.content.append(str(delta["content"]))
        for key in ("reasoning_content", "reasoning"):
            if delta.get(key):
                self.reasoning.append(str(delta[key]))
        for position, call in enumerate(delta.get("tool_calls") or ()):
            index = int(call.get("index", position))
            slot = self.calls.setdefault(index, {"name": "", "arguments": ""})
            function = call.get("function") or {}
            slot["name"] += function.get("name") or ""
            slot["arguments"] += function.get("arguments") or ""
        for entry in (choice.get("logprobs") or {}).get("content") or ():
            self.sampler.append(_sampler_token(entry))
        reason = choice.get("finish_reason")
        if reason is not None:
            self.finish = _FINISH.get(str(reason), Finish.STOP)

    def message(self) -> dict[str, Any]:
        calls = []
        for _, call in sorted(self.calls.items()):
            arguments = call["arguments"] or "{}"
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.dumps(json.loads(arguments), ensure_ascii=False)  # canonical spacing
            calls.append({"function": {"name": call["name"], "arguments": arguments}})
        return {"content": "".join(self.content), "reasoning_content": "".join(self.reasoning), "tool_calls": calls}


def _sampler_token(entry: Mapping[str, Any]) -> tuple[bytes, float]:
    """One `logprobs.content[]` entry: the token's bytes (`bytes` if given, else its text) and logprob."""
    try:
        raw = entry.get("bytes")
        token = bytes(raw) if raw is not None else str(entry.get("token", "")).encode()
        return token, float(entry["logprob"])
    except (KeyError, TypeError, ValueError) as exc:
        raise Internal(f"upstream chat logprobs entry is malformed: {str(entry)[:200]} ({exc!r})") from None


def _upstream_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A checked message as OpenAI takes it: no `reasoning_content`, no tool `name` (not input fields there)."""
    out = {
        k: v for k, v in message.items() if k != "reasoning_content" and not (k == "name" and message["role"] == "tool")
    }
    if out.get("role") == "assistant" and out.get("tool_calls") and not out.get("content"):
        out["content"] = None
    return out


def _retry_after(response: httpx.Response, deadline: float) -> float | None:
    """Seconds to wait before retrying a 429 that fits before `deadline`; None to stop retrying."""
    if response.status_code != 429:
        return None
    delay = _parse_retry_after(response.headers.get("retry-after"))
    if delay is None or delay > MAX_RETRY_AFTER or time.monotonic() + delay >= deadline:
        return None
    log.info("upstream rate-limited the call; retrying in %.1fs", delay)
    return delay


def _parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


async def _raise_for_status(response: httpx.Response, base_url: str = "", path: str = "") -> None:
    status = response.status_code
    if status < 400:
        return
    await response.aread()
    error: Any = {}
    try:
        payload = response.json()
        error = payload.get("error", {}) if isinstance(payload, Mapping) else {}
        if not isinstance(error, Mapping):
            error = {"message": str(error)}
        message = error.get("message") or payload.get("message") or payload.get("detail") or response.text
    except (ValueError, AttributeError):
        message = response.text
    upstream = str(message)[:500]
    code = f"{error.get('code') or ''} {error.get('type') or ''}"
    where = f"upstream {base_url}{path}".strip()
    said = f"{where} answered HTTP {status}: {upstream}"
    meta = {"http_status": str(status), "upstream_message": upstream[:200]}
    if status == 401:
        raise Unauthenticated(
            f"{said}; give the upstream's API key with --upstream-api-key-file or GYMRPC_UPSTREAM_API_KEY",
            reason="UPSTREAM_AUTH_FAILED",
            metadata=meta,
        )
    if status == 403:
        raise PermissionDenied(
            f"{said}; the API key is not allowed to use this model or route",
            reason="UPSTREAM_AUTH_FAILED",
            metadata=meta,
        )
    if status == 429:
        delay = _parse_retry_after(response.headers.get("retry-after"))
        raise ResourceExhausted(
            f"{said}; still rate-limited at the call's deadline, retry later or lower the concurrency",
            reason="UPSTREAM_RATE_LIMITED",
            metadata=meta,
            retry_delay=delay if delay is not None else 1.0,
        )
    if status in (400, 404, 422) and (_MODEL_MISSING.search(upstream) or "model_not_found" in code):
        raise FailedPrecondition(
            f"{said}; pick a served model with --upstream-model (GET /v1/models lists them)",
            reason="UPSTREAM_MODEL_NOT_FOUND",
            metadata=meta,
        )
    if status in (400, 413, 422) and (_CONTEXT_LENGTH.search(upstream) or "context_length" in code):
        raise InvalidArgument(
            f"{said}; shorten the conversation or lower sampling.max_tokens",
            reason="UPSTREAM_CONTEXT_LENGTH",
            metadata=meta,
        )
    if status in (400, 422):
        raise InvalidArgument(said, reason="UPSTREAM_REJECTED", metadata=meta)
    if status in (404, 405):
        raise FailedPrecondition(said, reason="UPSTREAM_NOT_FOUND", metadata={**meta, "route": path})
    raise Unavailable(said, reason="BACKEND_FAILURE", metadata=meta)


def _first_choice(payload: Any) -> Mapping[str, Any]:
    choices = payload.get("choices") if isinstance(payload, Mapping) else None
    if not choices:
        raise Internal(f"upstream response has no choices: {str(payload)[:300]}")
    return choices[0]


def parse_choice(choice: Mapping[str, Any], weight_version: str) -> CompletionDelta:
    """Token ids and logprobs of one completions choice (a whole reply or one stream chunk)."""
    logprobs = choice.get("logprobs") or {}
    token_ids = choice.get("token_ids")
    if token_ids is None and logprobs.get("tokens") is not None:
        try:
            token_ids = [int(str(t).removeprefix("token_id:")) for t in logprobs["tokens"]]
        except ValueError:
            raise Internal("upstream logprob tokens are not 'token_id:N' (return_tokens_as_token_ids)") from None
    if token_ids is None and not choice.get("text"):
        token_ids = []  # a chunk that carries no tokens (for example only the prompt ids)
    if token_ids is None:
        raise Internal("upstream returned no token ids; it needs vLLM >= 0.10.2 (return_token_ids)")
    values = logprobs.get("token_logprobs")
    if values is not None:
        if len(values) != len(token_ids):
            raise Internal(f"upstream returned {len(token_ids)} token ids but {len(values)} logprobs")
        values = tuple(float(v) if v is not None else float("nan") for v in values)
    reason = choice.get("finish_reason")
    finish = None if reason is None else _FINISH.get(str(reason), Finish.STOP)
    return CompletionDelta(tuple(int(t) for t in token_ids), values, finish, weight_version)
