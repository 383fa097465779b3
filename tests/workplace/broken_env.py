"""Deliberately broken Workplace environments.

`NanLosingWorkplaceEnvironment`: its restore turns every NaN into None. This is the bug the
reference's JSON round trip once had. The crash-equivalence test runs a resources server with
this plug-in (`--environment tests.workplace.broken_env:NanLosingWorkplaceEnvironment`) to
prove that its checks notice such a codec.

`FailingVerifyWorkplaceEnvironment`: the reward function of tasks named `fail-*` raises, so
tests can see what a checkpoint does with a session whose verify failed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from gymrpc.envkit import TaskSpec, VerifyResult
from gymrpc.envs.workplace_assistant import WorkplaceEnvironment, WorkplaceSession
from gymrpc.snapshots import SessionTables


def lose_nan(frame: pd.DataFrame) -> pd.DataFrame:
    """NaN in object columns becomes None, as a lossy codec would leave it."""
    out = frame.copy()
    for position in range(out.shape[1]):
        if out.dtypes.iloc[position].kind == "O":
            values = [None if isinstance(v, float) and v != v else v for v in out.iloc[:, position]]
            out.isetitem(position, pd.Series(values, index=out.index, dtype=object))
    return out


class NanLosingWorkplaceEnvironment(WorkplaceEnvironment):
    def build_session(self, exported: SessionTables, tables: dict[str, pd.DataFrame]) -> WorkplaceSession:
        return super().build_session(exported, {name: lose_nan(frame) for name, frame in tables.items()})


class FailingVerifySession(WorkplaceSession):
    def verify(self, messages: Sequence[Mapping[str, Any]]) -> VerifyResult:
        raise RuntimeError("the reward function crashed")


class FailingVerifyWorkplaceEnvironment(WorkplaceEnvironment):
    def seed(self, task: TaskSpec) -> tuple[WorkplaceSession, Sequence[str]]:
        session, observations = super().seed(task)
        if task.task_id.startswith("fail-"):
            session = FailingVerifySession(session.tables, session.task_id, session.ground_truth, session.verify_mode)
        return session, observations
