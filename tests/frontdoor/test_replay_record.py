"""The replay record on real files: positions per run, client retries, divergence, durability, freeing."""

from __future__ import annotations

from pathlib import Path

import pytest

from gymrpc.control import EpisodeKey
from gymrpc.errors import FailedPrecondition
from gymrpc.servers.model.replay import GO_LIVE, ReplayRecord, first_difference
from gymrpc.v1 import common_pb2
from gymrpc.v1 import model_service_pb2 as pb

EPISODE = EpisodeKey("r1", 0)


def request(k: int) -> dict[str, object]:
    return {"messages": [{"role": "ROLE_USER", "content": f"turn {k}"}], "tools": [], "sampling": {}}


def response(k: int) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        message=common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, content=f"reply {k}"),
        tokens=common_pb2.TokenTrace(prompt_token_ids=[1, k], completion_token_ids=[k, 2]),
    )


def live_run(record: ReplayRecord, run_id: str, calls: int) -> None:
    for k in range(calls):
        position = record.position(EPISODE, run_id, request(k))
        assert position.entry is None
        record.record(EPISODE, position.index, request(k), response(k))


def test_a_new_run_is_answered_from_the_record_then_goes_live(tmp_path: Path) -> None:
    record = ReplayRecord(tmp_path)
    live_run(record, "run-a", 3)
    for k in range(3):
        position = record.position(EPISODE, "run-b", request(k))
        assert position.index == k
        assert position.entry is not None
        assert position.entry.response == response(k)
    assert record.position(EPISODE, "run-b", request(3)).entry is None  # past the record: live
    assert record.stats == {"replayed": 3, "recorded": 3, "diverged": 0}


def test_a_client_retry_keeps_its_position(tmp_path: Path) -> None:
    record = ReplayRecord(tmp_path)
    first = record.position(EPISODE, "run-a", request(0))
    again = record.position(EPISODE, "run-a", request(0))
    assert first.index == again.index == 0
    assert record.position(EPISODE, "run-a", request(1)).index == 1


def test_a_divergence_names_the_position_and_field_or_goes_live(tmp_path: Path) -> None:
    record = ReplayRecord(tmp_path)
    live_run(record, "run-a", 3)
    assert record.position(EPISODE, "run-b", request(0)).entry is not None
    with pytest.raises(FailedPrecondition) as caught:
        record.position(EPISODE, "run-b", request(7))
    assert caught.value.reason == "REPLAY_DIVERGENCE"
    assert caught.value.metadata["position"] == "1"
    assert caught.value.metadata["field"] == "messages[0].content"
    position = record.position(EPISODE, "run-c", request(0))
    assert position.entry is not None
    position = record.position(EPISODE, "run-c", request(9), GO_LIVE)
    assert (position.index, position.entry) == (1, None)
    assert len(ReplayRecord(tmp_path).entries(EPISODE)) == 1  # cut on disk too


def test_first_difference_paths() -> None:
    assert first_difference({"a": [1, 2]}, {"a": [1, 2]}) is None
    assert first_difference({"a": [1, 2]}, {"a": [1, 3]}) == "a[1]"
    assert first_difference({"a": [1]}, {"a": [1, 2]}) == "a[1]"
    assert first_difference({"a": 1}, {"b": 1}) == "a"
    assert first_difference({"s": {"t": 1}}, {"s": {"t": 2}}) == "s.t"


def test_the_record_survives_a_new_process_and_a_torn_last_line(tmp_path: Path) -> None:
    live_run(ReplayRecord(tmp_path), "run-a", 2)
    (path,) = tmp_path.glob("*.jsonl")
    with path.open("a") as file:
        file.write('{"request": {"messa')  # a crash in the middle of a write: never delivered
    reopened = ReplayRecord(tmp_path)
    assert [e.response for e in reopened.entries(EPISODE)] == [response(0), response(1)]
    assert reopened.position(EPISODE, "run-b", request(0)).entry is not None


def test_retire_and_forget_free_memory_and_files(tmp_path: Path) -> None:
    record = ReplayRecord(tmp_path)
    live_run(record, "run-a", 2)
    other = EpisodeKey("r2", 1)
    record.record(other, 0, request(0), response(0))
    record.retired(lambda episode: episode == EPISODE)
    assert record.entries(EPISODE) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r2.a1.jsonl"]
    ReplayRecord(tmp_path).forget(["r2"])
    assert list(tmp_path.iterdir()) == []
