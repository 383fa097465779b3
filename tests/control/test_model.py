"""The model participant in-process: held responses, generation cuts, and the capture ledger."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gymrpc.chat import default_tokenizer
from gymrpc.control import ControlPlane, EpisodeKey, Phase, store
from gymrpc.envs.counter import CounterEnvironment
from gymrpc.errors import GymrpcError
from gymrpc.messages import task_spec
from gymrpc.servers.model.backends.scripted import ScriptedBackend
from gymrpc.servers.model.backends.sources import CounterSolver
from gymrpc.servers.model.participant import ModelParticipant
from gymrpc.servers.model.service import ModelServicer
from gymrpc.v1 import common_pb2
from gymrpc.v1 import model_service_pb2 as pb
from tests.agent.fakes import counter_tasks

TOKEN_DELAY = 0.01


def soon() -> float:
    return time.time() + 5


class Model:
    def __init__(self, token_delay: float = TOKEN_DELAY, participant: bool = True) -> None:
        tokenizer = default_tokenizer()
        self.backend = ScriptedBackend(tokenizer, [CounterSolver()], token_delay=token_delay)
        self.servicer = ModelServicer(self.backend, tokenizer)
        self.participant = ModelParticipant(self.servicer) if participant else None
        self.plane = ControlPlane(self.participant, name="model/test") if self.participant else None

    async def generate(self, messages: list[common_pb2.Message], rollout: str, attempt: int, step: int) -> Any:
        request = pb.GenerateRequest(
            request_id=f"{rollout}/a{attempt}/step{step}",
            episode_id=common_pb2.EpisodeId(rollout_id=rollout, attempt=attempt),
            messages=messages,
            tools=counter_tasks()[0].tools,
        )
        return await self.servicer.Generate(request, None)

    async def generating(self, request_id: str, tokens: int = 3) -> None:
        assert self.participant is not None
        for _ in range(500):
            gen = self.participant._generations.get(request_id)
            if gen is not None and gen.state == "generating" and len(gen.token_ids) >= tokens:
                return
            await asyncio.sleep(0.005)
        raise AssertionError(f"{request_id} never generated {tokens} tokens")

    async def close(self) -> None:
        await self.servicer.close()


class Episode:
    """A counter episode driven by hand: messages so far and a live counter session."""

    def __init__(self) -> None:
        self.task = counter_tasks()[0]
        self.messages = list(self.task.input)
        self.session, _ = CounterEnvironment().seed(task_spec(self.task))

    def apply(self, reply: pb.GenerateResponse) -> None:
        self.messages.append(reply.message)
        for call in reply.message.tool_calls:
            result = self.session.call_tool(call.name, json.loads(call.arguments_json))
            self.messages.append(
                common_pb2.Message(
                    role=common_pb2.ROLE_TOOL, content=result.output, tool_call_id=call.id, name=call.name
                )
            )


def without_continuation(trace: common_pb2.TokenTrace) -> common_pb2.TokenTrace:
    plain = common_pb2.TokenTrace()
    plain.CopyFrom(trace)
    del plain.continued_at[:]
    return plain


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def reference() -> list[pb.GenerateResponse]:
    """The uninterrupted episode's replies."""
    model, episode, replies = Model(token_delay=0.0, participant=False), Episode(), []
    for step in range(2):
        reply = await model.generate(episode.messages, "r0", 0, step)
        replies.append(reply)
        episode.apply(reply)
    await model.close()
    return replies


def test_a_cut_generation_continues_from_its_prefix_on_resume() -> None:
    async def main() -> None:
        expected = (await reference())[0]
        model, episode = Model(), Episode()
        call = asyncio.ensure_future(model.generate(episode.messages, "r0", 0, 0))
        await model.generating("r0/a0/step0")
        phase, report = await model.plane.prepare("c1", soon())
        assert phase is Phase.PREPARED
        assert report.counts["cut"] == 1
        prefix = model.participant._generations["r0/a0/step0"].token_ids
        assert 0 < len(prefix) < len(expected.tokens.completion_token_ids)
        await asyncio.sleep(0.05)
        assert not call.done()
        await model.plane.resume("c1")
        reply = await call
        assert reply.tokens.completion_token_ids == expected.tokens.completion_token_ids
        assert reply.message == expected.message
        assert len(model.participant.ledger.rows(EpisodeKey("r0", 0))) == 1
        await model.close()

    run(main())


