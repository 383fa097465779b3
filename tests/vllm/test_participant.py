"""The model participant (held responses, generation cuts, the capture ledger) on a real vLLM engine.

The same flows as tests/control/test_model.py, with the scripted backend replaced by the
session's in-process vLLM engine (random tiny model, greedy): a cut is a real engine abort
and its continuation a real prompt + partial re-feed, which must give exactly the tokens of an
uninterrupted generation. A "process death" is a fresh servicer and participant on the same
engine (a new engine would cost half a minute; the real SIGKILL is in test_server.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from gymrpc.chat import default_tokenizer
from gymrpc.control import ControlPlane, EpisodeKey, Phase
from gymrpc.errors import GymrpcError
from gymrpc.servers.model.backends.base import CompletionDelta, Conversation, ModelBackend, Sampling
from gymrpc.servers.model.participant import ModelParticipant
from gymrpc.servers.model.service import ModelServicer
from gymrpc.v1 import common_pb2
from gymrpc.v1 import model_service_pb2 as pb

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STORY = common_pb2.Message(role=common_pb2.ROLE_USER, content="Tell me a long story about the sea.")
MORE = common_pb2.Message(role=common_pb2.ROLE_USER, content="Go on.")


class Lent(ModelBackend):
    """The session's engine lent to one servicer: closing the servicer must not stop the engine."""

    name = "vllm"

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.weight_version = engine.weight_version

    def stream(
        self,
        prompt_token_ids: Sequence[int],
        sampling: Sampling,
        request_id: str,
        *,
        conversation: Conversation | None = None,
    ) -> AsyncIterator[CompletionDelta]:
        return self.engine.stream(prompt_token_ids, sampling, request_id, conversation=conversation)

    async def abort(self, request_id: str) -> bool:
        return bool(await self.engine.abort(request_id))

    async def close(self) -> None:
        pass


class Model:
    def __init__(self, engine: Any, participant: bool = True) -> None:
        self.backend = Lent(engine)
        self.servicer = ModelServicer(self.backend, default_tokenizer())
        self.participant = ModelParticipant(self.servicer) if participant else None
        self.plane = ControlPlane(self.participant, name="model/vllm") if self.participant else None

    async def generate(
        self, messages: Sequence[common_pb2.Message], rollout: str, attempt: int, step: int, max_tokens: int = 240
    ) -> pb.GenerateResponse:
        request = pb.GenerateRequest(
            request_id=f"{rollout}/a{attempt}/step{step}",
            episode_id=common_pb2.EpisodeId(rollout_id=rollout, attempt=attempt),
            messages=messages,
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens),
        )
        return await self.servicer.Generate(request, None)  # type: ignore[arg-type]

    async def generating(self, request_id: str, tokens: int = 20) -> None:
        assert self.participant is not None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            gen = self.participant._generations.get(request_id)
            if gen is not None and gen.state == "generating" and len(gen.token_ids) >= tokens:
                return
            await asyncio.sleep(0.002)
        raise AssertionError(f"{request_id} never generated {tokens} tokens")

    async def close(self) -> None:
        await self.servicer.close()


def soon() -> float:
    return time.time() + 10


async def uninterrupted(engine: Any, rollout: str) -> list[pb.GenerateResponse]:
    """Both turns of the two-turn conversation, generated without any checkpoint."""
    model = Model(engine, participant=False)
    first = await model.generate([STORY], rollout, 0, 0, max_tokens=30)
    second = await model.generate([STORY, first.message, MORE], rollout, 0, 1)
    await model.close()
    return [first, second]


