"""`EncodedCheckpoint`: the agent's record keeps its history encoded and writes an `EpisodeCheckpoint`'s bytes.

The stores, the log's deltas and every reader parse `EpisodeCheckpoint`, so what matters is
that both types give the same deterministic bytes for the same record, whichever fills it.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import pytest
from google.protobuf import any_pb2

from gymrpc.chat import default_tokenizer
from gymrpc.pbtime import duration
from gymrpc.servers.agent import checkpoint
from gymrpc.servers.agent.loop import EpisodeLoop
from gymrpc.servers.agent.participant import boundary_record
from gymrpc.servers.agent.state import EpisodeState, Phase
from gymrpc.servers.model.backends.scripted import ScriptedBackend
from gymrpc.servers.model.backends.sources import CounterSolver
from gymrpc.servers.model.service import ModelServicer
from gymrpc.store import SCHEMA_VERSION, EpisodeCheckpoint
from gymrpc.store.encoded import EncodedCheckpoint, decoded, encoded, pack
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2
from tests.agent.fakes import DirectStub, counter_resources, fake_model
from tests.resume.helpers import task


def full_record(seed: int) -> EpisodeCheckpoint:
    """A record with every kind of field set, long token traces among them."""
    rng = random.Random(seed)
    record = EpisodeCheckpoint(schema_version=1, revision=rng.randrange(1, 99))
    record.phase = agent_pb.EPISODE_PHASE_READY_FOR_TOOL
    record.episode_id.rollout_id, record.episode_id.attempt = f"ep-{seed}", rng.randrange(3)
    record.request_fingerprint, record.policy_version, record.session_id = "sha256:ab", "iteration:7", f"s-{seed}"
    record.step, record.max_steps, record.text_turns = 2, 8, bool(seed % 2)
    for i in range(rng.randrange(1, 6)):
        record.messages.add(role=common_pb2.ROLE_USER, content="é" * rng.randrange(300) + str(i))
        call = record.model_calls.add(step=i, weight_version="iteration:7")
        call.tokens.prompt_token_ids.extend(rng.randrange(150_000) for _ in range(rng.randrange(2_000)))
        call.tokens.completion_logprobs.extend(rng.random() for _ in range(rng.randrange(50)))
        record.tool_calls.add(step=i, output="x" * rng.randrange(200), is_error=bool(i % 2))
    record.pending_tool_calls.add(id="c1", name="increment", arguments_json="{}")
    if seed % 3:
        record.resource_snapshot.format_name = "counter"
        record.resource_snapshot.payload = rng.randbytes(rng.randrange(100))
    record.updated_at.FromNanoseconds(rng.randrange(1 << 60))
    record.elapsed.FromNanoseconds(rng.randrange(1 << 40))
    record.usage.input_tokens = rng.randrange(1 << 20)
    return record


def test_both_types_write_and_read_the_same_bytes() -> None:
    for seed in range(40):
        record = full_record(seed)
        data = record.SerializeToString(deterministic=True)
        twin = encoded(record)
        assert twin.SerializeToString(deterministic=True) == data
        assert decoded(twin) == record
        assert all(type(entry) is bytes for entry in twin.messages)


def test_an_empty_snapshot_is_written_as_the_message_writes_it() -> None:
    record = EpisodeCheckpoint()
    record.resource_snapshot.SetInParent()
    twin = EncodedCheckpoint()
    twin.resource_snapshot = b""
    assert twin.SerializeToString() == record.SerializeToString() != b""
    assert twin.HasField("resource_snapshot")
    assert not EncodedCheckpoint().HasField("resource_snapshot")


def state_record(
    state: EpisodeState, fingerprint: str, snapshot: common_pb2.SessionSnapshot | None
) -> EpisodeCheckpoint:
    """The record of `state` at its boundary, field by field, as the durable path promises to write it."""
    return EpisodeCheckpoint(
        schema_version=SCHEMA_VERSION,
        episode_id=state.episode_id,
        request_fingerprint=fingerprint,
        policy_version=state.policy_version,
        phase=int(state.phase),
        step=state.step,
        next_tool_index=state.next_tool_index,
        max_steps=state.max_steps,
        text_turns=state.text_turns,
        session_id=state.session_id,
        tools=[] if state.task.tools else state.tools,
        messages=state.messages,
        pending_tool_calls=state.pending_tool_calls,
        stop_reason=state.stop_reason,
        model_calls=state.model_calls,
        tool_calls=state.tool_calls,
        usage=state.usage if state.model_calls else None,  # written with the first model call
        resource_snapshot=snapshot,
        resume_count=state.resume_count,
        restart_count=state.restart_count,
        elapsed=duration(state.elapsed_s),
        failovers=state.failovers,
        session_recoveries=state.session_recoveries,
        traceparent=state.traceparent,
    )


def solver_model() -> DirectStub:
    """The scripted model that solves counter tasks, several tool calls in one turn."""
    tokenizer = default_tokenizer()
    return DirectStub(ModelServicer(ScriptedBackend(tokenizer, [CounterSolver()]), tokenizer))


@pytest.mark.parametrize("model", [fake_model, solver_model])
def test_every_boundary_of_a_real_episode_is_the_record_of_its_state(model: Callable[[], DirectStub]) -> None:
    """The agent's loop runs a counter episode; after each transition the record the durable path keeps
    (one `RecordWriter` for the run, which writes only what moved) is the record of the state, field
    by field, and its lists and snapshot are the state's."""
    resources = counter_resources()

    async def main() -> int:
        state = EpisodeState("ep", 0, task(1), 8)
        loop = EpisodeLoop(resources, model())
        loop.snapshots_in_replies = True
        fingerprint = checkpoint.fingerprint(state.task)
        record = checkpoint.new_record(state, fingerprint)
        writer = checkpoint.RecordWriter(record)
        boundaries, latest = 0, None
        while state.phase is not Phase.COMPLETED:
            phase = state.phase
            state.session_snapshot = None
            await loop.advance(state)
            state.elapsed_s += 0.25
            state.failovers += phase is Phase.READY_FOR_TOOL  # counters that move now and then: written too
            if state.phase is Phase.COMPLETED:
                checkpoint.record_completion(record, state, 60.0)
                assert decoded(record).final_result == state.trajectory()
                break
            snapshot = state.session_snapshot if phase in (Phase.NEW, Phase.READY_FOR_TOOL) else None
            assert (snapshot is None) == (phase not in (Phase.NEW, Phase.READY_FOR_TOOL))
            latest = snapshot or latest
            writer.boundary(state, snapshot)
            saved = decoded(record)
            assert list(saved.messages) == state.messages
            assert list(saved.model_calls) == state.model_calls
            assert list(saved.tool_calls) == state.tool_calls
            assert saved.resource_snapshot == latest
            assert saved == state_record(state, fingerprint, latest)
            boundaries += 1
        return boundaries

    assert asyncio.run(main()) >= 4


def test_a_coordinated_checkpoint_packs_the_record_as_an_episode_checkpoint() -> None:
    state = EpisodeState("ep", 0, task(0), 8)
    state.messages.append(common_pb2.Message(role=common_pb2.ROLE_USER, content="count"))
    packed = any_pb2.Any()
    pack(packed, boundary_record(state, "sha256:ab"))
    body = EpisodeCheckpoint()
    assert packed.Is(EpisodeCheckpoint.DESCRIPTOR)
    assert packed.Unpack(body)
    assert list(body.messages) == state.messages
    assert body.request_fingerprint == "sha256:ab"
