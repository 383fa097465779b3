"""The OpenAI-compatible upstream backend against a real vLLM OpenAI server on loopback.

What `servers/model/backends/openai.py` assumes about vLLM (reference/vllm.md §3) is checked
on the real thing: `/v1/completions` with a token-id prompt, `return_token_ids`, `logprobs: 0`
(the sampled token's logprob, no alternatives), and `/abort_requests` by the engine's id
`cmpl-<request_id>-0`, keeping the partial. The random tiny model babbles without ending, so
aborted generations are long. Streaming chunks arrive in bursts on a 2-core machine, so
the engine is stopped (SIGSTOP) and let run in short bursts until the upstream's metrics count
tokens, then aborted while stopped: a busy machine cannot let it finish first.
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
from tests.vllm.helpers import OpenAIServer, processes_continued

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

    async def run() -> tuple[Completion, bool, bool]:
        backend = OpenAIBackend(upstream.url, dev_abort=True)
        try:
            await backend.probe()  # its test generations first: only the call's tokens count below
            with upstream.engine_stopped() as engine:
                call = asyncio.ensure_future(backend.generate(PROMPT, long, "unary-abort"))
                await _generate_a_little(upstream, engine, call)
                aborted = await backend.abort("unary-abort")
            completion = await asyncio.wait_for(call, 60)
            return completion, aborted, await backend.abort("unary-abort")
        finally:
            await backend.close()

    completion, aborted, again = asyncio.run(run())
    assert aborted
    assert not again  # finished: nothing left to abort
    assert completion.finish is Finish.ABORT
    assert 0 < len(completion.token_ids) < 1800
    assert completion.logprobs is not None
    assert len(completion.logprobs) == len(completion.token_ids)


def test_abort_of_a_stream_ends_it_with_abort_and_its_tokens(upstream: OpenAIServer) -> None:
    long = Sampling(max_tokens=1800, temperature=0.0)

    async def run() -> tuple[list[int], Finish | None]:
        backend = OpenAIBackend(upstream.url, dev_abort=True)
        ids: list[int] = []
        finish = None

        async def consume() -> None:
            nonlocal finish
            async for delta in backend.stream(PROMPT, long, "stream-abort"):
                ids.extend(delta.token_ids)
                finish = delta.finish or finish

        try:
            await backend.probe()
            with upstream.engine_stopped() as engine:
                task = asyncio.ensure_future(consume())
                await _generate_a_little(upstream, engine, task)
                assert await backend.abort("stream-abort")
            await asyncio.wait_for(task, 60)
            return ids, finish
        finally:
            await backend.close()

    ids, finish = asyncio.run(run())
    assert finish is Finish.ABORT
    assert 0 < len(ids) < 1800


async def _generate_a_little(upstream: OpenAIServer, engine: list[int], call: asyncio.Future[Any]) -> None:
    """Let the stopped engine run in bursts until the upstream counts generated tokens.

    Stopping the engine once the API server shows tokens can be too late: on a busy machine the
    engine runs far ahead of the server, and the request may be generated to its end and only not
    delivered yet. A burst lasts from one signal to the next, with no sleep between: a scheduler's
    time slice or so, far too short to generate a long request to its end.
    """
    import httpx

    loop = asyncio.get_running_loop()
    deadline = loop.time() + 600
    async with httpx.AsyncClient(base_url=upstream.url) as http:
        before = await _generated_tokens(http)  # the engine is stopped and `call` the only request
        while await _generated_tokens(http) <= before:
            if call.done():
                raise AssertionError(f"the call ended before the engine generated anything: {call.result()}")
            if loop.time() > deadline:
                raise TimeoutError("the upstream generated nothing in 600 s")
            with processes_continued(engine):
                pass


async def _generated_tokens(http: Any) -> float:
    """The upstream's count of generated tokens, from its metrics."""
    metrics = (await http.get("/metrics")).text
    lines = [line for line in metrics.splitlines() if line.startswith("vllm:generation_tokens_total")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)
