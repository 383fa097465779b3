"""The reference trainer's pure logic, without torch: advantages, loss masks, the data cursor, its state."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gymrpc.train.cursor import DataCursor
from gymrpc.train.loop import GroupMember, lag, sampling_seed, version_number
from gymrpc.train.samples import BadTrajectory, group_advantages, sample_of, sequences_of, with_advantages
from gymrpc.train.state import (
    STATE_FILE,
    TRAINER_DIR,
    Batch,
    Finished,
    StateError,
    TrainerState,
    read_state,
    write_state,
)
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2


def call(step: int, prompt: list[int], completion: list[int], logprobs: list[float] | None = None, version: str = ""):
    tokens = common_pb2.TokenTrace(prompt_token_ids=prompt, completion_token_ids=completion)
    tokens.completion_logprobs.extend(logprobs if logprobs is not None else [-0.5] * len(completion))
    return agent_pb.ModelCallRecord(step=step, tokens=tokens, weight_version=version)


def trajectory(*calls: agent_pb.ModelCallRecord, reward: float = 0.0) -> agent_pb.Trajectory:
    return agent_pb.Trajectory(model_calls=calls, reward=reward)


# -- advantages ------------------------------------------------------------------------------


def test_group_advantages_are_centred_and_scaled_by_the_group_std() -> None:
    advantages = group_advantages([1.0, 0.0, 0.0, 0.0])
    assert sum(advantages) == pytest.approx(0.0)
    std = math.sqrt(0.1875)  # population std of (1, 0, 0, 0)
    assert advantages == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std], rel=1e-5)
    assert group_advantages([1.0, 0.0], scale=False) == [0.5, -0.5]


def test_a_group_that_agrees_teaches_nothing() -> None:
    assert group_advantages([1.0] * 8) == [0.0] * 8
    assert group_advantages([0.0] * 8) == [0.0] * 8
    assert group_advantages([]) == []


def test_advantages_are_normalised_within_each_group_only() -> None:
    samples = [
        sample_of(f"e{i}", group, trajectory(call(0, [1], [2]), reward=reward))
        for i, (group, reward) in enumerate([("a", 1.0), ("b", 1.0), ("a", 0.0), ("b", 1.0)])
    ]
    out = with_advantages(samples)
    assert [s.episode_id for s in out] == ["e0", "e1", "e2", "e3"]  # order kept
    assert out[0].advantage == pytest.approx(1.0, rel=1e-5)
    assert out[2].advantage == pytest.approx(-1.0, rel=1e-5)
    assert out[1].advantage == out[3].advantage == 0.0  # group b agreed


# -- sequences and loss masks ----------------------------------------------------------------


def test_prefix_extending_calls_make_one_sequence_with_only_generated_tokens_trained() -> None:
    first = call(0, [1, 2, 3], [10, 11], [-0.1, -0.2])
    # The next prompt = previous prompt + completion + a tool result (20, 21) + the template's turn start (4).
    second = call(1, [1, 2, 3, 10, 11, 20, 21, 4], [12], [-0.3])
    [seq] = sequences_of(trajectory(first, second))
    assert seq.token_ids == (1, 2, 3, 10, 11, 20, 21, 4, 12)
    assert seq.trained == (False, False, False, True, True, False, False, False, True)
    assert seq.trained_tokens == 3
    old = seq.old_logprobs
    assert [old[i] for i in (3, 4, 8)] == pytest.approx([-0.1, -0.2, -0.3])
    assert all(math.isnan(old[i]) for i in (0, 1, 2, 5, 6, 7))


def test_a_call_whose_prompt_does_not_extend_the_last_starts_a_new_sequence() -> None:
    first = call(0, [1, 2], [10])
    rewritten = call(1, [1, 9, 10, 4], [12])  # the history was edited: not an extension
    sequences = sequences_of(trajectory(first, rewritten))
    assert [s.token_ids for s in sequences] == [(1, 2, 10), (1, 9, 10, 4, 12)]
    assert [s.trained for s in sequences] == [(False, False, True), (False, False, False, False, True)]


def test_missing_logprobs_leave_nan_and_mismatched_ones_are_refused() -> None:
    tokens = common_pb2.TokenTrace(prompt_token_ids=[1], completion_token_ids=[5, 6])
    [seq] = sequences_of(trajectory(agent_pb.ModelCallRecord(step=0, tokens=tokens)))
    assert seq.trained == (False, True, True)
    assert all(math.isnan(x) for x in seq.old_logprobs)
    with pytest.raises(BadTrajectory, match="1 logprobs for 2 completion tokens"):
        sequences_of(trajectory(call(0, [1], [5, 6], [-0.1])))
    with pytest.raises(BadTrajectory, match="no prompt"):
        sequences_of(trajectory(call(0, [], [5])))


def test_lag_counts_versions_behind_the_trainer() -> None:
    calls = call(0, [1], [2], version="grpo:3"), call(1, [1, 2], [3], version="grpo:4")
    sample = sample_of("e", "g", trajectory(*calls))
    assert sample.versions == ("grpo:3", "grpo:4")
    assert lag(sample, 4, "grpo") == 1
    assert version_number("grpo:12", "grpo") == 12
    assert version_number("tiny:0", "grpo") is None
    assert version_number("grpo:x", "grpo") is None
    assert lag(sample_of("e", "g", trajectory(call(0, [1], [2], version="tiny:0"))), 4, "grpo") == 0


# -- episode ids and seeds -------------------------------------------------------------------


def test_group_members_have_their_own_ids_and_seeds() -> None:
    task = common_pb2.Task(task_id="0")
    members = [GroupMember(3, task, "abc-i2", member=m) for m in range(4)]
    assert [m.episode_id(0) for m in members] == [f"abc-i2-t3-r{m}" for m in range(4)]
    seeds = {sampling_seed(0, 2, 3, m) for m in range(8)}
    assert len(seeds) == 8
    assert sampling_seed(0, 2, 3, 1) == sampling_seed(0, 2, 3, 1)  # a restarted episode draws alike


# -- the data cursor -------------------------------------------------------------------------


def test_the_cursor_walks_seeded_epochs_and_resumes_where_it_stopped() -> None:
    cursor = DataCursor(5, seed=7)
    first = cursor.take(3) + cursor.take(3)  # crosses into epoch 1
    assert sorted(first[:5]) == [0, 1, 2, 3, 4]  # every task once per epoch
    assert (cursor.epoch, cursor.position) == (1, 1)
    saved = json.loads(json.dumps(cursor.to_json()))
    later = cursor.take(7)
    again = DataCursor.from_json(saved)
    assert again.take(7) == later
    assert DataCursor(5, seed=7).order(0) == cursor.order(0)
    assert DataCursor(5, seed=8).order(0) != cursor.order(0) or DataCursor(5, seed=8).order(1) != cursor.order(1)


def test_the_cursor_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="at least one task"):
        DataCursor(0)
    with pytest.raises(ValueError, match="outside"):
        DataCursor(3, position=4)
    with pytest.raises(ValueError, match="at least one"):
        DataCursor(3).take(0)


# -- the trainer's state ---------------------------------------------------------------------


def finished(episode_id: str, reward: float = 1.0, attempt: int = 0) -> Finished:
    return Finished(episode_id, 1, 0, attempt, trajectory(call(0, [1, 2], [3, 4]), reward=reward))


def state_with_batch() -> TrainerState:
    cursor = DataCursor(5, seed=1)
    batch = Batch(4, cursor.take(2), 3)
    batch.add(finished("r-i4-t1-r0"))
    batch.add(finished("r-i4-t1-r1", reward=0.0, attempt=1))
    return TrainerState(
        run_id="r",
        iteration=4,
        weight_version="grpo:4",
        updates=5,
        cursor=cursor,
        batch=batch,
        metrics=[{"iteration": 3, "reward": 0.5}],
        batches=[{"iteration": 3, "episodes": []}],
        config={"group_size": 3},
    )


def test_state_round_trips_through_a_checkpoint_folder(tmp_path: Path) -> None:
    state = state_with_batch()
    saved_policy: list[Path] = []

    def save_policy(folder: Path) -> None:
        saved_policy.append(folder)
        (folder / "optimizer.pt").write_bytes(b"moments")

    folder = write_state(tmp_path, state, save_policy)
    assert folder == tmp_path / TRAINER_DIR
    assert (folder / "optimizer.pt").read_bytes() == b"moments"
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # the temporary name is gone
    loaded = read_state(folder)
    assert loaded.to_json() == state.to_json()
    assert loaded.batch is not None
    assert state.batch is not None
    assert sorted(loaded.batch.finished) == sorted(state.batch.finished)
    again = loaded.batch.finished["r-i4-t1-r1"]
    assert (again.attempt, again.trajectory.reward) == (1, 0.0)
    assert list(again.trajectory.model_calls[0].tokens.completion_token_ids) == [3, 4]


def test_an_episode_is_never_counted_twice_in_a_batch() -> None:
    batch = Batch(0, [0, 1], 2)
    batch.add(finished("x-i0-t0-r0"))
    with pytest.raises(StateError, match="finished twice"):
        batch.add(finished("x-i0-t0-r0", attempt=1))
    assert len(batch.finished) == 1
    assert not batch.complete
    batch.failed["x-i0-t0-r1"] = "UNAVAILABLE"
    batch.add(finished("x-i0-t1-r0"))
    batch.add(finished("x-i0-t1-r1"))
    assert batch.complete


def test_a_torn_changed_or_foreign_state_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StateError, match="missing"):
        read_state(tmp_path)
    folder = write_state(tmp_path, state_with_batch(), lambda folder: (folder / "optimizer.pt").write_bytes(b"m"))
    (folder / "optimizer.pt").write_bytes(b"changed after the checkpoint")
    with pytest.raises(StateError, match=r"differ from its MANIFEST: \['optimizer.pt'\]"):
        read_state(folder)
    folder = write_state(tmp_path, state_with_batch(), lambda folder: None)
    path = folder / STATE_FILE
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "schema": 99}))
    with pytest.raises(StateError, match="MANIFEST"):  # any edit shows
        read_state(folder)


def test_a_call_that_straddled_an_update_counts_from_its_oldest_span() -> None:
    straddling = call(0, [1], [2, 3, 4], version="grpo:5")
    straddling.weight_versions.add(weight_version="grpo:4", first_token=0, last_token=1)
    straddling.weight_versions.add(weight_version="grpo:5", first_token=2, last_token=2)
    sample = sample_of("e", "g", trajectory(straddling))
    assert sample.versions == ("grpo:4", "grpo:5")
    assert lag(sample, 5, "grpo") == 1
