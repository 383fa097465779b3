"""The blackjack environment: rules, reference texts, recorded rollouts, and RNG-exact restore."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest

from gymrpc.envkit import (
    CheckpointMode,
    InteractionStyle,
    InvalidTask,
    SnapshotCorrupt,
    SnapshotFormat,
    TaskSpec,
    ToolError,
    task_from_row,
)
from gymrpc.envs.blackjack import BlackjackEnvironment, BlackjackSession, example_tasks_path, parse_action
from gymrpc.envs.blackjack._rules import RANKS, hand_value, observation, outcome, play_dealer
from gymrpc.envs.blackjack._snapshot import GameState

OBSERVATION = re.compile(
    r"Your hand: \[(?P<hand>[^\]]+)\] = (?P<value>\d+)\n"
    r"Dealer shows: (?P<up>\w+)\n"
    r"Respond with <action>hit</action> or <action>stand</action>\.\Z"
)


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


TASK_ROWS = _rows(example_tasks_path())
ROLLOUT_ROWS = _rows(example_tasks_path().with_name("example_rollouts.jsonl"))


def _task(**fields: Any) -> TaskSpec:
    return TaskSpec(task_id="t", input=[{"role": "user", "content": "Deal me in."}], fields=fields)


def _ranks(text: str) -> list[str]:
    return text.strip("[]").split(", ")


class _ScriptedDeck(random.Random):
    """Deals given ranks in order, to replay a recorded game card for card."""

    def __init__(self, cards: list[str]) -> None:
        super().__init__(0)
        self.cards = list(cards)

    def choice(self, seq: Any) -> Any:
        return self.cards.pop(0)


def test_declares_text_turns_exported_checkpoints_and_no_tools() -> None:
    env = BlackjackEnvironment()
    assert env.name == "blackjack"
    assert env.interaction_style is InteractionStyle.TEXT_TURNS
    assert env.checkpoint_mode is CheckpointMode.EXPORTED
    assert env.snapshot_format == SnapshotFormat("gymrpc.blackjack", 1, "application/json")
    assert list(env.tools()) == []


@pytest.mark.parametrize("index", range(5))
def test_every_example_task_deals_a_hand_and_plays_to_the_end(index: int) -> None:
    row = TASK_ROWS[index]
    session, opening = BlackjackEnvironment().seed(task_from_row(row, str(index)))
    (text,) = opening
    match = OBSERVATION.match(text)
    assert match, text
    assert hand_value(_ranks(match["hand"])) == int(match["value"])
    assert session.step("I'll stand. <action>stand</action>").terminated
    result = session.verify([])
    assert result.reward in (-1.0, 0.0, 1.0)
    assert result.details["result"] in ("win", "draw", "loss")
    assert result.details["dealer_value"] >= 17


@pytest.mark.parametrize("rollout", ROLLOUT_ROWS, ids=lambda r: str(r["_ng_rollout_index"]))
def test_recorded_rollouts_replay_with_identical_texts_and_rewards(rollout: dict[str, Any]) -> None:
    """Rebuild each recorded game from its cards; our texts, termination and reward must match."""
    opening = rollout["responses_create_params"]["input"][-1]["content"]
    match = OBSERVATION.match(opening)
    assert match
    info = rollout["info"]
    player_final = _ranks(info["player"])
    # A busted player never sees the dealer's hole card; any card stands in for it.
    dealer_final = _ranks(info["dealer"]) if "dealer" in info else [match["up"], "2"]
    player = _ranks(match["hand"])
    deck = _ScriptedDeck(player_final[len(player) :] + dealer_final[2:])
    session = BlackjackSession(GameState(player, dealer_final[:2], finished=False, rng=deck))
    assert observation(player, dealer_final[:2]) == opening

    items = rollout["response"]["output"]
    for i, item in enumerate(items):
        if item.get("role") != "assistant":
            continue
        step = session.step("".join(part["text"] for part in item["content"]))
        following = items[i + 1]["content"] if i + 1 < len(items) else None
        if step.terminated:
            assert following is None, "the reference shows no text after the final action"
            assert list(step.observations) == []
        else:
            assert list(step.observations) == [following]
    assert step.terminated is rollout["terminated"] is True
    assert deck.cards == [], "every recorded card was dealt"

    result = session.verify([])
    assert result.reward == rollout["reward"]
    assert result.details["result"] == info["result"]
    assert result.details["player"] == player_final
    assert result.details["player_value"] == info.get("player_value", info.get("value"))
    if "dealer" in info:
        assert result.details["dealer"] == dealer_final
        assert result.details["dealer_value"] == info["dealer_value"]


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("<action>hit</action>", "hit"),
        ("think... <ACTION> Stand </ACTION>", "stand"),
        ("<action>hit</action> or maybe <action>stand</action>", "hit"),
        ("I hit", "stand"),
        ("<action>double</action>", "stand"),
        ("", "stand"),
    ],
)
def test_parse_action_takes_the_first_tag_and_defaults_to_stand(text: str, action: str) -> None:
    assert parse_action(text) == action


@pytest.mark.parametrize(
    ("hand", "value"),
    [
        (["A", "K"], 21),
        (["A", "A"], 12),
        (["A", "A", "K"], 12),
        (["A", "5", "K"], 16),
        (["K", "Q", "2"], 22),
        (["10", "J"], 20),
        (["A"] * 11, 21),
    ],
)
def test_hand_value_counts_aces_as_eleven_or_one(hand: list[str], value: int) -> None:
    assert hand_value(hand) == value


@pytest.mark.parametrize(
    ("player", "dealer", "expected"),
    [
        (["K", "Q"], ["K", "7"], (1.0, "win")),
        (["K", "7"], ["K", "Q", "5"], (1.0, "win")),
        (["K", "7"], ["10", "7"], (0.0, "draw")),
        (["K", "7"], ["10", "8"], (-1.0, "loss")),
        (["K", "7", "5"], ["10", "6"], (-1.0, "bust")),
    ],
)
def test_outcome(player: list[str], dealer: list[str], expected: tuple[float, str]) -> None:
    assert outcome(player, dealer) == expected


def test_dealer_hits_below_seventeen_and_stands_on_soft_seventeen() -> None:
    soft = ["A", "6"]
    play_dealer(soft, _ScriptedDeck([]))
    assert soft == ["A", "6"]
    low = ["10", "6"]
    play_dealer(low, _ScriptedDeck(["A", "K"]))
    assert low == ["10", "6", "A"]


def test_hitting_to_a_bust_ends_the_hand_with_reward_minus_one() -> None:
    deck = _ScriptedDeck(["5", "K"])
    session = BlackjackSession(GameState(["10", "6"], ["9", "7"], finished=False, rng=deck))
    first = session.step("<action>hit</action>")
    assert not first.terminated
    assert list(first.observations) == [observation(["10", "6", "5"], ["9", "7"])]
    assert session.step("<action>hit</action>").terminated
    result = session.verify([])
    assert result.reward == -1.0
    assert result.details == {
        "result": "bust",
        "player": ["10", "6", "5", "K"],
        "player_value": 31,
        "dealer": ["9", "7"],
        "dealer_value": 16,
    }
    with pytest.raises(ToolError, match="hand is over"):
        session.step("<action>hit</action>")


def test_an_unfinished_hand_earns_zero() -> None:
    session, _ = BlackjackEnvironment().seed(_task(seed=1))
    result = session.verify([])
    assert result.reward == 0.0
    assert result.details["result"] == "unfinished"


def test_tool_calls_are_rejected() -> None:
    session, _ = BlackjackEnvironment().seed(_task())
    with pytest.raises(ToolError, match="no tools"):
        session.call_tool("hit", {})


def test_the_seed_field_makes_games_reproducible() -> None:
    env = BlackjackEnvironment()
    openings = {seed: env.seed(_task(seed=seed))[1][0] for seed in range(40)}
    assert openings == {seed: env.seed(_task(seed=seed))[1][0] for seed in range(40)}
    assert len(set(openings.values())) > 20, "different seeds must deal different games"
    # Same deal order as the reference (player, player, dealer, dealer via rng.choice).
    rng = random.Random(7)
    cards = [rng.choice(RANKS) for _ in range(4)]
    assert env.seed(_task(seed=7))[1][0] == observation(cards[:2], cards[2:])


def test_without_a_seed_field_sessions_draw_fresh_entropy() -> None:
    env = BlackjackEnvironment()
    states = {env.seed(_task())[0].export() for _ in range(5)}
    assert len(states) == 5


@pytest.mark.parametrize("seed", ["1", 1.5, True, [1]])
def test_a_non_integer_seed_is_an_invalid_task(seed: Any) -> None:
    with pytest.raises(InvalidTask, match="'seed' must be an integer"):
        BlackjackEnvironment().seed(_task(seed=seed))


def _policy(seed: int, turn: int) -> str:
    """A varied but deterministic player: some games hit often, some stand at once."""
    return "<action>hit</action>" if (seed + turn) % 4 != 0 else "<action>stand</action>"


def _play(session: Any, seed: int, start: int, limit: int | None = None) -> tuple[list[Any], int]:
    trace, turn = [], start
    while limit is None or turn < limit:
        step = session.step(_policy(seed, turn))
        trace.append((list(step.observations), step.terminated))
        turn += 1
        if step.terminated:
            break
    return trace, turn


@pytest.mark.parametrize("seed", range(150))
def test_restore_after_any_step_deals_exactly_the_uninterrupted_cards(seed: int) -> None:
    env = BlackjackEnvironment()
    reference, _ = env.seed(_task(seed=seed))
    full_trace, turns = _play(reference, seed, 0)
    full_verify = reference.verify([])
    full_final = reference.export()

    for k in range(turns + 1):
        session, _ = env.seed(_task(seed=seed))
        head, turn = _play(session, seed, 0, limit=k)
        restored = BlackjackEnvironment().restore(session.export())
        tail, _ = _play(restored, seed, turn) if not head or not head[-1][1] else ([], turn)
        assert head + tail == full_trace
        assert restored.verify([]) == full_verify
        assert restored.export() == full_final, "the RNG must end in the same state too"


def test_snapshot_is_canonical_json_with_the_full_rng_state() -> None:
    session, _ = BlackjackEnvironment().seed(_task(seed=3))
    payload = session.export()
    doc = json.loads(payload)
    assert list(doc) == ["dealer", "finished", "player", "rng_state"]
    assert payload == json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    version, internal, gauss_next = doc["rng_state"]
    assert (version, len(internal), gauss_next) == (3, 625, None)
    assert BlackjackEnvironment().restore(payload).export() == payload


def test_gauss_next_survives_a_round_trip() -> None:
    session, _ = BlackjackEnvironment().seed(_task(seed=3))
    session.state.rng.gauss(0.0, 1.0)  # leaves a cached second normal deviate in the state
    payload = session.export()
    assert isinstance(json.loads(payload)["rng_state"][2], float)
    restored = BlackjackEnvironment().restore(payload)
    assert restored.state.rng.getstate() == session.state.rng.getstate()


def test_restored_sessions_do_not_share_state() -> None:
    session, _ = BlackjackEnvironment().seed(_task(seed=5))
    payload = session.export()
    env = BlackjackEnvironment()
    one, two = env.restore(payload), env.restore(payload)
    one.step("<action>stand</action>")
    assert two.export() == payload
    assert session.export() == payload


def _valid_doc() -> dict[str, Any]:
    session, _ = BlackjackEnvironment().seed(_task(seed=11))
    return json.loads(session.export())


def _with(**changes: Any) -> bytes:
    doc = _valid_doc()
    doc.update(changes)
    return json.dumps(doc).encode()


def _rng_with(index: int, value: Any) -> bytes:
    doc = _valid_doc()
    doc["rng_state"][index] = value
    return json.dumps(doc).encode()


def _word(index: int, value: Any) -> bytes:
    doc = _valid_doc()
    doc["rng_state"][1][index] = value
    return json.dumps(doc).encode()


CORRUPT = {
    "empty": b"",
    "not json": b"{nope",
    "not utf-8": b"\xff\xfe\xfd",
    "array": b"[]",
    "missing key": json.dumps({k: v for k, v in _valid_doc().items() if k != "finished"}).encode(),
    "extra key": _with(score=1),
    "rank 1": _with(player=["1", "K"]),
    "rank 11": _with(player=["11", "K"]),
    "int rank": _with(dealer=[10, "K"]),
    "lower-case rank": _with(dealer=["k", "2"]),
    "one card": _with(player=["K"]),
    "hand not a list": _with(player="K, 2"),
    "finished not bool": _with(finished=0),
    "bust but unfinished": _with(player=["K", "Q", "5"], dealer=["2", "3"], finished=False),
    "drew after bust": _with(player=["K", "Q", "5", "2"], dealer=["2", "3"], finished=True),
    "dealer drew early": _with(player=["K", "2"], dealer=["2", "3", "4"], finished=False),
    "dealer drew on bust": _with(player=["K", "Q", "5"], dealer=["2", "3", "4"], finished=True),
    "dealer stopped low": _with(player=["K", "2"], dealer=["2", "3"], finished=True),
    "dealer drew at 17": _with(player=["K", "2"], dealer=["10", "7", "2"], finished=True),
    "rng not a list": _with(rng_state={"version": 3}),
    "rng too short": _with(rng_state=[3, []]),
    "rng version 2": _rng_with(0, 2),
    "rng version bool": _rng_with(0, True),
    "rng words short": _rng_with(1, list(range(1, 625))),
    "rng gauss str": _rng_with(2, "0.5"),
    "rng gauss int": _rng_with(2, 1),
    "rng word too big": _word(5, 2**32),
    "rng word negative": _word(5, -1),
    "rng word bool": _word(5, True),
    "rng word float": _word(5, 1.0),
    "rng position 625": _word(624, 625),
    "rng all zeros": _rng_with(1, [0] * 624 + [624]),
    "duplicate keys": b'{"finished":false,"finished":true}',
    "NaN": _rng_with(2, float("nan")),
    "str payload": "{}",
}


@pytest.mark.parametrize("payload", CORRUPT.values(), ids=CORRUPT.keys())
def test_corrupt_snapshots_raise_snapshot_corrupt(payload: Any) -> None:
    with pytest.raises(SnapshotCorrupt):
        BlackjackEnvironment().restore(payload)


def test_the_valid_base_of_the_corrupt_cases_restores() -> None:
    """Guards the table above: each case must fail for its own change, not for a broken base."""
    assert BlackjackEnvironment().restore(json.dumps(_valid_doc()).encode())
    finished = _with(player=["K", "Q"], dealer=["10", "7"], finished=True)
    assert BlackjackEnvironment().restore(finished).verify([]).reward == 1.0
