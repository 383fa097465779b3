"""The OpenAI-compatible upstream backend against a real vLLM OpenAI server on loopback.

What `servers/model/backends/openai.py` assumes about vLLM (reference/vllm.md §3) is checked
on the real thing: `/v1/completions` with a token-id prompt, `return_token_ids`, `logprobs: 0`
(the sampled token's logprob, no alternatives), and `/abort_requests` by the engine's id
`cmpl-<request_id>-0`, keeping the partial. The random tiny model babbles without ending, so
aborted generations are long. Streaming chunks arrive in bursts on a 2-core machine, so
aborts are triggered by the upstream's own progress, never by chunk timing.
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
            call = asyncio.ensure_future(backend.generate(PROMPT, long, request_id))
            if not await _until_running(upstream, call):
                await call
                return None
            aborted = await backend.abort(request_id)
            completion = await asyncio.wait_for(call, 60)
            if completion.finish is Finish.LENGTH:
                return None  # the engine finished first: the abort came too late to tell anything
            return completion, aborted, await backend.abort(request_id)
        finally:
            await backend.close()

    async def run() -> tuple[Completion, bool, bool]:
        # Unary calls give no sign of progress but the upstream's metrics, which a busy machine
        # can read too late; a late attempt is retried, a wrong one fails below.
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
            assert await backend.abort(request_id)
            await asyncio.wait_for(task, 60)
            # On a busy machine the engine can generate all 1800 tokens while this reader is still at
            # its first chunk: then the abort came too late to tell anything.
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


async def _until_running(upstream: OpenAIServer, call: asyncio.Future[Any], timeout: float = 30.0) -> bool:
    """Until the upstream reports a running request and has generated for a moment; False if `call` ended first."""
    import httpx

    deadline = asyncio.get_running_loop().time() + timeout
    async with httpx.AsyncClient(base_url=upstream.url) as http:
        while asyncio.get_running_loop().time() < deadline and not call.done():
            metrics = (await http.get("/metrics")).text
            running = [line for line in metrics.splitlines() if line.startswith("vllm:num_requests_running")]
            if any(float(line.rsplit(" ", 1)[1]) >= 1 for line in running):
                await asyncio.sleep(0.2)  # some tokens, far from 1800 (~300 tok/s)
                return not call.done()
            await asyncio.sleep(0.02)
    if call.done():
        return False
    raise TimeoutError("the upstream never reported the request running")
