"""Blackjack as a text-turn environment, after NeMo Gym's `resources_servers/blackjack`.

Deck model: an infinite deck (cards drawn with replacement), each card a uniform
`rng.choice` over the 13 ranks, like Gymnasium's Blackjack-v1 and the reference. So
the whole future of a game is fixed by its `random.Random` state, which the snapshot
carries: a restored game deals exactly what an uninterrupted one would.

`seed` deals player, player, dealer, dealer (the reference's order) and returns the
first observation; each `step` parses `<action>hit|stand</action>` (stand when
absent, as the reference). A hit shows the new hand unless it busts; a stand plays
the dealer out (hits below 17). Terminal steps return no observation, as in the
recorded rollouts. No natural-blackjack bonus: `[A, K]` must still stand to win.
The task field `seed` (int) makes a game reproducible; without it, each session
draws fresh OS entropy.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from gymrpc.envkit import (
    CheckpointMode,
    Environment,
    InteractionStyle,
    InvalidTask,
    Session,
    SnapshotFormat,
    StepResult,
    TaskSpec,
    ToolError,
    ToolResult,
    ToolSpec,
    VerifyResult,
)
from gymrpc.envs.blackjack import _rules, _snapshot
from gymrpc.envs.blackjack._snapshot import GameState

_ACTION = re.compile(r"<action>\s*(hit|stand)\s*</action>", re.IGNORECASE)


def parse_action(text: str) -> str:
    """The first action tag in the text, lower-cased; "stand" when there is none, as the reference."""
    match = _ACTION.search(text)
    return match.group(1).lower() if match else "stand"


class BlackjackSession(Session):
    """One hand against the dealer; `state.rng` is the session's own deck."""

    def __init__(self, state: GameState) -> None:
        self.state = state

    def call_tool(self, name: str, arguments: Mapping[str, Any]) -> ToolResult:
        raise ToolError(f"blackjack has no tools (called {name!r}); answer with an <action> tag")

    def step(self, text: str) -> StepResult:
        s = self.state
        if s.finished:
            raise ToolError("the hand is over; no further actions are accepted")
        if parse_action(text) == "hit":
            s.player.append(_rules.deal(s.rng))
            if _rules.hand_value(s.player) <= 21:
                return StepResult([_rules.observation(s.player, s.dealer)])
        else:
            _rules.play_dealer(s.dealer, s.rng)
        s.finished = True
        return StepResult([], terminated=True)

    def verify(self, messages: Sequence[Mapping[str, Any]]) -> VerifyResult:
        s = self.state
        # An unfinished hand (the agent ran out of turns) earns what the reference's step rewards sum to: 0.
        reward, result = _rules.outcome(s.player, s.dealer) if s.finished else (0.0, "unfinished")
        return VerifyResult(
            reward=reward,
            details={
                "result": result,
                "player": list(s.player),
                "player_value": _rules.hand_value(s.player),
                "dealer": list(s.dealer),
                "dealer_value": _rules.hand_value(s.dealer),
            },
        )

    def export(self) -> bytes:
        return _snapshot.encode(self.state)


class BlackjackEnvironment(Environment):
    """Text-turn blackjack whose snapshots include the RNG state (docs/design.md §8)."""

    name = "blackjack"
    checkpoint_mode = CheckpointMode.EXPORTED
    interaction_style = InteractionStyle.TEXT_TURNS
    snapshot_format = SnapshotFormat("gymrpc.blackjack", 1, "application/json")
    runs_inline = True  # a few list operations per call: no thread hop needed

    def tools(self) -> Sequence[ToolSpec]:
        return ()

    def seed(self, task: TaskSpec) -> tuple[BlackjackSession, Sequence[str]]:
        seed = task.fields.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise InvalidTask(f"blackjack task {task.task_id!r}: 'seed' must be an integer, got {seed!r}")
        rng = random.Random(seed)  # None seeds from OS entropy
        player = [_rules.deal(rng), _rules.deal(rng)]
        dealer = [_rules.deal(rng), _rules.deal(rng)]
        state = GameState(player, dealer, finished=False, rng=rng)
        return BlackjackSession(state), [_rules.observation(player, dealer)]

    def restore(self, payload: bytes) -> BlackjackSession:
        return BlackjackSession(_snapshot.decode(payload))
