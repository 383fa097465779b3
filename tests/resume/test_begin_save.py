"""`EpisodeStore.begin_save`: a boundary's save goes to the disk while the episode's next call runs.

The log store encodes the record and hands its frame to the commit thread at once; the wait
for the disk is the caller's, at the next boundary. What must hold: the bytes written are
the record as it was when the save began, a lease's saves stay in order, a failed write
raises where it is awaited and leaves the record's revision as it was, a save nobody awaits
is still written, and the durable agent really makes its next call before the save is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from gymrpc.errors import Aborted, Unavailable
from gymrpc.servers.agent.durable import DurableEpisodes, ResumeConfig
from gymrpc.servers.agent.loop import EpisodeLoop
from gymrpc.servers.agent.state import EpisodeState
from gymrpc.store import SAVED, EpisodeCheckpoint, EpisodeLease, FilesystemEpisodeStore, LogEpisodeStore, PendingSave
from gymrpc.v1 import agent_service_pb2 as agent_pb
from tests.agent.fakes import DirectStub, counter_resources, fake_model
from tests.resume.helpers import task
from tests.resume.test_log_store import _grow, _load
from tests.resume.test_store import _record


def _copy(record: EpisodeCheckpoint) -> EpisodeCheckpoint:
    out = EpisodeCheckpoint()
    out.CopyFrom(record)
    return out


def _hold_writes(store: LogEpisodeStore) -> threading.Event:
    """The commit thread's writes wait until the returned event is set."""
    go = threading.Event()
    write = store._write_durably
    store._write_durably = lambda *args: go.wait() and write(*args)  # type: ignore[method-assign]
    return go


def test_a_begun_save_writes_the_record_as_it_was_and_the_next_waits_for_it(tmp_path: Path) -> None:
    async def scenario() -> list[EpisodeCheckpoint | None]:
        store = LogEpisodeStore(tmp_path)
        record = _record()
        async with store.lease("ep") as lease:
            await store.save(lease, record)
            go = _hold_writes(store)
            _grow(record, 1)
            pending = await store.begin_save(lease, record)
            assert record.revision == 2, "the revision is set when the save begins"
            began = _copy(record)
            _grow(record, 2)  # the caller moves on: the save holds what it had
            with pytest.raises(RuntimeError, match="was not awaited"):
                await store.begin_save(lease, record)
            with pytest.raises(RuntimeError, match="was not awaited"):
                await store.load(lease)
            assert record.revision == 2, "a refused save changes nothing"
            go.set()
            await pending
            await pending  # a second wait returns at once
            assert await store.load(lease) == began
            await store.save(lease, record)  # a delta against the begun save's record
        loaded = await _load(store, "ep")
        await store.close()
        reopened = LogEpisodeStore(tmp_path)
        again = await _load(reopened, "ep")
        await reopened.close()
        assert began.revision == 2
        assert record.revision == 3
        return [loaded, again, record]

    loaded, again, record = asyncio.run(scenario())
    assert loaded == record
    assert again == record


def test_a_failed_begun_save_raises_where_it_is_awaited_and_restores_the_revision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        store = LogEpisodeStore(tmp_path)
        record = _record()
        async with store.lease("ep") as lease:
            await store.save(lease, record)
            stamp = (record.updated_at.seconds, record.updated_at.nanos)

            def full_disk(fd: int, buffers: list[bytes], offset: int, flags: int = 0) -> int:
                raise OSError(errno.ENOSPC, "No space left on device")

            monkeypatch.setattr(os, "pwritev", full_disk)
            _grow(record, 1)
            pending = await store.begin_save(lease, record)
            assert record.revision == 2
            with pytest.raises(Unavailable, match="failed a write"):
                await pending
            with pytest.raises(Unavailable, match="failed a write"):
                await pending  # a second wait tells the same
            assert record.revision == 1, "the stored revision is still 1"
            assert (record.updated_at.seconds, record.updated_at.nanos) == stamp
        await store.close()

    asyncio.run(scenario())


