"""The OpenAI-compatible upstream backend against a real vLLM OpenAI server on loopback.

What `servers/model/backends/openai.py` assumes about vLLM (reference/vllm.md §3) is checked
on the real thing: `/v1/completions` with a token-id prompt, `return_token_ids`, `logprobs: 0`
(the sampled token's logprob, no alternatives), and `/abort_requests` by the engine's id
`cmpl-<request_id>-0`, keeping the partial. The random tiny model babbles without ending, so
aborted generations are long. Streaming chunks arrive in bursts on a 2-core machine, so
aborts are triggered by the upstream's own progress, never by chunk timing, and sent while the
engine is stopped (SIGSTOP), so a busy machine cannot let it finish first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gymrpc.chat import ChatTemplate, default_tokenizer
from gymrpc.servers.model.backends.base import Completion, Finish, Sampling
from gymrpc.servers.model.backends.openai import OpenAIBackend
from tests.vllm.helpers import OpenAIServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOKENIZER = default_tokenizer()
PROMPT = ChatTemplate(TOKENIZER).render([{"role": "user", "content": "Tell me a long story about the sea."}]).token_ids


@pytest.fixture(scope="module")
def upstream(random_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAIServer]:
    server = OpenAIServer(random_model, tmp_path_factory.mktemp("openai") / "vllm.log")
    yield server
    server.stop()


def test_completions_give_token_ids_and_sampled_logprobs(upstream: OpenAIServer) -> None:
    sampling = Sampling(max_tokens=40, temperature=0.0, stop_token_ids=TOKENIZER.stop_token_ids)

    async def run() -> tuple[list[int], list[float], Finish | None, Completion]:
        backend = OpenAIBackend(upstream.url, weight_version="upstream:0")
        try:
            ids: list[int] = []
            logprobs: list[float] = []
            finish = None
            async for delta in backend.stream(PROMPT, sampling, "stream-1"):
                ids += delta.token_ids
                logprobs += delta.logprobs or ()
                finish = delta.finish or finish
            return ids, logprobs, finish, await backend.generate(PROMPT, sampling, "unary-1")
        finally:
            await backend.close()

    ids, logprobs, finish, unary = asyncio.run(run())
    assert finish is Finish.LENGTH
    assert len(ids) == len(logprobs) == 40
    assert all(-20.0 < lp <= 0.0 for lp in logprobs)
    assert list(unary.token_ids) == ids  # greedy: streamed and unary agree
    assert unary.logprobs == pytest.approx(logprobs, abs=1e-4)
    assert unary.finish is Finish.LENGTH
    assert unary.weight_version == "upstream:0"


def test_abort_by_the_engine_request_id_keeps_the_partial(upstream: OpenAIServer) -> None:
    long = Sampling(max_tokens=1800, temperature=0.0)

    async def attempt(request_id: str) -> tuple[Completion, bool, bool] | None:
        """One abort mid-generation; None when the generation ended before the abort reached it."""
        backend = OpenAIBackend(upstream.url, dev_abort=True)
        try:
            generated = await _generated_tokens(upstream)
            call = asyncio.ensure_future(backend.generate(PROMPT, long, request_id))
            if not await _until_generating(upstream, call, generated):
                await call
                return None
            with upstream.engine_stopped():
                aborted = await backend.abort(request_id)
            completion = await asyncio.wait_for(call, 60)
            if completion.finish is Finish.LENGTH:
                return None  # the engine finished first: the abort came too late to tell anything
            return completion, aborted, await backend.abort(request_id)
        finally:
            await backend.close()

    async def run() -> tuple[Completion, bool, bool]:
        # Unary calls give no sign of progress but the upstream's metrics; the engine is stopped
        # while the abort is sent, so only a generation that ended before the stop is retried.
        for n in range(4):
            if (result := await attempt(f"unary-abort-{n}")) is not None:
                return result
        raise AssertionError("every generation finished before its abort; the abort never took effect")

    completion, aborted, again = asyncio.run(run())
    assert aborted
    assert not again  # finished: nothing left to abort
    assert completion.finish is Finish.ABORT
    assert 0 < len(completion.token_ids) < 1800
    assert completion.logprobs is not None
    assert len(completion.logprobs) == len(completion.token_ids)


def test_abort_of_a_stream_ends_it_with_abort_and_its_tokens(upstream: OpenAIServer) -> None:
    long = Sampling(max_tokens=1800, temperature=0.0)

    async def attempt(request_id: str) -> tuple[list[int], Finish | None] | None:
        """One abort once tokens flow; None when the engine finished before the abort reached it."""
        backend = OpenAIBackend(upstream.url, dev_abort=True)
        try:
            ids: list[int] = []
            finish = None
            streaming = asyncio.Event()

            async def consume() -> None:
                nonlocal finish
                async for delta in backend.stream(PROMPT, long, request_id):
                    ids.extend(delta.token_ids)
                    finish = delta.finish or finish
                    streaming.set()

            task = asyncio.ensure_future(consume())
            await asyncio.wait_for(streaming.wait(), 60)
            with upstream.engine_stopped():
                assert await backend.abort(request_id)
            await asyncio.wait_for(task, 60)
            # On a busy machine the engine can generate all 1800 tokens while this reader is still at
            # its first chunk, before the engine was stopped: then the abort tells nothing.
            return None if finish is Finish.LENGTH and len(ids) == long.max_tokens else (ids, finish)
        finally:
            await backend.close()

    async def run() -> tuple[list[int], Finish | None]:
        for n in range(4):
            if (result := await attempt(f"stream-abort-{n}")) is not None:
                return result
        raise AssertionError("every stream finished before its abort; the abort never took effect")

    ids, finish = asyncio.run(run())
    assert finish is Finish.ABORT
    assert 0 < len(ids) < 1800


async def _generated_tokens(upstream: OpenAIServer) -> float:
    """The upstream's count of generated tokens, from its metrics."""
    import httpx

    async with httpx.AsyncClient(base_url=upstream.url) as http:
        metrics = (await http.get("/metrics")).text
    lines = [line for line in metrics.splitlines() if line.startswith("vllm:generation_tokens_total")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


async def _until_generating(upstream: OpenAIServer, call: asyncio.Future[Any], before: float) -> bool:
    """Until the upstream generated tokens since `before` (the call's first ones); False if `call` ended first."""
    deadline = asyncio.get_running_loop().time() + 600
    while not call.done():
        if await _generated_tokens(upstream) > before:
            return not call.done()
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("the upstream generated nothing in 600 s")
        await asyncio.sleep(0.02)
    return False
