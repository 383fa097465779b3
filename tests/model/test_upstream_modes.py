"""The openai backend against real loopback HTTP servers: mode probe, chat mode, errors, cut continuation.

The upstreams are `tests.model.upstreams.FakeUpstream`: a chat-only OpenAI-compatible
server with tool calling, and a vLLM-style token-level one without an abort endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gymrpc.chat import DEFAULT_SYSTEM, default_tokenizer
from gymrpc.control import ControlPlane, Phase
from gymrpc.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unauthenticated
from gymrpc.servers.model.backends.base import Conversation, Sampling
from gymrpc.servers.model.backends.openai import OpenAIBackend
from gymrpc.servers.model.participant import ModelParticipant
from gymrpc.servers.model.service import ModelServicer
from gymrpc.v1 import common_pb2
from gymrpc.v1 import model_service_pb2 as pb
from tests.control.test_model import soon
from tests.model.upstreams import FakeUpstream, RunningUpstream

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = default_tokenizer()
SAMPLING = Sampling(max_tokens=64, temperature=0.0, stop_token_ids=TOKENIZER.stop_token_ids)


@pytest.fixture
def serve() -> Iterator[Callable[..., RunningUpstream]]:
    running: list[RunningUpstream] = []

    def start(**options: Any) -> RunningUpstream:
        running.append(RunningUpstream(FakeUpstream(**options)))
        return running[-1]

    yield start
    for upstream in running:
        upstream.stop()


def backend(upstream: RunningUpstream, mode: str = "auto", **options: Any) -> OpenAIBackend:
    return OpenAIBackend(upstream.url, mode=mode, tokenizer=TOKENIZER, weight_version="up:1", **options)


def play_episode(play_counter: Any, b: OpenAIBackend, row: dict[str, Any]) -> Any:
    """One counter episode through a model servicer on `b` (closed afterwards)."""

    async def main() -> Any:
        servicer = ModelServicer(b, TOKENIZER)
        try:
            return await play_counter(lambda r: servicer.Generate(r, None), row)
        finally:
            await servicer.close()

    return asyncio.run(main())


def test_auto_picks_tokens_when_completions_take_token_ids_and_chat_otherwise(serve: Any) -> None:
    both, chat_only = serve(), serve(completions=False)

    async def main() -> tuple[str, str, dict[str, str]]:
        a, b = backend(both), backend(chat_only)
        try:
            return await a.probe(), await b.probe(), b.status_details()
        finally:
            await a.close()
            await b.close()

    tokens, chat, details = asyncio.run(main())
    assert (tokens, chat) == ("tokens", "chat")
    assert details == {"upstream_mode": "chat", "upstream_token_completions": "no", "upstream_chat": "yes"}
    assert [path for path, _ in chat_only.fake.requests] == ["/v1/completions", "/v1/chat/completions"]


def test_forced_tokens_mode_against_a_chat_only_server_fails_at_start_naming_the_route(serve: Any) -> None:
    chat_only = serve(completions=False)

    async def main() -> None:
        b = backend(chat_only, mode="tokens")
        try:
            with pytest.raises(FailedPrecondition, match="POST /v1/completions") as caught:
                await b.probe()
            assert caught.value.reason == "UPSTREAM_NOT_FOUND"
        finally:
            await b.close()

    asyncio.run(main())
    # The server process refuses to start, and says why.
    args = ["--backend", "openai", "--upstream-url", chat_only.url, "--upstream-mode", "tokens", "--no-participant"]
    done = subprocess.run(
        [sys.executable, "-m", "gymrpc.servers.model", *args, "--bind", "127.0.0.1:0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode != 0
    assert "POST /v1/completions" in done.stderr
    assert "--upstream-mode chat" in done.stderr


def test_chat_mode_plays_a_counter_episode_with_structured_tool_calls(
    serve: Any, counter_rows: list[dict[str, Any]], play_counter: Any
) -> None:
    chat_only = serve(completions=False)

    episode = play_episode(play_counter, backend(chat_only), counter_rows[0])
    assert episode.reward == 1.0
    first = episode.replies[0]
    assert first.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    assert [c.id for c in first.message.tool_calls][:1] == ["call_0_0"]  # this server's ids, not the upstream's
    assert all(r.tokens.token_source == common_pb2.TOKEN_SOURCE_RETOKENIZED for r in episode.replies)
    assert all(not r.tokens.completion_logprobs for r in episode.replies)  # the ids are not the sampler's
    for reply in episode.replies:  # the sampler's own logprobs, in its own tokens
        assert reply.tokens.sampler_tokens
        assert len(reply.tokens.sampler_logprobs) == len(reply.tokens.sampler_tokens)
        assert all(math.isfinite(x) and x <= 0 for x in reply.tokens.sampler_logprobs)
    streamed = b"".join(first.tokens.sampler_tokens).decode()
    assert first.message.tool_calls[0].arguments_json in streamed  # tool-call tokens too
    sent = [body for path, body in chat_only.fake.requests if path == "/v1/chat/completions"][1:]
    assert sent[0]["stream"] is True
    assert sent[0]["logprobs"] is True
    assert "top_logprobs" not in sent[0]
    assert sent[0]["tools"][0]["type"] == "function"
    assert sent[0]["messages"][0] == {"role": "system", "content": DEFAULT_SYSTEM}  # what tokens mode renders
    assistant = next(m for m in sent[1]["messages"] if m["role"] == "assistant")
    assert assistant["tool_calls"][0]["function"]["name"] == "increment_counter"  # structured, not template text


def test_unstreamed_chat_mode_plays_a_counter_episode_with_the_samplers_logprobs(
    serve: Any, counter_rows: list[dict[str, Any]], play_counter: Any
) -> None:
    """`chat_stream=False` (upstreams that do not stream): one whole reply per request."""
    chat_only = serve(completions=False)

    episode = play_episode(play_counter, backend(chat_only, chat_stream=False), counter_rows[0])
    assert episode.reward == 1.0
    assert all(r.tokens.token_source == common_pb2.TOKEN_SOURCE_RETOKENIZED for r in episode.replies)
    assert all(r.tokens.sampler_logprobs for r in episode.replies)
    sent = [body for path, body in chat_only.fake.requests if path == "/v1/chat/completions"][1:]
    assert all(body["stream"] is False for body in sent)


@pytest.mark.parametrize("mode", ["auto", "chat"])
def test_a_chat_upstream_refusing_logprobs_is_asked_without_and_says_so_once(
    serve: Any, counter_rows: list[dict[str, Any]], play_counter: Any, caplog: Any, mode: str
) -> None:
    """auto: the probe finds the refusal; a forced chat mode (no probe): the first reply's 400 does."""
    chat_only = serve(completions=False, chat_logprobs=False)

    b = backend(chat_only, mode=mode)
    with caplog.at_level(logging.WARNING, logger="gymrpc"):
        episode = play_episode(play_counter, b, counter_rows[0])
    details = b.status_details()
    assert episode.reward == 1.0
    assert details["upstream_mode"] == "chat"
    assert all(not r.tokens.sampler_tokens and not r.tokens.sampler_logprobs for r in episode.replies)
    assert len([r for r in caplog.records if "refuses chat logprobs" in r.getMessage()]) == 1
    asked = [bool(body.get("logprobs")) for path, body in chat_only.fake.requests if path == "/v1/chat/completions"]
    assert asked[0] is True
    assert not any(asked[1:])


