"""The in-process vLLM backend on a real engine: tokens and logprobs, cuts, pause, and a transformers check.

One engine (random tiny model, which babbles without ending: long generations to cut) serves
the whole module; every test drives it through the `ModelBackend` interface the server uses.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gymrpc.chat import ChatTemplate, default_tokenizer
from gymrpc.errors import InvalidArgument
from gymrpc.servers.model.backends.base import CompletionDelta, Finish, Sampling

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOKENIZER = default_tokenizer()
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {}}}
]
# Tools make the prompt longer than two 128-token KV blocks (the CPU block size), so a
# continuation can be served from the prefix cache.
PROMPT = ChatTemplate(TOKENIZER).render([{"role": "user", "content": "Tell me a long story about the sea."}], TOOLS)
GREEDY = Sampling(max_tokens=96, temperature=0.0, stop_token_ids=TOKENIZER.stop_token_ids)


@pytest.fixture
def backend(random_backend: Any) -> Any:
    return random_backend


class Collected:
    """Every delta of one stream, added up."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish: Finish | None = None
        self.versions: set[str] = set()
        self.deltas = 0

    def add(self, delta: CompletionDelta) -> None:
        self.deltas += 1
        self.token_ids += delta.token_ids
        assert delta.logprobs is not None
        assert len(delta.logprobs) == len(delta.token_ids)
        self.logprobs += delta.logprobs
        self.versions.add(delta.weight_version)
        if delta.finish is not None:
            assert self.finish is None, "a second final delta"
            self.finish = delta.finish

    async def drain(self, stream: AsyncIterator[CompletionDelta], on_token: Any = None) -> Collected:
        async for delta in stream:
            self.add(delta)
            if on_token is not None:
                await on_token(self)
        return self


async def _stream(backend: Any, request_id: str, sampling: Sampling = GREEDY, prompt: Any = None) -> Collected:
    return await Collected().drain(backend.stream(prompt or PROMPT.token_ids, sampling, request_id))


def test_stream_gives_token_ids_logprobs_and_a_finish_reason(backend: Any, loop_thread: Any) -> None:
    got = loop_thread.run(_stream(backend, "plain"))
    assert got.finish is Finish.LENGTH
    assert len(got.token_ids) == GREEDY.max_tokens
    assert got.deltas > 1  # streamed (DELTA mode merges outputs only while the consumer lags)
    assert all(-20.0 < lp <= 0.0 for lp in got.logprobs)
    assert got.versions == {"vllm:tiny-random"}
    again = loop_thread.run(backend.generate(PROMPT.token_ids, GREEDY, "plain-unary"))
    assert list(again.token_ids) == got.token_ids  # greedy: the same tokens unary and streamed
    assert again.logprobs == pytest.approx(got.logprobs, abs=1e-4)


def test_cut_then_continue_from_prompt_plus_partial_equals_the_uninterrupted_output(
    backend: Any, loop_thread: Any
) -> None:
    reference = loop_thread.run(_stream(backend, "whole"))

    async def cut_and_continue() -> tuple[Collected, Collected]:
        async def abort_at_24(progress: Collected) -> None:
            if len(progress.token_ids) >= 24:
                await backend.abort("cut")

        partial = await Collected().drain(backend.stream(PROMPT.token_ids, GREEDY, "cut"), abort_at_24)
        rest = await Collected().drain(backend.continue_stream(PROMPT.token_ids, partial.token_ids, GREEDY, "cut"))
        return partial, rest

    partial, rest = loop_thread.run(cut_and_continue())
    assert partial.finish is Finish.ABORT
    assert 24 <= len(partial.token_ids) < len(reference.token_ids)
    assert partial.token_ids + rest.token_ids == reference.token_ids
    assert partial.logprobs + rest.logprobs == pytest.approx(reference.logprobs, abs=1e-4)
    assert rest.finish is Finish.LENGTH  # the budget was the original max_tokens, less the partial
    # Every full KV block of prompt + partial was cached by the first run (never the last token).
    block = backend.engine.vllm_config.cache_config.block_size
    expected = (len(PROMPT.token_ids) + len(partial.token_ids) - 1) // block * block
    assert expected > 0
    assert backend.cached_tokens("cut") == expected


def test_abort_before_the_engine_knows_the_request_still_stops_it(backend: Any, loop_thread: Any) -> None:
    long = Sampling(max_tokens=1500, temperature=0.0)

    async def run() -> Collected:
        stream = backend.stream(PROMPT.token_ids, long, "early")
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # the stream registered its run; the engine has not seen the request yet
        assert await backend.abort("early")
        got = Collected()
        got.add(await first)
        return await got.drain(stream)

    got = loop_thread.run(run(), timeout=60)
    assert got.finish is Finish.ABORT
    assert len(got.token_ids) < 100  # not the 1500 it would run to if the abort had been lost
    assert not loop_thread.run(backend.abort("early"))  # over: nothing to abort


def test_an_abort_before_the_first_output_ends_the_stream_while_the_engine_produces_nothing(
    backend: Any, loop_thread: Any
) -> None:
    """A checkpoint's cut must not wait for a request's first token (a paused engine, a long queue):
    the stream ends at once, and the engine's request is aborted once it shows up."""
    if not backend.supports_pause:
        pytest.skip("this vLLM release has no pause_generation")
    long = Sampling(max_tokens=1500, temperature=0.0)

    async def run() -> Collected:
        await backend.pause("keep")
        try:
            stream = backend.stream(PROMPT.token_ids, long, "queued")
            first = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0)  # the stream registered its run; vLLM has not registered the request yet
            assert await backend.abort("queued")
            got = Collected()
            got.add(await asyncio.wait_for(first, 60))  # paused: no output of the engine ended it
            await got.drain(stream)
        finally:
            await backend.resume()
        async with asyncio.timeout(60):
            while backend.in_flight():  # noqa: ASYNC110 - the engine request, aborted at its first output
                await asyncio.sleep(0.05)
        return got

    got = loop_thread.run(run(), timeout=180)
    assert got.finish is Finish.ABORT
    assert got.token_ids == []


