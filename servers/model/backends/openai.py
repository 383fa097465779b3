"""A backend that forwards rendered prompt ids to an OpenAI-compatible server (`vllm serve`).

The server owns templating, so this uses `/v1/completions` with the prompt as a
list of token ids, never `/v1/chat/completions`. Per `reference/vllm.md` §3
(verified with vLLM 0.32): `return_token_ids: true` adds `choices[].token_ids`
(per chunk when streaming), `logprobs: k` gives `choices[].logprobs.token_logprobs`,
`return_tokens_as_token_ids: true` writes the logprob tokens as `token_id:N` (used
when `token_ids` is missing), `request_id` in the body names the engine request
`cmpl-<request_id>-0`, and `POST /abort_requests` (dev mode) aborts it keeping the
partial tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from gymrpc.errors import FailedPrecondition, GymrpcError, Internal, InvalidArgument, Unavailable
from servers.model.backends.base import (
    Completion,
    CompletionDelta,
    Conversation,
    Finish,
    ModelBackend,
    Sampling,
)
from servers.model.backends.vllm_weights import WEIGHTS_EXTENSION
from servers.model.weights.folder import TensorSpec, WeightsFolder, open_folder

_FINISH = {"stop": Finish.STOP, "length": Finish.LENGTH, "abort": Finish.ABORT, "tool_calls": Finish.STOP}


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
        transport: httpx.AsyncBaseTransport | None = None,
        weights_model: Path | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.weight_version = weight_version
        self.dev_abort = dev_abort
        """Also call the upstream's `/abort_requests` (vLLM with VLLM_SERVER_DEV_MODE=1)."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout, transport=transport)
        self._aborts: dict[str, asyncio.Event] = {}
        self._model_lock = asyncio.Lock()
        self._specs: dict[str, TensorSpec] | None = None
        if weights_model is not None:
            self._specs = open_folder(weights_model.resolve()).specs()
        """Tensors of the model the upstream loaded (`--upstream-weights`); None: updates are off."""

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
        body = self.request_body(prompt_token_ids, sampling, request_id, await self._model(), stream=False)
        aborted = self._aborts.setdefault(request_id, asyncio.Event())
        post = asyncio.ensure_future(self._post_json("/v1/completions", body))
        waiter = asyncio.ensure_future(aborted.wait())
        try:
            done, _ = await asyncio.wait({post, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if post not in done and not self.dev_abort:
                # Without the dev endpoint, dropping the connection is the abort; the partial is lost.
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
        body = self.request_body(prompt_token_ids, sampling, request_id, await self._model(), stream=True)
        aborted = self._aborts.setdefault(request_id, asyncio.Event())
        finished = False
        try:
            async with (
                self._errors("/v1/completions"),
                self._http.stream("POST", "/v1/completions", json=body) as r,
            ):
                await _raise_for_status(r)
                async for line in r.aiter_lines():
                    if aborted.is_set() and not self.dev_abort:
                        break
                    if not line.startswith("data:"):
                        continue
                    data = line.removeprefix("data:").strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise Unavailable(f"upstream stream failed: {chunk['error']}")
                    if not chunk.get("choices"):
                        continue  # a usage-only chunk
                    delta = parse_choice(_first_choice(chunk), self.weight_version)
                    finished = finished or delta.finish is not None
                    yield delta
        finally:
            self._aborts.pop(request_id, None)
        if not finished:
            yield CompletionDelta((), (), Finish.ABORT, self.weight_version)

    async def abort(self, request_id: str) -> bool:
        event = self._aborts.get(request_id)
        if event is None:
            return False
        if self.dev_abort:
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
                    async with self._errors("/v1/models"):
                        response = await self._http.get("/v1/models")
                        await _raise_for_status(response)
                    models = response.json().get("data") or []
                    if not models:
                        raise FailedPrecondition(f"upstream {self.base_url} serves no models")
                    self.model = str(models[0]["id"])
        return self.model

    async def _post_json(self, path: str, body: Mapping[str, Any]) -> Any:
        async with self._errors(path):
            response = await self._http.post(path, json=body)
            await _raise_for_status(response)
            return response.json()

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


async def _raise_for_status(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    await response.aread()
    try:
        message = response.json().get("error", {}).get("message") or response.text
    except (ValueError, AttributeError):
        message = response.text
    message = f"upstream answered HTTP {response.status_code}: {str(message)[:500]}"
    if response.status_code in (400, 422):
        raise InvalidArgument(message, reason="UPSTREAM_REJECTED")
    if response.status_code == 404:
        raise FailedPrecondition(message, reason="UPSTREAM_NOT_FOUND")
    raise Unavailable(message)


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
