"""What a collection shows and keeps: the results file, the progress line, the closing summary.

The results file gets one JSON line per episode the moment it ends (flushed at once,
fsynced at least every second), so a crash or Ctrl-C loses at most the episodes in
flight, and `done_ids` lets the next run skip what is already there.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import grpc
from google.protobuf import json_format

from gymrpc.errors import error_class
from gymrpc.rollouts.collector import EpisodeResult, error_json
from gymrpc.rollouts.tasks import RolloutTask
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2


class ResultWriter:
    """Appends result lines: flushed per line, fsynced every `fsync_interval` seconds and on close."""

    def __init__(self, path: Path, *, append: bool = False, fsync_interval: float = 1.0) -> None:
        self.path = path
        if append:
            _drop_partial_line(path)
        self._file = open(path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._interval = fsync_interval
        self._synced = time.monotonic()
        self.written = 0

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
        self._file.flush()
        self.written += 1
        if time.monotonic() - self._synced >= self._interval:
            self.sync()

    def sync(self) -> None:
        os.fsync(self._file.fileno())
        self._synced = time.monotonic()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self.sync()
            self._file.close()


def _drop_partial_line(path: Path) -> None:
    """A crash mid-write leaves a line without its newline; cut it so the next line starts clean."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def done_ids(path: Path) -> set[str]:
    """Episode ids that completed in an earlier run of the same results file (failed ones run again)."""
    done: set[str] = set()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return done
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the partial last line of a crashed run
        if isinstance(record, dict) and record.get("ok") and isinstance(record.get("episode_id"), str):
            done.add(record["episode_id"])
    return done


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class Summary:
    """Aggregates over finished episodes; `lines()` is the human form, `to_json()` the machine one."""

    results: list[EpisodeResult]
    wall_s: float
    planned: int
    skipped: int = 0
    interrupted: bool = False
    by_task: dict[int, list[float]] = field(init=False)

    def __post_init__(self) -> None:
        self.by_task = defaultdict(list)
        for r in self.ok:
            self.by_task[r.task.index].append(r.reward or 0.0)

    @property
    def ok(self) -> list[EpisodeResult]:
        return [r for r in self.results if r.ok]

    @property
    def failed(self) -> list[EpisodeResult]:
        return [r for r in self.results if not r.ok]

    @property
    def mean_reward(self) -> float | None:
        rewards = [r.reward or 0.0 for r in self.ok]
        return sum(rewards) / len(rewards) if rewards else None

    def outcomes(self) -> dict[str, int]:
        """How the episodes got there, every one counted: each key is a count of episodes."""
        done = [r.trajectory for r in self.results if r.trajectory is not None]
        out = {
            "resumed": sum(1 for t in done if t.resume_count),
            "restarted": sum(1 for t in done if t.restart_count),
            "session_recoveries": sum(t.session_recoveries for t in done),
            "episodes_with_session_recoveries": sum(1 for t in done if t.session_recoveries),
        }
        for kind in CHECKPOINT_OUTCOMES:
            out[f"checkpoint_{kind}"] = sum(1 for r in self.results if r.checkpoint == kind)
        return out

    @property
    def failovers(self) -> int:
        """Calls that moved to another replica after theirs failed, over every finished episode."""
        return sum(r.trajectory.failovers for r in self.results if r.trajectory is not None)

    @property
    def stale(self) -> list[EpisodeResult]:
        """Episodes reported stale (beyond `max_policy_lag`, kept and flagged)."""
        return [r for r in self.results if r.stale]

    @property
    def stale_restarts(self) -> int:
        return sum(r.stale_restarts for r in self.results)

    def to_json(self) -> dict[str, Any]:
        latencies = [r.latency_s for r in self.results]
        return {
            "planned": self.planned,
            "finished": len(self.results),
            "ok": len(self.ok),
            "failed": len(self.failed),
            "skipped": self.skipped,
            "interrupted": self.interrupted,
            "mean_reward": self.mean_reward,
            "mean_reward_by_task": {str(k): sum(v) / len(v) for k, v in sorted(self.by_task.items())},
            "latency_p50_s": percentile(latencies, 50) if latencies else None,
            "latency_p95_s": percentile(latencies, 95) if latencies else None,
            "wall_s": self.wall_s,
            "episodes_per_s": len(self.results) / self.wall_s if self.wall_s > 0 else None,
            "failovers": self.failovers,
            "stale": len(self.stale),
            "stale_restarts": self.stale_restarts,
            "max_policy_lag_seen": max((r.policy_lag for r in self.results if r.policy_lag is not None), default=None),
            "outcomes": self.outcomes(),
            "failures": [{"episode_id": r.episode_id, **error_json(r.error)} for r in self.failed if r.error],
        }

    def lines(self, *, max_tasks: int = 12, max_failures: int = 10) -> list[str]:
        n, wall = len(self.results), self.wall_s
        rate = n / wall if wall > 0 else 0.0
        head = f"episodes  {n} of {self.planned} finished: {len(self.ok)} ok, {len(self.failed)} failed"
        head += f", in {wall:.2f} s = {rate:.1f} episodes/s"
        if self.skipped:
            head += f" ({self.skipped} skipped: already in the results file)"
        if self.interrupted:
            head += " (interrupted)"
        out = [head]
        mean = self.mean_reward
        out.append(f"reward    mean {mean:.3f} over {len(self.ok)} episodes" if mean is not None else "reward    -")
        if self.by_task:
            means = {k: sum(v) / len(v) for k, v in sorted(self.by_task.items())}
            shown = list(means.items())
            label = "by task  "
            if len(shown) > max_tasks:
                shown = sorted(shown, key=lambda kv: kv[1])[:max_tasks]
                label = f"lowest {max_tasks} of {len(means)} tasks:"
            out.append(f"{label} " + "  ".join(f"t{k} {v:.2f}" for k, v in shown))
        if self.results:
            latencies = [r.latency_s for r in self.results]
            out.append(
                f"latency   p50 {percentile(latencies, 50):.3f} s  p95 {percentile(latencies, 95):.3f} s"
                f"  max {max(latencies):.3f} s"
            )
        o = self.outcomes()
        line = (
            f"outcomes  {o['resumed']} resumed, {o['restarted']} restarted, {o['session_recoveries']} session "
            f"recoveries in {o['episodes_with_session_recoveries']} episodes"
        )
        if any(r.checkpoint is not None for r in self.results):
            line += (
                f"; from the checkpoint: {o['checkpoint_continued']} continued, {o['checkpoint_restarted']} "
                f"restarted, {o['checkpoint_not_in_checkpoint']} run from the start (not in it)"
            )
        out.append(line)
        if failovers := self.failovers:
            moved = sum(1 for r in self.results if r.trajectory is not None and r.trajectory.failovers)
            out.append(f"failovers {failovers} calls of {moved} episodes moved to another replica")
        lags = [r.policy_lag for r in self.results if r.policy_lag is not None]
        if lags or self.stale_restarts:
            out.append(
                f"staleness {len(self.stale)} stale (flagged), {self.stale_restarts} restarts of stale episodes; "
                f"policy lag max {max(lags, default=0)}"
            )
        failed = sorted(self.failed, key=lambda r: (r.task.index, r.repeat))
        if failed:
            out.append(f"failures  {len(failed)}:")
            for r in failed[:max_failures]:
                assert r.error is not None
                out.append(f"  {r.episode_id}  {r.error.code.name} {r.error.reason}: {r.error.message}")
            if len(failed) > max_failures:
                out.append(f"  ... and {len(failed) - max_failures} more (see the results file)")
        return out


