"""Captures that take nothing per episode in the pause: copy-on-write sessions, ledger views, a lazy scope.

Each test mutates state after the capture (after the resume, as the episodes do) and checks that
the checkpoint written later holds the state at the capture, exactly; and that the capture itself
did no per-episode work (no session taken, no scope set built) while the episodes were parked.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from gymrpc.control import EpisodeKey, Kind, store
from gymrpc.control.scope import PackedScope
from gymrpc.envkit import SnapshotUnsupported
from gymrpc.envs.counter import CounterEnvironment
from gymrpc.envs.counter.environment import CounterSession
from gymrpc.errors import FailedPrecondition, InvalidArgument
from gymrpc.servers.model.capture import CaptureLedger, RestoredCuts, cuts_of
from gymrpc.servers.participant import commit_scope
from gymrpc.v1 import checkpoint_records_pb2 as rec_pb
from gymrpc.v1 import common_pb2
from gymrpc.v1 import participant_service_pb2 as pb
from gymrpc.v1 import resources_service_pb2 as resources_pb
from tests.agent.fakes import counter_task
from tests.control.test_resources import Server, soon


def counts(folder: Path, name: str) -> dict[str, int]:
    """Session id -> its count, from the records written."""
    out = {}
    for record in store.read_checkpoint(folder, Kind.RESOURCES, name)[1]:
        body = record.resources_session
        out[body.session_id] = json.loads(body.snapshot.payload)["count"]
    return out


def test_sessions_are_taken_on_their_first_change_or_after_the_resume_never_in_the_pause(tmp_path: Path) -> None:
    async def main() -> None:
        server = Server(CounterEnvironment())
        try:
            for rollout in ("a", "b", "c"):
                await server.seed(rollout, counter_task(rollout, 0, 5))
                await server.add(rollout, 1)
            scope = PackedScope(["a", "b"], [0, 0])  # "c" is left out
            (phase, _), host = await server.plane.prepare("c1", soon()), server.servicer.host
            assert phase.name == "PREPARED"
            assert await server.plane.commit("c1", soon(), str(tmp_path / "c1"), scope, background=True) is None
            (frozen,) = list(host.frozen._open)
            assert frozen.taken == {}  # the pause copied the session table, nothing per session
            assert not scope.built  # nor made the scope a set
            await server.plane.resume("c1")
            await server.add("a", 10)  # taken first, as it stood at the capture
            assert set(frozen.taken) == {"a-s"}
            await server.servicer.CloseSession(_close("b"), None)  # a close is a change too
            await server.add("c", 10)
            await server.plane.persist("c1", soon())
            assert frozen.settled
            assert len(host.frozen) == 0  # settled: no longer told about changes
            assert counts(tmp_path / "c1", "resources/test") == {"a-s": 1, "b-s": 1}
            assert await server.value("a") == 11
        finally:
            await server.close()

    asyncio.run(main())


def test_a_session_whose_capture_fails_fails_the_write_not_the_call_that_changed_it(tmp_path: Path) -> None:
    class Fragile(CounterSession):
        def capture(self) -> Any:
            raise SnapshotUnsupported("not now")

    async def main() -> None:
        server = Server(CounterEnvironment())
        try:
            await server.seed("a", counter_task("a", 0, 5))
            server.servicer.host._slots["a-s"].session.__class__ = Fragile
            phase, _ = await server.plane.prepare("c1", soon())
            assert phase.name == "PREPARED"
            assert await server.plane.commit("c1", soon(), str(tmp_path / "c1"), None, background=True) is None
            await server.plane.resume("c1")
            await server.add("a", 2)  # the call that changed it succeeds
            assert await server.value("a") == 2
            with pytest.raises(FailedPrecondition, match="not now"):
                await server.plane.persist("c1", soon())
        finally:
            await server.close()

    asyncio.run(main())


def _close(rollout: str) -> resources_pb.CloseSessionRequest:
    episode = common_pb2.EpisodeId(rollout_id=rollout, attempt=0)
    return resources_pb.CloseSessionRequest(session_id=f"{rollout}-s", episode_id=episode)


def test_a_ledger_view_and_a_cuts_view_are_the_state_at_the_capture() -> None:
    ledger, row = CaptureLedger(max_episodes=2), rec_pb.CaptureRow(request_id="r0")
    ledger.record(EpisodeKey("e0", 0), row)
    ledger.record(EpisodeKey("e1", 0), row)
    view = ledger.view()
    ledger.record(EpisodeKey("e1", 0), rec_pb.CaptureRow(request_id="r1"))
    ledger.record(EpisodeKey("e2", 0), row)  # e0 is evicted from the live ledger
    assert {e.rollout_id: len(r) for e, r in view.items()} == {"e0": 1, "e1": 1}
    assert [r.request_id for r in ledger.rows(EpisodeKey("e1", 0))] == ["r0", "r1"]
    cuts = RestoredCuts()
    cuts.install(EpisodeKey("e0", 1), [rec_pb.GenerationCut(request_digest="d", source_request_id="x")])
    taken = cuts.view()
    assert cuts.take(EpisodeKey("e0", 1), "d") is not None  # claimed after the capture
    assert list(cuts_of(taken, [EpisodeKey("e0", 1)])) == [EpisodeKey("e0", 1)]
    assert cuts_of(taken, [EpisodeKey("e0", 0)]) == {}  # an older attempt never continues a newer cut


def test_a_packed_scope_is_checked_at_once_and_made_a_set_when_used() -> None:
    request = pb.CommitRequest(explicit_scope=True, scope_rollout_ids=["a", "b", "a"], scope_attempts=[0, 1, 0])
    scope = commit_scope(request)
    assert isinstance(scope, PackedScope)
    assert not scope.built
    assert EpisodeKey("b", 1) in scope
    assert ("a", 0) in scope
    assert scope.built
    assert len(scope) == 2
    assert scope == frozenset({EpisodeKey("a", 0), EpisodeKey("b", 1)})
    assert frozenset({EpisodeKey("a", 0), EpisodeKey("b", 1)}) == scope
    assert scope & {EpisodeKey("a", 0)} == frozenset({EpisodeKey("a", 0)})
    assert commit_scope(pb.CommitRequest(explicit_scope=True)) == frozenset()
    assert commit_scope(pb.CommitRequest()) is None
    with pytest.raises(InvalidArgument, match=r"scope_rollout_ids\[1\]"):
        commit_scope(pb.CommitRequest(explicit_scope=True, scope_rollout_ids=["a", "b/c"], scope_attempts=[0, 0]))
    with pytest.raises(InvalidArgument, match="same length"):
        commit_scope(pb.CommitRequest(explicit_scope=True, scope_rollout_ids=["a"], scope_attempts=[0, 0]))
