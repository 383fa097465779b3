"""Retired attempts: `rollout_id -> highest fenced attempt`, checked on every data-plane call.

A mark is set by a retire (before its work stops, and kept even if the retire fails) and
by a restore (the checkpointed attempt N is superseded by N+1). Marks outlive the retire
until `forget`, because a request a caller sent just before its own retire can reach a
callee after the callee's retire finished.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gymrpc.control.types import EpisodeKey
from gymrpc.errors import FailedPrecondition


class RetiredAttempts:
    def __init__(self) -> None:
        self._marks: dict[str, int] = {}

    def mark(self, episodes: Iterable[EpisodeKey]) -> None:
        """Fence every attempt up to each episode's (marks only grow)."""
        for rollout_id, attempt in episodes:
            if self._marks.get(rollout_id, -1) < attempt:
                self._marks[rollout_id] = attempt

    def forget(self, rollout_ids: Iterable[str]) -> list[str]:
        """Drop the marks; returns the ids that had one."""
        return [r for r in rollout_ids if self._marks.pop(r, None) is not None]

    def is_retired(self, episode: EpisodeKey) -> bool:
        mark = self._marks.get(episode.rollout_id)
        return mark is not None and episode.attempt <= mark

    def check(self, episode: EpisodeKey) -> None:
        """Refuse a call of a fenced attempt (FAILED_PRECONDITION `STALE_ATTEMPT`)."""
        mark = self._marks.get(episode.rollout_id)
        if mark is not None and episode.attempt <= mark:
            raise FailedPrecondition(
                f"attempt {episode.attempt} of {episode.rollout_id!r} is retired or superseded "
                f"(every attempt up to {mark} is fenced)",
                reason="STALE_ATTEMPT",
                metadata={"rollout_id": episode.rollout_id, "attempt": str(episode.attempt)},
            )

    def snapshot(self) -> Mapping[str, int]:
        return dict(self._marks)

    def __len__(self) -> int:
        return len(self._marks)