def test_a_generation_cut_while_it_renders_parks_without_reaching_the_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cut's abort finds no request in the backend while the prompt renders (off the event loop). The
    generation must park at once: started anyway, it would hold the prepare until it ended, forever on an
    engine that is stopped or stuck."""

    async def main() -> None:
        expected = (await reference())[0]
        model, episode = Model(), Episode()
        rendering, go_on = threading.Event(), threading.Event()
        render = model.servicer.template.render

        def held_render(*args: Any) -> Any:
            rendering.set()
            go_on.wait(30)
            return render(*args)

        monkeypatch.setattr(model.servicer.template, "render", held_render)
        started: list[str] = []
        stream = model.backend.stream

        def counted_stream(*args: Any, **kwargs: Any) -> Any:
            started.append(args[2])
            return stream(*args, **kwargs)

        monkeypatch.setattr(model.backend, "stream", counted_stream)
        call = asyncio.ensure_future(model.generate(episode.messages, "r0", 0, 0))
        assert await asyncio.to_thread(rendering.wait, 30)
        assert model.participant._generations["r0/a0/step0"].state == "generating"
        closed = asyncio.Event()
        close_admission = model.participant.close_admission

        async def noted_close() -> None:
            await close_admission()  # its abort finds nothing to abort: the request is still rendering
            closed.set()

        monkeypatch.setattr(model.participant, "close_admission", noted_close)
        prepare = asyncio.ensure_future(model.plane.prepare("c1", soon()))
        await closed.wait()
        go_on.set()
        phase, report = await prepare
        assert phase is Phase.PREPARED
        assert (report.counts["cut"], report.counts["held"]) == (1, 0)
        assert started == []  # parked without reaching the backend
        assert model.participant._generations["r0/a0/step0"].token_ids == []
        await model.plane.resume("c1")
        reply = await call
        assert started == ["r0/a0/step0"]
        assert reply.tokens == expected.tokens  # from the start, as if never cut: no continuation
        assert reply.message == expected.message
        await model.close()

    run(main())


def test_a_response_finished_while_closed_is_held_until_resume(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        model, episode = Model(), Episode()

        async def no_abort(request_id: str) -> bool:
            return False

        monkeypatch.setattr(model.backend, "abort", no_abort)
        call = asyncio.ensure_future(model.generate(episode.messages, "r0", 0, 0))
        await model.generating("r0/a0/step0")
        phase, report = await model.plane.prepare("c1", soon())  # waits for the generation, then it is held
        assert phase is Phase.PREPARED
        assert report.counts["held"] == 1
        assert not call.done()
        assert len(model.participant.ledger) == 0
        new = asyncio.ensure_future(model.generate(episode.messages, "r1", 0, 0))
        await asyncio.sleep(0.05)
        assert model.participant._generations["r1/a0/step0"].state == "waiting"  # new calls wait
        await model.plane.resume("c1")
        await asyncio.gather(call, new)
        assert len(model.participant.ledger) == 2
        await model.close()

    run(main())


def test_restore_continues_the_cut_and_keeps_every_delivered_token_once(tmp_path: Path) -> None:
    async def main() -> None:
        expected = await reference()
        model, episode = Model(), Episode()
        first = await model.generate(episode.messages, "r0", 0, 0)
        episode.apply(first)
        boundary = list(episode.messages)  # the agent's state before model call 1
        call = asyncio.ensure_future(model.generate(episode.messages, "r0", 0, 1))
        await model.generating("r0/a0/step1")
        await model.plane.prepare("c1", soon())
        manifest = await model.plane.commit("c1", soon(), str(tmp_path), frozenset({EpisodeKey("r0", 0)}))
        assert manifest.record_count == 1
        call.cancel()
        await model.close()  # the process "dies"

        fresh = Model()
        _, restored = await fresh.plane.restore("x1", soon(), str(tmp_path), [EpisodeKey("r0", 0)])
        assert restored == [EpisodeKey("r0", 1)]
        rows = fresh.participant.ledger.rows(EpisodeKey("r0", 1))
        assert [r.source_attempt for r in rows] == [0]
        with pytest.raises(GymrpcError) as caught:
            await fresh.generate(boundary, "r0", 0, 1)
        assert caught.value.reason == "STALE_ATTEMPT"
        await fresh.plane.resume("x1")
        second = await fresh.generate(boundary, "r0", 1, 1)
        assert len(second.tokens.continued_at) == 1  # one call, marked where the restored prefix ended
        assert without_continuation(second.tokens) == expected[1].tokens  # same prompt ids, prefix continued
        rows = fresh.participant.ledger.rows(EpisodeKey("r0", 1))
        assert [without_continuation(r.tokens) for r in rows] == [e.tokens for e in expected]
        assert [r.source_attempt for r in rows] == [0, 1]
        assert len(fresh.participant.cuts) == 0
        await fresh.close()

    run(main())


def test_a_second_checkpoint_of_the_restored_state_equals_the_first(tmp_path: Path) -> None:
    async def main() -> None:
        model, episode = Model(), Episode()
        episode.apply(await model.generate(episode.messages, "r0", 0, 0))
        call = asyncio.ensure_future(model.generate(episode.messages, "r0", 0, 1))
        await model.generating("r0/a0/step1")
        await model.plane.prepare("c1", soon())
        await model.plane.commit("c1", soon(), str(tmp_path / "one"), frozenset({EpisodeKey("r0", 0)}))
        call.cancel()
        await model.close()

        fresh = Model()
        await fresh.plane.restore("x1", soon(), str(tmp_path / "one"), [EpisodeKey("r0", 0)])
        await fresh.plane.resume("x1")
        await fresh.plane.prepare("c2", soon())
        await fresh.plane.commit("c2", soon(), str(tmp_path / "two"), frozenset({EpisodeKey("r0", 1)}))
        _, first = store.read_checkpoint(tmp_path / "one", fresh.participant.kind, "model/test")
        _, second = store.read_checkpoint(tmp_path / "two", fresh.participant.kind, "model/test")
        assert [r.model_episode for r in second] == [r.model_episode for r in first]
        assert [EpisodeKey.of(r.episode_id) for r in second] == [EpisodeKey("r0", 1)]
        await fresh.close()

    run(main())


def test_retire_aborts_running_generations_and_frees_the_ledger() -> None:
    async def main() -> None:
        model, episode = Model(), Episode()
        episode.apply(await model.generate(episode.messages, "r0", 0, 0))
        call = asyncio.ensure_future(model.generate(episode.messages, "r0", 0, 1))
        await model.generating("r0/a0/step1")
        await model.plane.retire("op1", soon(), [EpisodeKey("r0", 0)])
        with pytest.raises(GymrpcError) as caught:
            await call
        assert caught.value.reason == "STALE_ATTEMPT"
        assert len(model.participant.ledger) == 0
        await model.close()

    run(main())


def test_restored_episodes_left_out_of_the_next_commit_are_freed(tmp_path: Path) -> None:
    async def main() -> None:
        model = Model()
        for rollout in ("r0", "r1"):
            await model.generate(Episode().messages, rollout, 0, 0)
        await model.plane.prepare("c1", soon())
        await model.plane.commit("c1", soon(), str(tmp_path / "one"), None)
        await model.close()
        fresh = Model()
        await fresh.plane.restore("x1", soon(), str(tmp_path / "one"), [EpisodeKey("r0", 0), EpisodeKey("r1", 0)])
        await fresh.plane.resume("x1")
        await fresh.plane.prepare("c2", soon())
        manifest = await fresh.plane.commit("c2", soon(), str(tmp_path / "two"), frozenset({EpisodeKey("r0", 1)}))
        assert [EpisodeKey.of(e) for e in manifest.episode_ids] == [EpisodeKey("r0", 1)]
        assert fresh.participant.ledger.episodes() == [EpisodeKey("r0", 1)]  # r1 was never re-dispatched
        await fresh.close()

    run(main())
