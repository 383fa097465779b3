"""Checkpoints that do not stop the world (issue 18, item 2), over in-process gRPC participants.

The records writes are held by a gate (`store.write_checkpoint` waits on an event), never by a
sleep: while they are held, the episodes must already run again, and the checkpoint must not be
published; once the last member persisted, the index appears, and a restore installs the state
of the capture, not what the episodes did after it. The SIGKILL case (a member dies between its
capture and its write) runs real processes: `tests/control/test_process.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gymrpc.control import EpisodeKey, Kind, store
from gymrpc.control.index import INDEX, read_index
from gymrpc.control.types import packed_scope
from gymrpc.controller import CoordinationError
from gymrpc.errors import FailedPrecondition, InvalidArgument
from gymrpc.pbtime import timestamp
from gymrpc.servers.participant import ParticipantServicer, commit_scope
from gymrpc.v1 import common_pb2
from gymrpc.v1 import participant_service_pb2 as pb
from gymrpc.v1 import resources_service_pb2 as res_pb
from tests.control.deployment import Deployment

NAMES = ["agent/a", "model/m0", "resources/r0", "resources/r1"]
EPISODES = [EpisodeKey("e0", 0), EpisodeKey("e1", 0)]
WAIT = 30.0
"""Seconds a gate or an awaited call may take before the test fails (a hang, not a margin)."""


class Gate:
    """Holds the records writes of chosen participants until released; says when each began and ended."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, held: set[str]) -> None:
        self.held = held
        self.release = threading.Event()
        self.entered: dict[str, threading.Event] = {n: threading.Event() for n in NAMES}
        self.written: dict[str, threading.Event] = {n: threading.Event() for n in NAMES}
        real = store.write_checkpoint

        def write(root: Path, kind: Kind, name: str, *args: Any) -> Any:
            self.entered[name].set()
            if name in self.held:
                assert self.release.wait(WAIT), "the gate was never released"
            try:
                return real(root, kind, name, *args)
            finally:
                self.written[name].set()

        monkeypatch.setattr(store, "write_checkpoint", write)

    async def wait(self, events: dict[str, threading.Event], names: list[str]) -> None:
        for name in names:
            assert await asyncio.to_thread(events[name].wait, WAIT), f"{name} never got there"


async def seeded() -> Deployment:
    """Two counter episodes, one per resources server, each with a model call and one increment."""
    deployment = await Deployment.start(NAMES)
    for i, episode in enumerate(EPISODES):
        resources = f"resources/r{i}"
        await deployment.seed(resources, episode)
        await deployment.generate("model/m0", episode, 0)
        await deployment.increment(resources, episode, "call-0")
        deployment.nodes["agent/a"].participant.track(episode)
    return deployment


@contextlib.asynccontextmanager
async def restored(folder: Path) -> AsyncIterator[Deployment]:
    """A fresh deployment with checkpoint `folder` restored (every episode as its next attempt) and resumed."""
    fresh = await Deployment.start(NAMES)
    try:
        await fresh.controller.restore("restore-1", folder, EPISODES)
        await fresh.controller.resume("restore-1")
        yield fresh
    finally:
        await fresh.close()


async def counter(deployment: Deployment, resources: str, episode: EpisodeKey) -> int:
    call = common_pb2.ToolCall(id=f"read-{episode.attempt}", name="get_counter_value", arguments_json="{}")
    request = res_pb.CallToolRequest(session_id=episode.rollout_id, episode_id=episode.to_pb(), call=call)
    reply = await deployment.client.resources(resources).CallTool(request, timeout=5)
    assert not reply.is_error, reply.output
    return int(json.loads(reply.output)["count"])


