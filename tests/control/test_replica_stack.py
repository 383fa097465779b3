"""Replicated participants under `gymrpc up` (local launcher): checkpoint, SIGKILL all, restore onto other counts.

Agents 2 -> 1, resources 2 -> 3, model 1 -> 2: every record of the checkpoint lands on exactly one
new replica, the one session affinity routes the episode's calls to, and every continued episode
ends as an uninterrupted one (`tests/control/replica_stack.py`; the same runs on Ray in `tests/ray`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.control import replica_stack


def test_a_checkpoint_of_replicas_restores_onto_other_replica_counts(start_stack: Any, run_dir: Path) -> None:
    replica_stack.run_scenario(
        start_stack,
        run_dir,
        before={"agent/simple": 2, "resources/counter": 2, "model/policy": 1},
        after={"agent/simple": 1, "resources/counter": 3, "model/policy": 2},
    )
