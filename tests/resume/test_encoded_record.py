"""`EncodedCheckpoint`: the agent's record keeps its history encoded and writes an `EpisodeCheckpoint`'s bytes.

The stores, the log's deltas and every reader parse `EpisodeCheckpoint`, so what matters is
that both types give the same deterministic bytes for the same record, whichever fills it.
"""

from __future__ import annotations

import asyncio
import random

from google.protobuf import any_pb2

from gymrpc.servers.agent import checkpoint
from gymrpc.servers.agent.loop import EpisodeLoop
from gymrpc.servers.agent.participant import boundary_record
from gymrpc.servers.agent.state import EpisodeState, Phase
from gymrpc.store import EpisodeCheckpoint
from gymrpc.store.encoded import EncodedCheckpoint, decoded, encoded, pack
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2
from tests.agent.fakes import counter_resources, fake_model
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


def test_every_boundary_of_a_real_episode_is_the_record_of_its_state() -> None:
    """The agent's loop runs a counter episode; after each transition the record the durable path keeps
    holds exactly the state's lists and snapshot, and writes the bytes of that `EpisodeCheckpoint`."""
    resources = counter_resources()

    async def main() -> int:
        state = EpisodeState("ep", 0, task(1), 8)
        loop = EpisodeLoop(resources, fake_model())
        loop.snapshots_in_replies = True
        record = checkpoint.new_record(state, checkpoint.fingerprint(state.task))
        boundaries = 0
        while state.phase is not Phase.COMPLETED:
            phase = state.phase
            state.session_snapshot = None
            await loop.advance(state)
            if state.phase is Phase.COMPLETED:
                checkpoint.record_completion(record, state, 60.0)
                assert decoded(record).final_result == state.trajectory()
                break
            snapshot = state.session_snapshot if phase in (Phase.NEW, Phase.READY_FOR_TOOL) else None
            assert (snapshot is None) == (phase not in (Phase.NEW, Phase.READY_FOR_TOOL))
            checkpoint.record_boundary(record, state, snapshot)
            saved = decoded(record)
            assert record.SerializeToString(deterministic=True) == saved.SerializeToString(deterministic=True)
            assert list(saved.messages) == state.messages
            assert list(saved.model_calls) == state.model_calls
            assert list(saved.tool_calls) == state.tool_calls
            if snapshot is not None:
                assert saved.resource_snapshot == snapshot
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
