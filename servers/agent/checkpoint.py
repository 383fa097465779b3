"""`EpisodeState` ⇄ `EpisodeCheckpoint`: what is written at a boundary and how a run is rebuilt from it.

The record being run is an `EncodedCheckpoint` (gymrpc/store/encoded.py), updated in
place at every boundary: its lists only grow at the end (the loop only ever appends
messages and call records), so a boundary encodes the new tail once, and the save copies
the history's bytes instead of encoding it again. A record read back is checked against the
phase invariants of `EpisodeState` before the loop trusts it: a record that could not
have been written by this code is DATA_LOSS, not a crash halfway through a resume.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from google.protobuf.message import Message

from gymrpc.errors import DataLoss
from gymrpc.ids import ROLLOUT_ID
from gymrpc.pbtime import seconds, set_duration
from gymrpc.servers.agent.state import EpisodeState, Phase
from gymrpc.store import SCHEMA_VERSION, EpisodeCheckpoint
from gymrpc.store.encoded import EncodedCheckpoint
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2

_RUNNING = (Phase.READY_FOR_MODEL, Phase.READY_FOR_TOOL, Phase.READY_FOR_VERIFY)
_IN_PROGRESS_FIELDS = ("tools", "messages", "pending_tool_calls", "model_calls", "tool_calls", "usage")


def fingerprint(task: common_pb2.Task) -> str:
    """`sha256:<hex>` of the task's deterministic bytes: the same id with another task is a conflict."""
    return "sha256:" + hashlib.sha256(task.SerializeToString(deterministic=True)).hexdigest()


def new_record(state: EpisodeState, request_fingerprint: str, *, restart_count: int = 0) -> Message:
    """The `EncodedCheckpoint` of an episode that has not been seeded yet (revision 0: nothing stored)."""
    state.restart_count = restart_count
    return EncodedCheckpoint(
        schema_version=SCHEMA_VERSION,
        episode_id=state.episode_id,
        request_fingerprint=request_fingerprint,
        policy_version=state.policy_version,
        phase=agent_pb.EPISODE_PHASE_UNSPECIFIED,
        max_steps=state.max_steps,
        text_turns=state.text_turns,
        session_id=state.session_id,
        restart_count=restart_count,
        traceparent=state.traceparent,
    )


class RecordWriter:
    """Brings one run's `EncodedCheckpoint` to each boundary, touching only what moved since the last.

    Each access to a field of a upb message from Python is a name lookup, a microsecond or so;
    a boundary changes few of the record's fields (the phase, a counter or two, a list's tail,
    perhaps the snapshot). So the writer keeps what it last wrote and compares in Python first.
    Nothing else may change these fields of the record while the writer is in use (the store
    changes only `revision` and `updated_at`, which the writer does not write).
    """

    __slots__ = (
        "_counts",
        "_elapsed",
        "_lists",
        "_next_tool_index",
        "_pending",
        "_pending_count",
        "_phase",
        "_rare",
        "_step",
        "_stop_reason",
        "_tools",
        "record",
    )

    def __init__(self, record: Message) -> None:
        self.record = record
        self._phase, self._step = record.phase, record.step
        self._next_tool_index, self._stop_reason = record.next_tool_index, record.stop_reason
        self._rare: tuple[Any, ...] = ()
        self._elapsed = record.elapsed
        self._tools: list[Any] | None = None
        self._lists = (record.messages, record.model_calls, record.tool_calls)
        self._counts = [len(items) for items in self._lists]
        self._pending: list[Any] | None = None
        self._pending_count = 0

    def boundary(self, state: EpisodeState, snapshot: common_pb2.SessionSnapshot | None) -> None:
        """The record at the boundary `state` stands at; `snapshot` replaces the session's if given."""
        record = self.record
        if state.phase != self._phase:
            record.phase = self._phase = int(state.phase)  # type: ignore[assignment]
        if state.step != self._step:
            record.step = self._step = state.step
        if state.next_tool_index != self._next_tool_index:
            record.next_tool_index = self._next_tool_index = state.next_tool_index
        if state.stop_reason != self._stop_reason:
            record.stop_reason = self._stop_reason = state.stop_reason  # type: ignore[assignment]
        set_duration(self._elapsed, state.elapsed_s)
        rare = (state.resume_count, state.restart_count, state.failovers, state.session_recoveries, state.traceparent)
        if rare != self._rare:
            record.resume_count, record.restart_count = state.resume_count, state.restart_count
            record.failovers, record.session_recoveries = state.failovers, state.session_recoveries
            record.traceparent = state.traceparent
            if state.parked_s:
                set_duration(record.parked, state.parked_s)
            self._rare = rare
        if state.tools is not self._tools:
            if not state.task.tools and len(record.tools) != len(state.tools):
                _replace(record.tools, state.tools)
            self._tools = state.tools
        counts, lists = self._counts, self._lists
        if len(state.messages) != counts[0]:
            counts[0] = _encode_tail(lists[0], state.messages, counts[0])
        if len(state.model_calls) != counts[1]:
            counts[1] = _encode_tail(lists[1], state.model_calls, counts[1])
            record.usage.CopyFrom(state.usage)  # usage moves with each model call, and only then
        if len(state.tool_calls) != counts[2]:
            counts[2] = _encode_tail(lists[2], state.tool_calls, counts[2])
        pending = state.pending_tool_calls
        if pending is not self._pending or len(pending) != self._pending_count:  # the loop replaces the list
            _replace(record.pending_tool_calls, pending)
            self._pending, self._pending_count = pending, len(pending)
        if snapshot is not None:
            record.resource_snapshot = snapshot.SerializeToString(deterministic=True)


