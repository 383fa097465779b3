"""Card rules and texts of the blackjack game, kept identical to NeMo Gym's `resources_servers/blackjack`."""

from __future__ import annotations

import random
from collections.abc import Sequence

RANKS = ("2", "3", "4", "5", "6", "7", "8", "9", "10", "J", "Q", "K", "A")
DEALER_STANDS_AT = 17


def deal(rng: random.Random) -> str:
    """One card from an infinite deck: `rng.choice` over the 13 ranks, as the reference draws."""
    return rng.choice(RANKS)


def hand_value(hand: Sequence[str]) -> int:
    """Best total: every ace counts 11 until the hand would bust, then 1, one ace at a time."""
    total = sum(10 if rank in ("J", "Q", "K") else 11 if rank == "A" else int(rank) for rank in hand)
    aces = hand.count("A")
    while total > 21 and aces:
        total -= 10
        aces -= 1
    return total


def fmt(hand: Sequence[str]) -> str:
    return "[" + ", ".join(hand) + "]"


def observation(player: Sequence[str], dealer: Sequence[str]) -> str:
    """The reference's prompt text, byte for byte, so recorded rollouts stay comparable."""
    return (
        f"Your hand: {fmt(player)} = {hand_value(player)}\n"
        f"Dealer shows: {dealer[0]}\n"
        "Respond with <action>hit</action> or <action>stand</action>."
    )


def play_dealer(dealer: list[str], rng: random.Random) -> None:
    """The dealer hits below 17 (and so stands on a soft 17)."""
    while hand_value(dealer) < DEALER_STANDS_AT:
        dealer.append(deal(rng))


def outcome(player: Sequence[str], dealer: Sequence[str]) -> tuple[float, str]:
    """Reward and result label of a finished hand: +1 win, 0 draw, -1 loss or bust."""
    pv, dv = hand_value(player), hand_value(dealer)
    if pv > 21:
        return -1.0, "bust"
    if dv > 21 or pv > dv:
        return 1.0, "win"
    if pv == dv:
        return 0.0, "draw"
    return -1.0, "loss"