def test_a_cut_generation_continues_exactly_on_resume(random_backend: Any, loop_thread: Any) -> None:
    async def main() -> None:
        expected = (await uninterrupted(random_backend, "ref-cut"))[1]
        model = Model(random_backend)
        assert model.plane is not None
        assert model.participant is not None
        first = await model.generate([STORY], "r0", 0, 0, max_tokens=30)
        call = asyncio.ensure_future(model.generate([STORY, first.message, MORE], "r0", 0, 1))
        await model.generating("r0/a0/step1")
        phase, report = await model.plane.prepare("c1", soon())
        assert phase is Phase.PREPARED
        assert report.counts["cut"] == 1
        prefix = list(model.participant._generations["r0/a0/step1"].token_ids)
        assert 20 <= len(prefix) < len(expected.tokens.completion_token_ids)
        await asyncio.sleep(0.3)
        assert not call.done()  # the cut generation waits for resume
        await model.plane.resume("c1")
        reply = await call
        assert reply.tokens.completion_token_ids == expected.tokens.completion_token_ids
        assert list(reply.tokens.completion_logprobs) == pytest.approx(
            list(expected.tokens.completion_logprobs), abs=1e-4
        )
        assert reply.finish_reason == expected.finish_reason
        assert len(model.participant.ledger.rows(EpisodeKey("r0", 0))) == 2
        await model.close()

    loop_thread.run(main())


def test_a_response_finished_while_prepared_is_held_until_resume(
    random_backend: Any, loop_thread: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        expected = (await uninterrupted(random_backend, "ref-held"))[0]
        model = Model(random_backend)
        assert model.plane is not None
        assert model.participant is not None

        async def no_cut(request_id: str) -> bool:  # as if the generation were not cuttable
            return False

        monkeypatch.setattr(model.backend, "abort", no_cut)
        call = asyncio.ensure_future(model.generate([STORY], "r0", 0, 0, max_tokens=30))
        await model.generating("r0/a0/step0", tokens=1)
        phase, report = await model.plane.prepare("c1", soon())  # waits for the generation, then holds it
        assert phase is Phase.PREPARED
        assert report.counts["held"] == 1
        await asyncio.sleep(0.3)
        assert not call.done()
        assert len(model.participant.ledger) == 0  # not delivered, so not captured yet
        new = asyncio.ensure_future(model.generate([STORY], "r1", 0, 0, max_tokens=30))
        await asyncio.sleep(0.1)
        assert model.participant._generations["r1/a0/step0"].state == "waiting"  # admission is closed
        await model.plane.resume("c1")
        held, later = await asyncio.gather(call, new)
        assert held.tokens.completion_token_ids == expected.tokens.completion_token_ids
        assert later.tokens.completion_token_ids == expected.tokens.completion_token_ids
        assert len(model.participant.ledger) == 2
        await model.close()

    loop_thread.run(main())


def test_restore_continues_the_cut_and_the_ledger_keeps_every_token_once(
    random_backend: Any, loop_thread: Any, tmp_path: Path
) -> None:
    async def main() -> None:
        expected = await uninterrupted(random_backend, "ref-restore")
        model = Model(random_backend)
        assert model.plane is not None
        first = await model.generate([STORY], "r0", 0, 0, max_tokens=30)
        boundary = [STORY, first.message, MORE]  # the agent's state before model call 1
        call = asyncio.ensure_future(model.generate(boundary, "r0", 0, 1))
        await model.generating("r0/a0/step1")
        await model.plane.prepare("c1", soon())
        manifest = await model.plane.commit("c1", soon(), str(tmp_path), frozenset({EpisodeKey("r0", 0)}))
        assert manifest.record_count == 1
        call.cancel()
        await model.close()  # the process "dies"

        fresh = Model(random_backend)
        assert fresh.plane is not None
        assert fresh.participant is not None
        _, restored = await fresh.plane.restore("x1", soon(), str(tmp_path), [EpisodeKey("r0", 0)])
        assert restored == [EpisodeKey("r0", 1)]
        with pytest.raises(GymrpcError) as caught:
            await fresh.generate(boundary, "r0", 0, 1)
        assert caught.value.reason == "STALE_ATTEMPT"
        await fresh.plane.resume("x1")
        second = await fresh.generate(boundary, "r0", 1, 1)
        assert second.tokens.prompt_token_ids == expected[1].tokens.prompt_token_ids  # memory restored
        assert second.tokens.completion_token_ids == expected[1].tokens.completion_token_ids  # prefix continued
        rows = fresh.participant.ledger.rows(EpisodeKey("r0", 1))
        assert [list(r.tokens.completion_token_ids) for r in rows] == [
            list(e.tokens.completion_token_ids) for e in expected
        ]
        assert [r.source_attempt for r in rows] == [0, 1]
        assert len(fresh.participant.cuts) == 0
        await fresh.close()

    loop_thread.run(main())