CHECKPOINT_OUTCOMES = ("continued", "restarted", "not_in_checkpoint")


def read_results(path: Path) -> tuple[list[EpisodeResult], int]:
    """Results lines back as `EpisodeResult`s (for `gymrpc report`), and the count of lines skipped.

    A crashed collector may leave a partial last line; it is skipped and counted, as is any line
    that is not a result. A line that appears twice (a `--resume` that re-ran a failed episode)
    counts once, its last occurrence.
    """
    by_id: dict[str, EpisodeResult] = {}
    bad = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            result = result_from_line(json.loads(line))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, json_format.ParseError):
            bad += 1
            continue
        by_id[result.episode_id] = result
    return list(by_id.values()), bad


@dataclass(frozen=True)
class _RecordedTask(RolloutTask):
    """A task rebuilt from a results line: the episode id is the one recorded."""

    recorded_id: str = ""

    def episode_id(self, repeat: int) -> str:
        return self.recorded_id


def result_from_line(record: dict[str, Any]) -> EpisodeResult:
    task = _RecordedTask(
        int(record["task_index"]),
        common_pb2.Task(task_id=str(record.get("task_id", ""))),
        row_id=record.get("id"),
        recorded_id=str(record["episode_id"]),
    )
    trajectory = None
    if record.get("trajectory") is not None:
        trajectory = json_format.ParseDict(record["trajectory"], agent_pb.Trajectory(), ignore_unknown_fields=True)
    error = None
    if record.get("error"):
        e = record["error"]
        error = error_class(grpc.StatusCode[e["code"]])(e["message"], reason=e.get("reason") or None)
    started = float(record["started_at"])
    weights = record.get("weights") or {}
    return EpisodeResult(
        task,
        int(record.get("repeat", 0)),
        str(record.get("agent", "")),
        str(record.get("policy_version", "")),
        started,
        float(record.get("finished_at", started)) - started,
        trajectory,
        error,
        policy_lag=weights.get("policy_lag"),
        stale=bool(weights.get("stale", False)),
        stale_restarts=int(weights.get("stale_restarts", 0)),
        checkpoint=record.get("checkpoint"),
    )


