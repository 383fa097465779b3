"""Codec of blackjack session snapshots (format `gymrpc.blackjack` v1).

Payload: canonical JSON `{"dealer": [ranks], "finished": bool, "player": [ranks],
"rng_state": [3, [625 ints], gauss_next]}`; `rng_state` is `random.Random.getstate()`
as JSON, so a restored game draws exactly the cards the original would have drawn.
Decoding checks that the state could have arisen from play; it builds fresh objects
only, so a rejected payload changes nothing.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Any

from gymrpc.envkit import SnapshotCorrupt
from gymrpc.envs.blackjack._rules import DEALER_STANDS_AT, RANKS, hand_value

_KEYS = frozenset({"player", "dealer", "finished", "rng_state"})
_RNG_VERSION = 3  # CPython's Mersenne Twister state format since Python 3.2
_MT_WORDS = 624


@dataclass
class GameState:
    player: list[str]
    dealer: list[str]
    finished: bool
    rng: random.Random


def encode(state: GameState) -> bytes:
    version, internal, gauss_next = state.rng.getstate()
    doc = {
        "player": state.player,
        "dealer": state.dealer,
        "finished": state.finished,
        "rng_state": [version, list(internal), gauss_next],
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def decode(payload: bytes) -> GameState:
    doc = _parse(payload)
    if not isinstance(doc, dict) or set(doc) != _KEYS:
        raise SnapshotCorrupt(f"blackjack snapshot must be an object with keys {sorted(_KEYS)}")
    player = _hand(doc["player"], "player")
    dealer = _hand(doc["dealer"], "dealer")
    finished = doc["finished"]
    if not isinstance(finished, bool):
        raise SnapshotCorrupt("blackjack snapshot: 'finished' must be a boolean")
    _check_play(player, dealer, finished)
    return GameState(player, dealer, finished, _rng(doc["rng_state"]))


def _parse(payload: bytes) -> Any:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        if len({key for key, _ in pairs}) != len(pairs):
            raise SnapshotCorrupt("blackjack snapshot has duplicate keys")
        return dict(pairs)

    def no_constant(name: str) -> Any:
        raise SnapshotCorrupt(f"blackjack snapshot contains {name}")

    if not isinstance(payload, bytes | bytearray | memoryview):
        raise SnapshotCorrupt(f"blackjack snapshot must be bytes, got {type(payload).__name__}")
    try:
        return json.loads(bytes(payload), object_pairs_hook=no_duplicates, parse_constant=no_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, int too long
        raise SnapshotCorrupt(f"blackjack snapshot is not valid JSON: {exc}") from exc


def _hand(value: Any, who: str) -> list[str]:
    if not isinstance(value, list) or len(value) < 2:
        raise SnapshotCorrupt(f"blackjack snapshot: {who!r} must be a list of at least two ranks")
    for rank in value:
        if rank not in RANKS:  # equality against strings, so ints and lists fail too
            raise SnapshotCorrupt(f"blackjack snapshot: {who!r} holds {rank!r}, not one of {list(RANKS)}")
    return list(value)


def _check_play(player: list[str], dealer: list[str], finished: bool) -> None:
    """Reject hands the rules cannot produce, which would otherwise surface as odd rewards later."""
    if any(hand_value(player[:k]) > 21 for k in range(2, len(player))):
        raise SnapshotCorrupt("blackjack snapshot: the player drew after busting")
    busted = hand_value(player) > 21
    if not finished and busted:
        raise SnapshotCorrupt("blackjack snapshot: a busted hand must be finished")
    if not finished or busted:
        if len(dealer) != 2:
            raise SnapshotCorrupt("blackjack snapshot: the dealer drew before the player stood")
        return
    if any(hand_value(dealer[:k]) >= DEALER_STANDS_AT for k in range(2, len(dealer))):
        raise SnapshotCorrupt("blackjack snapshot: the dealer drew at 17 or more")
    if hand_value(dealer) < DEALER_STANDS_AT:
        raise SnapshotCorrupt("blackjack snapshot: the dealer stopped below 17")


def _rng(value: Any) -> random.Random:
    if not isinstance(value, list) or len(value) != 3:
        raise SnapshotCorrupt("blackjack snapshot: 'rng_state' must be [version, state, gauss_next]")
    version, internal, gauss_next = value
    if not _is_int(version) or version != _RNG_VERSION:
        raise SnapshotCorrupt(f"blackjack snapshot: rng state version must be {_RNG_VERSION}")
    if (
        not isinstance(internal, list)
        or len(internal) != _MT_WORDS + 1
        or not all(_is_int(word) and 0 <= word < 2**32 for word in internal[:_MT_WORDS])
        or not _is_int(internal[-1])
        or not 0 <= internal[-1] <= _MT_WORDS
    ):
        raise SnapshotCorrupt(
            f"blackjack snapshot: rng state must be {_MT_WORDS} 32-bit words and a position in 0..{_MT_WORDS}"
        )
    if not any(internal[:_MT_WORDS]):
        raise SnapshotCorrupt("blackjack snapshot: rng state is all zeros, which no seeding produces")
    if gauss_next is not None and (not isinstance(gauss_next, float) or not math.isfinite(gauss_next)):
        raise SnapshotCorrupt("blackjack snapshot: rng gauss_next must be null or a finite number")
    rng = random.Random()
    try:
        rng.setstate((version, tuple(internal), gauss_next))
    except (TypeError, ValueError, OverflowError) as exc:
        raise SnapshotCorrupt(f"blackjack snapshot: rng state rejected: {exc}") from exc
    return rng


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