def test_chat_top_logprobs_are_asked_for_only_when_the_call_wants_them(serve: Any) -> None:
    b = backend(serve(completions=False), mode="chat")
    conversation = Conversation([{"role": "user", "content": "hi"}], [])
    plain = b.chat_body(conversation, SAMPLING, "m")
    top = b.chat_body(conversation, Sampling(max_tokens=8, top_logprobs=3), "m")
    asyncio.run(b.close())
    assert plain["logprobs"] is True
    assert "top_logprobs" not in plain
    assert (top["logprobs"], top["top_logprobs"]) == (True, 3)


def test_tokens_mode_plays_a_counter_episode_with_the_samplers_ids(
    serve: Any, counter_rows: list[dict[str, Any]], play_counter: Any
) -> None:
    tokens = serve(chat=False)

    episode = play_episode(play_counter, backend(tokens), counter_rows[1])
    assert episode.reward == 1.0
    assert all(r.tokens.token_source == common_pb2.TOKEN_SOURCE_SAMPLER for r in episode.replies)
    assert all(len(r.tokens.completion_logprobs) == len(r.tokens.completion_token_ids) for r in episode.replies)


def test_429_with_retry_after_is_retried_and_succeeds(serve: Any) -> None:
    up = serve(chat=False)

    async def main() -> Any:
        b = backend(up, mode="tokens")
        try:
            up.fake.failures.append((429, "Rate limit reached for requests", {"Retry-After": "0.2"}))
            streamed = [d async for d in b.stream(TOKENIZER.encode("Hello"), SAMPLING, "s1")]
            up.fake.failures.append((429, "Rate limit reached for requests", {"Retry-After": "0"}))
            unary = await b.generate(TOKENIZER.encode("Hello"), SAMPLING, "u1")
            return streamed, unary
        finally:
            await b.close()

    streamed, unary = asyncio.run(main())
    assert sum(len(d.token_ids) for d in streamed) > 0
    assert streamed[-1].finish is not None
    assert unary.token_ids
    assert len(up.fake.requests) == 4  # each call: one 429, one success


