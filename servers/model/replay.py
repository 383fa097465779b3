"""Durable replay of model calls for any agent: the ordered responses an episode attempt was given.

An agent that crashed is run again from its start. Each of its runs sends a run id (a
fresh one per `Run`); the model role numbers that run's calls 0, 1, 2, ... and answers
call k from the record when the record has a k-th entry whose request equals this one
(no generation). The first call past the record goes live and is appended. A different
request at a recorded position is a divergence: refused with REPLAY_DIVERGENCE naming the
position and the first differing field, unless the run asked to go live (the record is
then cut at that position). Temporal's workflow replay works the same way.

A retry of the same request by the HTTP client (same run, same body as the run's previous
call) keeps that call's position, so client retries do not shift the numbering.

With a folder the record is one append-only JSONL file per episode attempt, each line
fsynced before the response leaves, so it survives a crash of the model server. Records
are freed when the attempt is retired or its rollout forgotten.
"""

from __future__ import annotations

import base64
import json
import os
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gymrpc.control import EpisodeKey
from gymrpc.errors import FailedPrecondition
from gymrpc.rundir import write_text_atomic
from gymrpc.v1 import model_service_pb2 as pb

MAX_EPISODES = 100_000
"""Episode attempts kept in memory (LRU); a durable record is read back from its file."""
MAX_RUNS = 100_000
"""Run cursors kept (LRU); an evicted run's next call would start at position 0 again."""
GO_LIVE = "go_live"
FAIL = "fail"


@dataclass
class Entry:
    """One delivered call: the request as compared on replay, and the response given."""

    request: dict[str, Any]
    response: pb.GenerateResponse


@dataclass
class _Cursor:
    next: int = 0
    last_request: dict[str, Any] | None = None
    last_position: int = -1


@dataclass(frozen=True)
class Position:
    """Where a call falls in its episode's record; `entry` is set when it is answered from the record."""

    index: int
    entry: Entry | None


def first_difference(recorded: Any, actual: Any, path: str = "") -> str | None:
    """The path of the first field where two requests differ (`messages[3].content`), or None."""
    if isinstance(recorded, dict) and isinstance(actual, dict):
        for key in sorted(set(recorded) | set(actual)):
            if key not in recorded or key not in actual:
                return f"{path}.{key}".lstrip(".")
            found = first_difference(recorded[key], actual[key], f"{path}.{key}")
            if found is not None:
                return found.lstrip(".")
        return None
    if isinstance(recorded, list) and isinstance(actual, list):
        for index, (a, b) in enumerate(zip(recorded, actual, strict=False)):
            found = first_difference(a, b, f"{path}[{index}]")
            if found is not None:
                return found
        if len(recorded) != len(actual):
            return f"{path}[{min(len(recorded), len(actual))}]".lstrip(".")
        return None
    return None if recorded == actual else (path.lstrip(".") or "request")