def record_boundary(record: Message, state: EpisodeState, snapshot: common_pb2.SessionSnapshot | None) -> None:
    """Bring the `EncodedCheckpoint` to the boundary `state` stands at, once (a run uses a `RecordWriter`)."""
    RecordWriter(record).boundary(state, snapshot)


def record_completion(record: Message, state: EpisodeState, ttl_s: float) -> None:
    """The completed record: identity, counters and the final trajectory; in-progress state is dropped."""
    record.phase = int(state.phase)  # type: ignore[assignment]
    record.step, record.next_tool_index = state.step, 0
    record.stop_reason = state.stop_reason  # type: ignore[assignment]
    record.resume_count, record.restart_count = state.resume_count, state.restart_count
    record.failovers, record.session_recoveries = state.failovers, state.session_recoveries
    set_duration(record.elapsed, state.elapsed_s)
    for name in (*_IN_PROGRESS_FIELDS, "resource_snapshot"):
        record.ClearField(name)  # type: ignore[arg-type]
    record.ClearField("final_result")
    state.trajectory(into=record.final_result)
    record.expires_at.FromNanoseconds(time.time_ns() + int(ttl_s * 1e9))


def restore_state(state: EpisodeState, record: EpisodeCheckpoint, *, snapshot: bool = True) -> None:
    """Put `state` (identity and task already set) back at the boundary `record` describes.

    `snapshot=False`: the record need not hold a session snapshot (a coordinated checkpoint,
    where the resources server restores the session itself).
    """
    check_running(record, snapshot=snapshot)
    state.phase = Phase(record.phase)
    state.step, state.next_tool_index = record.step, record.next_tool_index
    state.max_steps, state.text_turns = record.max_steps, record.text_turns
    state.session_id = record.session_id
    state.tools = _copies(record.tools) if record.tools else list(state.task.tools)
    state.messages = _copies(record.messages)
    state.pending_tool_calls = _copies(record.pending_tool_calls)
    state.model_calls = _copies(record.model_calls)
    state.tool_calls = _copies(record.tool_calls)
    state.usage = common_pb2.Usage()
    state.usage.CopyFrom(record.usage)
    state.stop_reason = record.stop_reason
    state.verify = None
    state.resume_count, state.restart_count = record.resume_count, record.restart_count
    state.failovers = record.failovers  # moves before the crash; this process adds its own
    state.session_recoveries = record.session_recoveries  # likewise: recoveries of the runs before
    state.elapsed_s = seconds(record.elapsed)
    state.parked_s = seconds(record.parked)


def check_completed(record: EpisodeCheckpoint) -> None:
    """DATA_LOSS unless a completed record holds the trajectory it is kept for."""
    if not record.HasField("final_result") or record.final_result.episode_id.rollout_id != record.episode_id.rollout_id:
        label = record.episode_id.rollout_id
        raise DataLoss(
            f"the checkpoint of episode {label!r} is completed but holds no trajectory of it; nothing was changed",
            metadata={"rollout_id": label},
        )


def check_running(record: EpisodeCheckpoint, *, snapshot: bool = True) -> None:
    """DATA_LOSS unless `record` is an in-progress record this code could have written."""
    label = record.episode_id.rollout_id
    problems = []
    if record.schema_version != SCHEMA_VERSION:
        problems.append(f"schema_version {record.schema_version} is not {SCHEMA_VERSION}")
    if record.phase not in _RUNNING:
        problems.append(f"phase {record.phase} is not a running phase")
    if snapshot and (not record.HasField("resource_snapshot") or not record.resource_snapshot.format_name):
        problems.append("it has no resources session snapshot")
    if not ROLLOUT_ID.fullmatch(record.session_id):
        problems.append(f"session_id {record.session_id[:140]!r} is invalid")
    if record.max_steps < 1 or record.step > record.max_steps:
        problems.append(f"step {record.step} of max_steps {record.max_steps}")
    if record.next_tool_index > len(record.pending_tool_calls):
        problems.append(f"next_tool_index {record.next_tool_index} past {len(record.pending_tool_calls)} calls")
    if len(record.messages) < record.step or len(record.model_calls) != record.step:
        problems.append(f"{len(record.model_calls)} model calls recorded for step {record.step}")
    if problems:
        raise DataLoss(
            f"the checkpoint of episode {label!r} is inconsistent: {'; '.join(problems)}; nothing was changed",
            metadata={"rollout_id": label},
        )


def _encode_tail(target: Any, source: list[Any], done: int) -> int:
    """Encode the items of `source` past the `done` that `target` holds; how many it holds now."""
    if done > len(source):  # never happens with the loop's append-only lists; stay correct anyway
        del target[:]
        done = 0
    target.extend([item.SerializeToString(deterministic=True) for item in source[done:]])
    return len(source)


def _replace(target: Any, source: list[Any]) -> None:
    del target[:]
    target.extend(source)


def _copies(items: Any) -> list[Any]:
    out = []
    for item in items:
        copy = type(item)()
        copy.CopyFrom(item)
        out.append(copy)
    return out
