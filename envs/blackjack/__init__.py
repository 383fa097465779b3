"""The blackjack environment (docs/design.md §8): text turns, snapshots that carry the RNG state."""

from __future__ import annotations

from pathlib import Path

from gymrpc.envs.blackjack.environment import BlackjackEnvironment, BlackjackSession, parse_action

__all__ = ["BlackjackEnvironment", "BlackjackSession", "example_tasks_path", "parse_action"]


def example_tasks_path() -> Path:
    """The bundled NeMo Gym example tasks, so tests and demos never reach outside the package."""
    return Path(__file__).parent / "data" / "example.jsonl"