def test_episodes_resume_before_the_write_finishes_and_keep_the_captured_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch, held=set(NAMES))

    async def main() -> None:
        deployment = await seeded()
        try:
            task = asyncio.ensure_future(
                deployment.controller.checkpoint(tmp_path, episode_ids=EPISODES, checkpoint_id="c1", timeout=WAIT)
            )
            await gate.wait(gate.entered, NAMES)  # captured: every write has begun, and is held
            # The episodes run again while every write is held: each call below waits for admission,
            # so it could not return before the resume.
            for i, episode in enumerate(EPISODES):
                await asyncio.wait_for(deployment.increment(f"resources/r{i}", episode, "call-1"), WAIT)
                await asyncio.wait_for(deployment.generate("model/m0", episode, 1), WAIT)
            statuses = await deployment.statuses()
            assert {s.phase for s in statuses.values()} == {pb.PARTICIPANT_PHASE_IDLE}
            assert all(s.details["persisting"] == "1" for s in statuses.values()), statuses
            assert not task.done()
            folder = tmp_path / "c1"
            assert not (folder / INDEX).exists()
            assert not list(folder.glob("*/*/manifest.json"))
            gate.release.set()
            result = await asyncio.wait_for(task, WAIT)
            assert result.committed
            assert set(result.timings) == {"parked", "commit_to_publish"}
            assert sorted(m.name for m in read_index(folder).members) == NAMES
            # The records are the capture's: one model call and one increment per episode, not two.
            for record in store.read_checkpoint(folder, Kind.MODEL, "model/m0")[1]:
                assert len(record.model_episode.rows) == 1
        finally:
            await deployment.close()

        async with restored(tmp_path / "c1") as fresh:
            for i, episode in enumerate(EPISODES):
                assert await counter(fresh, f"resources/r{i}", episode.next()) == 1

    asyncio.run(main())


def test_the_index_appears_only_after_every_member_persisted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(monkeypatch, held={"resources/r1"})

    async def main() -> None:
        deployment = await seeded()
        try:
            task = asyncio.ensure_future(
                deployment.controller.checkpoint(tmp_path, episode_ids=EPISODES, checkpoint_id="c1", timeout=WAIT)
            )
            others = [n for n in NAMES if n != "resources/r1"]
            await gate.wait(gate.written, others)  # every other member persisted
            await gate.wait(gate.entered, ["resources/r1"])
            folder = tmp_path / "c1"
            for name in others:
                kind, _, instance = name.partition("/")
                assert (folder / kind / instance / "manifest.json").exists(), name
            assert not (folder / "resources" / "r1" / "manifest.json").exists()
            assert not (folder / INDEX).exists()
            assert not task.done()
            status = await deployment.client.participant("resources/r1").GetStatus(pb.GetStatusRequest(), timeout=5)
            assert status.phase == pb.PARTICIPANT_PHASE_IDLE  # resumed, still writing
            assert status.details["persisting"] == "1"
            gate.release.set()
            result = await asyncio.wait_for(task, WAIT)
            assert result.committed
            index = read_index(folder)  # checks every listed manifest against its sha256
            assert sorted(m.name for m in index.members) == NAMES
            assert result.manifests["resources/r1"].episode_ids[0].rollout_id == "e1"
        finally:
            await deployment.close()

    asyncio.run(main())


