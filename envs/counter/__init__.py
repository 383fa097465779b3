"""The counter environment (docs/design.md §8): `increment_counter`, `get_counter_value`, reward on the final count."""

from __future__ import annotations

from pathlib import Path

from gymrpc.envs.counter.environment import CounterEnvironment, CounterSession

__all__ = ["CounterEnvironment", "CounterSession", "example_tasks_path"]


def example_tasks_path() -> Path:
    """The bundled NeMo Gym example tasks, so tests and demos never reach outside the package."""
    return Path(__file__).parent / "data" / "example.jsonl"
