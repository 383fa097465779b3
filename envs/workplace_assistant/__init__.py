"""The Workplace Assistant environment (docs/design.md §8): 27 tools over per-session pandas tables, Arrow snapshots."""

from __future__ import annotations

from pathlib import Path

from gymrpc.envs.workplace_assistant.environment import (
    LiveVerifyWorkplaceEnvironment,
    WorkplaceEnvironment,
    WorkplaceSession,
)

__all__ = [
    "LiveVerifyWorkplaceEnvironment",
    "WorkplaceEnvironment",
    "WorkplaceSession",
    "example_rollouts_path",
    "example_tasks_path",
    "rollout_tasks_path",
]

_DATA = Path(__file__).parent / "data"


def example_tasks_path() -> Path:
    """The five NeMo Gym example tasks with their ground truth."""
    return _DATA / "example.jsonl"


def example_rollouts_path() -> Path:
    """The five recorded real-model rollouts (of other tasks) with their rewards."""
    return _DATA / "example_rollouts.jsonl"


def rollout_tasks_path() -> Path:
    """The recorded rollouts' tasks as task rows, with ground truth reconstructed by gymrpc (see NOTICE.md)."""
    return _DATA / "rollout_tasks.jsonl"
