"""The OpenAI-compatible upstream backend against a real vLLM OpenAI server on loopback.

What `servers/model/backends/openai.py` assumes about vLLM (reference/vllm.md §3) is checked
on the real thing: `/v1/completions` with a token-id prompt, `return_token_ids`, `logprobs: 0`
(the sampled token's logprob, no alternatives), and `/abort_requests` by the engine's id
`cmpl-<request_id>-0`, keeping the partial. The random tiny model babbles without ending, and
the upstream runs `tests/vllm/slow_steps.py`, so a long generation takes over a minute: however
late a busy machine delivers the first tokens (streaming chunks come in bursts on 2 cores), the
abort that follows them reaches a running request. It is sent while the engine is stopped
(SIGSTOP), so nothing is generated between the decision and the abort.
"""

from __future__ import annotations

import asyncio
import time
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
    server = OpenAIServer(
        random_model,
        tmp_path_factory.mktemp("openai") / "vllm.log",
        extra_args=("--logits-processors", "tests.vllm.slow_steps:SlowSteps"),
    )
    try:
        _check_slowed(server)
        yield server
    finally:
        server.stop()


def _check_slowed(server: OpenAIServer) -> None:
    """The abort tests rely on slow steps: fail loudly if the plug-in did not load."""
    import httpx

    from tests.vllm.slow_steps import STEP_SECONDS  # imports vLLM: only in the tier's venv

    tokens = 10
    body = {"model": "tiny", "prompt": list(PROMPT), "max_tokens": tokens, "ignore_eos": True}
    started = time.monotonic()
    httpx.post(f"{server.url}/v1/completions", json=body, timeout=600).raise_for_status()
    assert time.monotonic() - started >= tokens * STEP_SECONDS, "the upstream ignored tests.vllm.slow_steps"


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
            await backend.probe()  # its one-token completion must not pass for the call's first tokens
            generated = await _generated_tokens(upstream)
            call = asyncio.ensure_future(backend.generate(PROMPT, long, "unary-abort"))
            # A unary call gives no sign of progress but the upstream's metrics.
            await _until_generating(upstream, call, generated)
            with upstream.engine_stopped():
                aborted = await backend.abort("unary-abort")
            completion = await asyncio.wait_for(call, 120)
            return completion, aborted, await backend.abort("unary-abort")
        finally:
            await backend.close()

    completion, aborted, again = asyncio.run(run())
    assert aborted
    assert not again  # finished: nothing left to abort
    assert completion.finish is Finish.ABORT, f"{len(completion.token_ids)} tokens, finish {completion.finish}"
    assert 0 < len(completion.token_ids) < 1800
    assert completion.logprobs is not None
    assert len(completion.logprobs) == len(completion.token_ids)


def test_abort_of_a_stream_ends_it_with_abort_and_its_tokens(upstream: OpenAIServer) -> None:
    long = Sampling(max_tokens=1800, temperature=0.0)

    async def run() -> tuple[list[int], Finish | None]:
        backend = OpenAIBackend(upstream.url, dev_abort=True)
        try:
            ids: list[int] = []
            finish = None
            streaming = asyncio.Event()

            async def consume() -> None:
                nonlocal finish
                async for delta in backend.stream(PROMPT, long, "stream-abort"):
                    ids.extend(delta.token_ids)
                    finish = delta.finish or finish
                    streaming.set()

            task = asyncio.ensure_future(consume())
            await asyncio.wait_for(streaming.wait(), 120)
            with upstream.engine_stopped():
                assert await backend.abort("stream-abort")
            await asyncio.wait_for(task, 120)
            return ids, finish
        finally:
            await backend.close()

    ids, finish = asyncio.run(run())
    assert finish is Finish.ABORT, f"{len(ids)} tokens, finish {finish}"
    assert 0 < len(ids) < 1800


async def _generated_tokens(upstream: OpenAIServer) -> float:
    """The upstream's count of generated tokens, from its metrics."""
    import httpx

    async with httpx.AsyncClient(base_url=upstream.url) as http:
        metrics = (await http.get("/metrics")).text
    lines = [line for line in metrics.splitlines() if line.startswith("vllm:generation_tokens_total")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


async def _until_generating(upstream: OpenAIServer, call: asyncio.Future[Any], before: float) -> None:
    """Until the upstream generated tokens since `before`: the call's first ones."""
    deadline = asyncio.get_running_loop().time() + 600
    while await _generated_tokens(upstream) <= before:
        if call.done():
            raise AssertionError(f"the call ended before the upstream counted a token: {call.result()}")
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("the upstream generated nothing in 600 s")
        await asyncio.sleep(0.02)