class ReplayRecord:
    """Records per episode attempt and cursors per agent run; `root` makes the records durable."""

    def __init__(self, root: Path | None = None, *, max_episodes: int = MAX_EPISODES) -> None:
        self.root = root
        if root is not None:
            root.mkdir(parents=True, exist_ok=True)
        self.max_episodes = max_episodes
        self._episodes: OrderedDict[EpisodeKey, list[Entry]] = OrderedDict()
        self._runs: OrderedDict[tuple[EpisodeKey, str], _Cursor] = OrderedDict()
        self.stats = {"replayed": 0, "recorded": 0, "diverged": 0}

    # -- the replay decision -------------------------------------------------------------------

    def position(self, episode: EpisodeKey, run_id: str, request: dict[str, Any], divergence: str = FAIL) -> Position:
        """The call's position in `episode` for run `run_id`; answered from the record when it matches."""
        cursor = self._runs.get((episode, run_id))
        if cursor is None:
            cursor = self._runs[(episode, run_id)] = _Cursor()
            while len(self._runs) > MAX_RUNS:
                self._runs.popitem(last=False)
        self._runs.move_to_end((episode, run_id))
        if cursor.last_request == request:
            index = cursor.last_position  # the HTTP client retried the same call
        else:
            index, cursor.next = cursor.next, cursor.next + 1
            cursor.last_request, cursor.last_position = request, index
        entries = self._load(episode)
        if index >= len(entries):
            return Position(index, None)
        recorded = entries[index]
        where = first_difference(recorded.request, request)
        if where is None:
            self.stats["replayed"] += 1
            return Position(index, recorded)
        self.stats["diverged"] += 1
        if divergence == GO_LIVE:
            self._truncate(episode, index)
            return Position(index, None)
        raise FailedPrecondition(
            f"replay divergence in episode {episode.rollout_id}/a{episode.attempt} at model call {index}: "
            f"the request differs from the recorded one at {where} (the agent is not deterministic; "
            f"send x-gymrpc-divergence: {GO_LIVE} to continue live from here)",
            reason="REPLAY_DIVERGENCE",
            metadata={
                "rollout_id": episode.rollout_id,
                "attempt": str(episode.attempt),
                "position": str(index),
                "field": where[:200],
            },
        )

    def record(self, episode: EpisodeKey, index: int, request: dict[str, Any], response: pb.GenerateResponse) -> None:
        """Append a delivered live call at `index` (durably first, when there is a folder)."""
        entries = self._load(episode)
        if index < len(entries):
            return  # a retry already recorded it
        if index > len(entries):
            index = len(entries)  # a gap (a call of this run failed): keep the record dense
        entry = Entry(request, response)
        if self.root is not None:
            with open(self._path(episode), "a", encoding="utf-8") as file:
                file.write(_line(entry) + "\n")
                file.flush()
                os.fsync(file.fileno())
        entries.append(entry)
        self.stats["recorded"] += 1

    def entries(self, episode: EpisodeKey) -> list[Entry]:
        return list(self._load(episode))

    # -- freeing -----------------------------------------------------------------------------

    def drop(self, episodes: Iterable[EpisodeKey]) -> None:
        for episode in episodes:
            self._episodes.pop(episode, None)
            for key in [k for k in self._runs if k[0] == episode]:
                del self._runs[key]
            if self.root is not None:
                self._path(episode).unlink(missing_ok=True)

    def forget(self, rollout_ids: Iterable[str]) -> None:
        """Every attempt of these rollouts, in memory and on disk."""
        wanted = set(rollout_ids)
        episodes = {e for e in self._episodes if e.rollout_id in wanted}
        if self.root is not None:
            for path in self.root.glob("*.jsonl"):
                rollout, _, attempt = path.stem.rpartition(".a")
                if rollout in wanted and attempt.isdigit():
                    episodes.add(EpisodeKey(rollout, int(attempt)))
        self.drop(episodes)

    def retired(self, is_retired: Any) -> None:
        """Drop every attempt `is_retired(episode)` says is fenced."""
        episodes = {e for e in self._episodes if is_retired(e)}
        if self.root is not None:
            for path in self.root.glob("*.jsonl"):
                rollout, _, attempt = path.stem.rpartition(".a")
                if attempt.isdigit() and is_retired(EpisodeKey(rollout, int(attempt))):
                    episodes.add(EpisodeKey(rollout, int(attempt)))
        self.drop(episodes)

    # -- storage -----------------------------------------------------------------------------

    def _path(self, episode: EpisodeKey) -> Path:
        assert self.root is not None
        return self.root / f"{episode.rollout_id}.a{episode.attempt}.jsonl"  # rollout ids are checked ids

    def _load(self, episode: EpisodeKey) -> list[Entry]:
        entries = self._episodes.get(episode)
        if entries is None:
            entries = []
            if self.root is not None and self._path(episode).is_file():
                for text in self._path(episode).read_text(encoding="utf-8").splitlines():
                    try:
                        entries.append(_entry(text))
                    except (ValueError, KeyError):
                        break  # a torn last line of a crash: the call was never delivered
            self._episodes[episode] = entries
            while len(self._episodes) > self.max_episodes:
                self._episodes.popitem(last=False)
        self._episodes.move_to_end(episode)
        return entries

    def _truncate(self, episode: EpisodeKey, index: int) -> None:
        entries = self._load(episode)
        del entries[index:]
        if self.root is not None:
            write_text_atomic(self._path(episode), "".join(_line(e) + "\n" for e in entries))


def _line(entry: Entry) -> str:
    response = base64.b64encode(entry.response.SerializeToString(deterministic=True)).decode()
    return json.dumps({"request": entry.request, "response": response}, sort_keys=True, separators=(",", ":"))


def _entry(text: str) -> Entry:
    data = json.loads(text)
    response = pb.GenerateResponse()
    response.ParseFromString(base64.b64decode(data["response"]))
    return Entry(data["request"], response)