def test_429_past_the_deadline_is_rate_limited_with_retry_info(serve: Any) -> None:
    up = serve(chat=False)

    async def main() -> None:
        b = backend(up, mode="tokens", timeout=5.0)
        try:
            up.fake.failures.append((429, "slow down", {"Retry-After": "30"}))
            with pytest.raises(ResourceExhausted, match="slow down") as caught:
                await b.generate([1, 2], SAMPLING, "u1")
            assert caught.value.reason == "UPSTREAM_RATE_LIMITED"
            assert caught.value.retry_delay == 30.0
        finally:
            await b.close()

    asyncio.run(main())
    assert len(up.fake.requests) == 1


def test_401_fails_at_once_with_the_upstreams_message(serve: Any) -> None:
    up = serve(api_key="right")

    async def main() -> None:
        b = backend(up, api_key="wrong")
        try:
            with pytest.raises(Unauthenticated, match="Incorrect API key provided") as caught:
                await b.probe()
            assert caught.value.reason == "UPSTREAM_AUTH_FAILED"
            assert "--upstream-api-key-file" in caught.value.message
        finally:
            await b.close()

    asyncio.run(main())
    assert up.fake.requests == []  # refused at GET /v1/models: nothing was retried or generated


def test_context_length_and_unknown_model_have_their_own_reasons(serve: Any) -> None:
    up = serve(max_context=40)

    async def main() -> None:
        b = backend(up, mode="tokens")
        try:
            await b.probe()
            with pytest.raises(InvalidArgument, match="maximum context length") as caught:
                await b.generate(list(range(3, 60)), SAMPLING, "long")
            assert caught.value.reason == "UPSTREAM_CONTEXT_LENGTH"
        finally:
            await b.close()
        wrong = backend(up, mode="tokens", model="gpt-nope")
        try:
            with pytest.raises(FailedPrecondition, match="gpt-nope") as caught:
                await wrong.probe()
            assert caught.value.reason == "UPSTREAM_MODEL_NOT_FOUND"
            with pytest.raises(FailedPrecondition, match="does not exist") as caught:
                await wrong.generate([1, 2], SAMPLING, "x")  # without a probe: the upstream's own 404
            assert caught.value.reason == "UPSTREAM_MODEL_NOT_FOUND"
        finally:
            await wrong.close()

    asyncio.run(main())


# -- a coordinated checkpoint while 16 generations stream from a token-level upstream ---------------


def _requests(rows: list[dict[str, Any]]) -> list[pb.GenerateRequest]:
    from gymrpc.messages import task_from_row

    out = []
    for n in range(16):
        task = task_from_row(rows[n % len(rows)], str(n))
        out.append(
            pb.GenerateRequest(
                request_id=f"r{n}/a0/step0",
                episode_id=common_pb2.EpisodeId(rollout_id=f"r{n}"),
                # A system line of its own: no two of the 16 prompts are the same.
                messages=[common_pb2.Message(role=common_pb2.ROLE_SYSTEM, content=f"Episode {n}."), *task.input],
                tools=task.tools,
                sampling=common_pb2.SamplingParams(temperature=0.0),
            )
        )
    return out


async def all_mid_stream(participant: ModelParticipant, requests: list[pb.GenerateRequest]) -> None:
    """Until every request generates with at least 3 tokens streamed (the upstream holds them there)."""
    for _ in range(24_000):
        gens = [participant._generations.get(r.request_id) for r in requests]
        if all(g is not None and g.state == "generating" and len(g.token_ids) >= 3 for g in gens):
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the 16 generations never all streamed 3 tokens")