def test_an_abandoned_save_is_still_written_and_its_failure_warns_nobody(tmp_path: Path) -> None:
    """A run that fails between two boundaries drops its pending save: the frame is written all the same,
    the lease lets the episode go only once it is, and a failed write is not reported as an unretrieved
    exception at garbage collection."""
    unretrieved: list[dict[str, Any]] = []

    async def scenario() -> EpisodeCheckpoint | None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unretrieved.append(context))
        store = LogEpisodeStore(tmp_path / "written")
        record = _record()
        lease = await store.acquire("ep")
        go = _hold_writes(store)
        (await store.begin_save(lease, record)).abandon()
        await lease.release()
        go.set()
        loaded = None
        for _ in range(3000):  # the frame lands within milliseconds; a busy machine gets 30 s
            with contextlib.suppress(Aborted):  # LEASE_HELD until the frame is written
                loaded = await _load(store, "ep")
                break
            await asyncio.sleep(0.01)
        await store.close()

        failing = LogEpisodeStore(tmp_path / "failing")
        failing._write_durably = _raise_enospc  # type: ignore[method-assign]
        async with failing.lease("ep") as lease:
            pending = await failing.begin_save(lease, _record())
            pending.abandon()
            await asyncio.wait({pending.item.future})  # type: ignore[attr-defined]
            del pending
        await failing.close()
        del failing, lease  # the broken store holds the failed write's traceback, and so the frame's future
        gc.collect()
        await asyncio.sleep(0)
        return loaded

    loaded = asyncio.run(scenario())
    assert loaded is not None
    assert loaded.revision == 1
    assert unretrieved == []


def _raise_enospc(*args: object) -> int:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_store_that_cannot_part_the_wait_saves_before_begin_save_returns(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = FilesystemEpisodeStore(tmp_path)
        record = _record()
        async with store.lease("ep") as lease:
            assert await store.begin_save(lease, record) is SAVED
            assert await store.load(lease) == record
            await SAVED
            SAVED.abandon()
        await store.close()

    asyncio.run(scenario())


class _Calls:
    """Every call the agent makes, counted; a waiter wakes at the next one."""

    def __init__(self) -> None:
        self.seen, self.called = 0, asyncio.Event()

    def stub(self, inner: DirectStub) -> DirectStub:
        calls = self

        class Counted(DirectStub):
            def __getattr__(self, method: str) -> Any:
                call = super().__getattr__(method)

                async def counted(request: Any, **kwargs: Any) -> Any:
                    calls.seen += 1
                    calls.called.set()
                    return await call(request, **kwargs)

                return counted

        return Counted(inner.servicer)

    async def after(self, seen: int) -> None:
        while self.seen == seen:
            self.called.clear()
            await self.called.wait()


class _DurableAfterTheNextCall(LogEpisodeStore):
    """Every begun save becomes durable only once the agent has made another call: an agent that waited
    for the save before its next call would never finish."""

    def __init__(self, root: Path, calls: _Calls) -> None:
        super().__init__(root)
        self.calls, self.begun = calls, 0

    async def begin_save(self, lease: EpisodeLease, record: EpisodeCheckpoint) -> PendingSave:
        pending = await super().begin_save(lease, record)
        self.begun += 1
        return _AfterNextCall(pending, self.calls, self.calls.seen)


class _AfterNextCall(PendingSave):
    def __init__(self, pending: PendingSave, calls: _Calls, seen: int) -> None:
        self.pending, self.calls, self.seen = pending, calls, seen

    def __await__(self) -> Any:
        return self._wait().__await__()

    async def _wait(self) -> None:
        await self.calls.after(self.seen)
        await self.pending


def test_the_agent_makes_its_next_call_while_the_boundary_is_saved(tmp_path: Path) -> None:
    async def scenario() -> tuple[agent_pb.Trajectory, EpisodeCheckpoint | None, int]:
        calls = _Calls()
        loop = EpisodeLoop(calls.stub(counter_resources()), calls.stub(fake_model()))
        store = _DurableAfterTheNextCall(tmp_path, calls)
        durable = DurableEpisodes(loop, store, ResumeConfig())
        state = EpisodeState("ep", 0, task(1), 8, policy_version="p")
        trajectory = None
        async for event in durable.run(state, progress=False):
            trajectory = event
        assert isinstance(trajectory, agent_pb.Trajectory)
        stored = await _load(store, "ep")
        await store.close()
        return trajectory, stored, store.begun

    trajectory, stored, begun = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert begun >= 4, "every boundary but the last was begun and left to the next call"
    assert trajectory.reward == 1.0
    assert stored is not None
    assert stored.phase == agent_pb.EPISODE_PHASE_COMPLETED
    assert stored.final_result == trajectory