def test_pause_keep_freezes_generation_and_resume_continues_it_unchanged(backend: Any, loop_thread: Any) -> None:
    if not backend.supports_pause:
        pytest.skip("this vLLM release has no pause_generation")
    sampling = Sampling(max_tokens=300, temperature=0.0)
    reference = loop_thread.run(_stream(backend, "unpaused", sampling))

    async def run() -> tuple[int, int, Collected]:
        reached = asyncio.Event()

        async def note(progress: Collected) -> None:
            if len(progress.token_ids) >= 20:
                reached.set()

        got = Collected()
        task = asyncio.ensure_future(got.drain(backend.stream(PROMPT.token_ids, sampling, "paused"), note))
        await reached.wait()
        await backend.pause("keep")
        assert await backend.is_paused()
        # Outputs already on their way still arrive, however long a busy machine takes to deliver
        # them (vLLM answers the pause before its output handler drains): wait until none came for a
        # while, then check that none comes for a second more.
        frozen = -1
        for _ in range(50):
            if len(got.token_ids) == frozen:
                break
            frozen = len(got.token_ids)
            await asyncio.sleep(0.3)
        await asyncio.sleep(1.0)
        still = len(got.token_ids)
        await backend.resume()
        return frozen, still, await task

    frozen, still, got = loop_thread.run(run())
    assert still == frozen < len(reference.token_ids)
    assert got.finish is Finish.LENGTH
    assert got.token_ids == reference.token_ids


def test_a_paused_generation_can_be_cut(backend: Any, loop_thread: Any) -> None:
    """A checkpoint may freeze everything first and then cut what it keeps: abort must work while paused."""
    if not backend.supports_pause:
        pytest.skip("this vLLM release has no pause_generation")
    sampling = Sampling(max_tokens=600, temperature=0.0)

    async def run() -> Collected:
        reached = asyncio.Event()

        async def note(progress: Collected) -> None:
            if len(progress.token_ids) >= 10:
                reached.set()

        got = Collected()
        task = asyncio.ensure_future(got.drain(backend.stream(PROMPT.token_ids, sampling, "paused-cut"), note))
        await reached.wait()
        await backend.pause("keep")
        try:
            assert await backend.abort("paused-cut")
            return await asyncio.wait_for(task, 30)
        finally:
            await backend.resume()

    got = loop_thread.run(run())
    assert got.finish is Finish.ABORT
    assert 10 <= len(got.token_ids) < 600


def test_weight_version_names_the_weights_that_sampled(backend: Any, loop_thread: Any) -> None:
    short = Sampling(max_tokens=4, temperature=0.0)
    try:
        loop_thread.run(backend.set_weight_version("iteration:7"))
        got = loop_thread.run(_stream(backend, "versioned", short))
        assert got.versions == {"iteration:7"}
        assert loop_thread.run(backend.engine_weight_version()) == "iteration:7"
    finally:
        loop_thread.run(backend.set_weight_version("vllm:tiny-random"))


def test_concurrent_streams_all_finish(backend: Any, loop_thread: Any) -> None:
    async def run() -> list[Collected]:
        prompts = [PROMPT.token_ids[: len(PROMPT.token_ids) - k] for k in range(6)]
        sampling = Sampling(max_tokens=48, temperature=1.0, seed=3)
        return await asyncio.gather(*(_stream(backend, f"many-{k}", sampling, p) for k, p in enumerate(prompts)))

    for got in loop_thread.run(run()):
        assert got.finish is Finish.LENGTH
        assert len(got.token_ids) == len(got.logprobs) == 48
        assert all(math.isfinite(lp) for lp in got.logprobs)
    assert backend.in_flight() == 0


@pytest.mark.parametrize(
    ("prompt", "message"),
    [([5] * 2100, "longer than"), ([5, 999_999], "out of vocabulary")],
    ids=["too-long", "unknown-id"],
)
def test_prompts_the_engine_refuses_are_invalid_arguments(
    backend: Any, loop_thread: Any, prompt: list[int], message: str
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        loop_thread.run(_stream(backend, f"bad-{message}", prompt=prompt))
    assert caught.value.reason == "ENGINE_REJECTED"
    assert backend.in_flight() == 0


def test_tokens_and_logprobs_match_a_transformers_reference(backend: Any, loop_thread: Any, random_model: Path) -> None:
    """Greedy ids from HF `generate` equal vLLM's; HF logprobs of those ids (teacher-forced) agree."""
    import torch
    from transformers import AutoModelForCausalLM

    sampling = Sampling(max_tokens=64, temperature=0.0, stop_token_ids=TOKENIZER.stop_token_ids)
    got = loop_thread.run(_stream(backend, "vs-hf", sampling))
    model = AutoModelForCausalLM.from_pretrained(random_model, dtype=torch.float32).eval()
    prompt = torch.tensor([PROMPT.token_ids])
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=64, do_sample=False)
        hf_ids = generated[0, prompt.shape[1] :].tolist()
        full = torch.tensor([[*PROMPT.token_ids, *got.token_ids]])
        logits = model(full).logits[0, prompt.shape[1] - 1 : -1].float()
    hf_logprobs = logits.log_softmax(-1).gather(-1, torch.tensor(got.token_ids).unsqueeze(-1)).squeeze(-1).tolist()
    assert hf_ids == got.token_ids
    assert got.logprobs == pytest.approx(hf_logprobs, abs=2e-3)