def test_a_checkpoint_cut_continues_from_the_streamed_tokens_without_regenerating(
    serve: Any, counter_rows: list[dict[str, Any]]
) -> None:
    # The upstream pauses every fresh generation after 3 tokens until the test lets it go, so all
    # 16 are mid-stream at the checkpoint however slow the machine is; continuations never pause.
    reference_up, up = serve(chat=False), serve(chat=False, hold_at=3)
    requests = _requests(counter_rows)

    async def uninterrupted() -> list[pb.GenerateResponse]:
        servicer = ModelServicer(backend(reference_up, mode="tokens"), TOKENIZER)
        try:
            return list(await asyncio.gather(*(servicer.Generate(r, None) for r in requests)))
        finally:
            await servicer.close()

    async def checkpointed() -> tuple[list[pb.GenerateResponse], list[int], dict[str, int]]:
        servicer = ModelServicer(backend(up, mode="tokens"), TOKENIZER)
        participant = ModelParticipant(servicer)
        plane = ControlPlane(participant, name="model/test")
        try:
            calls = [asyncio.ensure_future(servicer.Generate(r, None)) for r in requests]
            await all_mid_stream(participant, requests)
            phase, report = await plane.prepare("c1", soon())
            assert phase is Phase.PREPARED
            prefixes = [len(participant._generations[r.request_id].token_ids) for r in requests]
            assert report.counts["cut"] == 16
            up.fake.hold.set()
            await plane.resume("c1")
            replies = list(await asyncio.gather(*calls))
            rows = {k.rollout_id: len(participant.ledger.rows(k)) for k in participant.ledger.episodes()}
            return replies, prefixes, rows
        finally:
            up.fake.hold.set()
            await servicer.close()

    expected = asyncio.run(uninterrupted())
    replies, prefixes, rows = asyncio.run(checkpointed())
    for want, got, prefix in zip(expected, replies, prefixes, strict=True):
        assert list(got.tokens.completion_token_ids) == list(want.tokens.completion_token_ids)
        assert list(got.tokens.completion_logprobs) == list(want.tokens.completion_logprobs)
        assert got.message == want.message
        assert list(got.tokens.continued_at) == [prefix]  # one call, marked as continued at the cut
        assert not want.tokens.continued_at
    assert rows == {f"r{n}": 1 for n in range(16)}  # each stitched call is one ledger row
    fake = up.fake
    assert fake.regenerations == 0  # no request started an already-streamed reply over
    assert fake.continuations == 16
    assert len([p for p, _ in fake.requests if p == "/v1/completions"]) == 32


def test_a_chat_mode_cut_regenerates_the_message_on_resume(serve: Any, counter_rows: list[dict[str, Any]]) -> None:
    """Message granularity: a chat upstream cannot continue a partial reply, so the cut one is asked again."""
    reference_up, up = serve(completions=False), serve(completions=False, hold_at=1)
    request = _requests(counter_rows)[0]

    async def uninterrupted() -> pb.GenerateResponse:
        servicer = ModelServicer(backend(reference_up, mode="chat"), TOKENIZER)
        try:
            return await servicer.Generate(request, None)
        finally:
            await servicer.close()

    async def checkpointed() -> tuple[pb.GenerateResponse, int]:
        servicer = ModelServicer(backend(up, mode="chat"), TOKENIZER)
        participant = ModelParticipant(servicer)
        plane = ControlPlane(participant, name="model/test")
        try:
            call = asyncio.ensure_future(servicer.Generate(request, None))
            await asyncio.get_running_loop().run_in_executor(None, up.fake.holding.wait, 60)
            phase, report = await plane.prepare("c1", soon())
            assert phase is Phase.PREPARED
            assert report.counts["cut"] == 1, (report, {k: g.state for k, g in participant._generations.items()})
            prefix = len(participant._generations[request.request_id].token_ids)
            up.fake.hold.set()
            await plane.resume("c1")
            return await call, prefix
        finally:
            up.fake.hold.set()
            await servicer.close()

    expected = asyncio.run(uninterrupted())
    reply, prefix = asyncio.run(checkpointed())
    assert prefix == 0  # nothing of a chat reply is kept before it is whole
    assert reply.message == expected.message
    assert list(reply.tokens.completion_token_ids) == list(expected.tokens.completion_token_ids)
    assert not reply.tokens.continued_at  # regenerated, not continued
    assert [p for p, _ in up.fake.requests].count("/v1/chat/completions") == 2