def test_persist_of_an_unknown_commit_is_checkpoint_incomplete_and_stop_the_world_still_works(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        deployment = await seeded()
        try:
            stub = deployment.client.participant("resources/r0")
            request = pb.PersistRequest(checkpoint_id="never", deadline=timestamp(time.time() + 5))
            with pytest.raises(FailedPrecondition) as caught:
                await stub.Persist(request, timeout=10)
            assert caught.value.reason == "CHECKPOINT_INCOMPLETE"
            result = await deployment.controller.checkpoint(
                tmp_path, episode_ids=EPISODES, checkpoint_id="c1", nonstop=False
            )
            assert result.committed
            assert (tmp_path / "c1" / INDEX).exists()
        finally:
            await deployment.close()

    asyncio.run(main())


def test_a_failed_background_write_is_reported_then_retried_from_the_same_capture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failures = {"resources/r0": 1}
    real = store.write_checkpoint

    def write(root: Path, kind: Kind, name: str, *args: Any) -> Any:
        if failures.get(name):
            failures[name] -= 1
            raise OSError(28, "No space left on device (injected)")
        return real(root, kind, name, *args)

    monkeypatch.setattr(store, "write_checkpoint", write)

    async def main() -> None:
        deployment = await seeded()
        controller = deployment.controller
        try:
            assert (await controller.prepare("c1", timeout=WAIT)).prepared
            captured = await controller.capture("c1", tmp_path / "c1", EPISODES, timeout=WAIT)
            assert all(r.persisting for r in captured.replies.values())
            stub = deployment.client.participant("resources/r0")
            again = await stub.Commit(  # a retried commit gets its first reply: captured, persisting
                pb.CommitRequest(
                    checkpoint_id="c1",
                    deadline=timestamp(time.time() + WAIT),
                    checkpoint_dir=str(tmp_path / "c1"),
                    episode_ids=[e.to_pb() for e in EPISODES],
                    explicit_scope=True,
                    persist_in_background=True,
                ),
                timeout=WAIT,
            )
            assert again.persisting
            assert not again.HasField("manifest")
            await controller.resume("c1")  # the episodes go on; the capture is kept
            await deployment.increment("resources/r0", EPISODES[0], "call-1")
            with pytest.raises(CoordinationError) as caught:
                await controller.publish(captured)
            assert caught.value.operation == "persist"
            assert list(caught.value.failures) == ["resources/r0"]
            assert caught.value.failures["resources/r0"].reason == "BACKEND_FAILURE"
            assert not (tmp_path / "c1" / INDEX).exists()
            manifests, index = await controller.publish(captured)  # retried: written from the same capture
            assert sorted(m.name for m in index.members) == NAMES
            assert manifests["resources/r0"].record_count == 1
        finally:
            await deployment.close()

        async with restored(tmp_path / "c1") as fresh:
            assert await counter(fresh, "resources/r0", EPISODES[0].next()) == 1  # the capture's, not 2

    asyncio.run(main())


def test_both_scope_forms_decode_to_the_same_scope() -> None:
    episodes = [EpisodeKey("e0", 0), EpisodeKey("r.1_x-2", 7), EpisodeKey("e0", 0)]
    messages = pb.CommitRequest(episode_ids=[e.to_pb() for e in episodes], explicit_scope=True)
    rollout_ids, attempts = packed_scope(episodes)
    packed = pb.CommitRequest(scope_rollout_ids=rollout_ids, scope_attempts=attempts, explicit_scope=True)
    wire = [pb.CommitRequest.FromString(r.SerializeToString()) for r in (messages, packed)]
    scopes = [commit_scope(r) for r in wire]
    assert scopes[0] == scopes[1] == frozenset(episodes)
    assert {type(e) for e in scopes[1]} == {EpisodeKey}  # participants read `.rollout_id` off them
    assert commit_scope(pb.CommitRequest(explicit_scope=True)) == frozenset()  # continues none
    assert commit_scope(pb.CommitRequest()) is None  # the older meaning: every parked episode
    # The one-pass id check joins ids with newlines: an id holding one must not pass as two.
    for request in (
        pb.CommitRequest(episode_ids=[common_pb2.EpisodeId(rollout_id="e0"), common_pb2.EpisodeId(rollout_id="a\nb")]),
        pb.CommitRequest(scope_rollout_ids=["e0", "a\nb"], scope_attempts=[0, 0]),
    ):
        with pytest.raises(InvalidArgument, match=r"(episode_ids|scope_rollout_ids)\[1\]"):
            commit_scope(request)


@pytest.mark.parametrize("form", ["packed", "messages", "mixed"])
def test_a_non_stop_checkpoint_restores_exactly_through_either_scope_form(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    """Controllers send the packed scope to participants that say they read it, `episode_ids` to others."""
    seen: dict[str, tuple[list[str], list[int], list[EpisodeKey]]] = {}
    real = ParticipantServicer.Commit

    async def commit(self: ParticipantServicer, request: pb.CommitRequest, context: Any) -> pb.CommitResponse:
        keys = [EpisodeKey.of(e) for e in request.episode_ids]
        seen[self.plane.name] = (list(request.scope_rollout_ids), list(request.scope_attempts), keys)
        return await real(self, request, context)

    monkeypatch.setattr(ParticipantServicer, "Commit", commit)
    older = {"packed": set(), "messages": set(NAMES), "mixed": {"model/m0", "resources/r1"}}[form]

    async def main() -> None:
        deployment = await seeded()
        controller = deployment.controller
        try:
            members = await controller.discover()
            assert all(m.packed_scope for m in members)  # every participant here says it reads it
            controller.members = [dataclasses.replace(m, packed_scope=m.name not in older) for m in members]
            result = await controller.checkpoint(tmp_path, episode_ids=EPISODES, checkpoint_id="c1", timeout=WAIT)
            assert result.committed
            for name in NAMES:
                expected = ([], [], EPISODES) if name in older else (["e0", "e1"], [0, 0], [])
                assert seen[name] == expected, name
            for i, episode in enumerate(EPISODES):  # after the capture: not in the checkpoint
                await deployment.increment(f"resources/r{i}", episode, "call-1")
        finally:
            await deployment.close()

        async with restored(tmp_path / "c1") as fresh:
            for i, episode in enumerate(EPISODES):
                assert await counter(fresh, f"resources/r{i}", episode.next()) == 1
            agent = fresh.nodes["agent/a"].participant
            assert sorted(agent.installed) == sorted(e.next() for e in EPISODES)
        for record in store.read_checkpoint(tmp_path / "c1", Kind.MODEL, "model/m0")[1]:
            assert len(record.model_episode.rows) == 1

    asyncio.run(main())