def report(path: Path) -> Summary:
    """The summary of a results file, rebuilt from its lines (also when the collector was killed)."""
    results, _ = read_results(path)
    if not results:
        return Summary([], 0.0, 0)
    first = min(r.started_at for r in results)
    last = max(r.started_at + r.latency_s for r in results)
    return Summary(results, last - first, len(results))


class Progress:
    """A one-line progress bar on a TTY; on anything else, a plain line every `interval` seconds."""

    def __init__(self, total: int, stream: TextIO | None = None, *, interval: float = 5.0, label: str = "") -> None:
        self.total, self.label = total, label
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.interval = 0.1 if self.tty else interval
        self.started = time.monotonic()
        self._drawn = 0.0
        self.done = self.failed = 0
        self.reward_sum = 0.0
        self._visible = False

    def update(self, result: EpisodeResult) -> None:
        self.done += 1
        if result.ok:
            self.reward_sum += result.reward or 0.0
        else:
            self.failed += 1
        self.tick(force=self.done == self.total)

    def tick(self, *, force: bool = False) -> None:
        """Redraw if due (called on every result and by a timer, so the ETA moves when nothing ends)."""
        now = time.monotonic()
        if not force and now - self._drawn < self.interval:
            return
        self._drawn = now
        if self.tty:
            self.stream.write("\r\x1b[2K" + self.line())
            self._visible = True
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        """Print a message line without tearing the bar."""
        self._clear()
        self.stream.write(text + "\n")
        self.stream.flush()
        if self.tty:
            self._drawn = 0.0
            self.tick()

    def close(self) -> None:
        if self.tty and self._visible:
            self.tick(force=True)
            self.stream.write("\n")
            self.stream.flush()
            self._visible = False

    def _clear(self) -> None:
        if self.tty and self._visible:
            self.stream.write("\r\x1b[2K")
            self._visible = False

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = self.done / elapsed
        ok = self.done - self.failed
        reward = f"{self.reward_sum / ok:.3f}" if ok else "-"
        left = self.total - self.done
        eta = f"{left / rate:.0f}s" if rate > 0 and left else ("0s" if not left else "?")
        width = 24
        filled = round(width * self.done / self.total) if self.total else width
        bar = "#" * filled + "." * (width - filled)
        pct = 100 * self.done / self.total if self.total else 100.0
        prefix = f"{self.label} " if self.label else ""
        return (
            f"{prefix}[{bar}] {self.done}/{self.total} {pct:3.0f}%  {rate:.1f} ep/s  reward {reward}"
            f"  failed {self.failed}  ETA {eta}"
        )
