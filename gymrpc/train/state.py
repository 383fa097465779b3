"""The trainer's own state, saved beside the stack's checkpoint so the two restore together.

A joint checkpoint is one folder: the participants' records and the controller's index (written
by `gymrpc.Controller`), `collector.json` (which episodes were in flight), and `trainer/`:

    trainer/state.json      iteration, data cursor, weight version, metrics so far, the batch in flight
    trainer/finished.jsonl  episodes of the batch in flight that had already finished (their trajectories)
    trainer/weights/        the trainer's weights (safetensors), the ones the model server was serving
    trainer/optimizer.pt    optimizer moments and the torch RNG
    trainer/MANIFEST        every other file with its sha256

`trainer/` is written (to a temporary name, then renamed) before the checkpoint is asked for,
and registered in the checkpoint's index (`Controller.checkpoint(trainer_state=...)`), which
records the MANIFEST's sha256: a restore finds it through the index and refuses a copy that
changed since (`gymrpc.control.trainer_state.read_trainer_state`, then `read_state` checks
every file against the MANIFEST). The episodes that had
finished are in the state and the ones still running are in the stack's checkpoint: a resumed
batch counts each episode exactly once.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gymrpc.control.trainer_state import FOLDER_MANIFEST
from gymrpc.durable import fsync_folder
from gymrpc.train.cursor import DataCursor
from gymrpc.v1 import agent_service_pb2 as agent_pb

SCHEMA = 1
TRAINER_DIR = "trainer"
STATE_FILE = "state.json"
FINISHED_FILE = "finished.jsonl"


class StateError(ValueError):
    """A trainer state folder that cannot be resumed from (the message names the file)."""


@dataclass(frozen=True)
class Finished:
    """One finished episode of a batch: who it was (task, group member, attempt) and its trajectory."""

    episode_id: str
    task_index: int
    member: int
    attempt: int
    trajectory: agent_pb.Trajectory

    def to_json(self) -> dict[str, Any]:
        return {
            "episode_id": self.episode_id,
            "task_index": self.task_index,
            "member": self.member,
            "attempt": self.attempt,
            "trajectory": base64.b64encode(self.trajectory.SerializeToString(deterministic=True)).decode(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Finished:
        trajectory = agent_pb.Trajectory()
        trajectory.ParseFromString(base64.b64decode(data["trajectory"]))
        return cls(
            str(data["episode_id"]), int(data["task_index"]), int(data["member"]), int(data["attempt"]), trajectory
        )


@dataclass
class Batch:
    """One iteration's episodes: `tasks` x `group_size`, and those already finished."""

    iteration: int
    tasks: list[int]
    group_size: int
    finished: dict[str, Finished] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    """Episodes that ended with an error (not a trajectory): left out of the step, counted in the metrics."""

    def add(self, done: Finished) -> None:
        """Record a finished episode; the same episode twice is a bug upstream, never counted twice."""
        if done.episode_id in self.finished:
            raise StateError(f"episode {done.episode_id} of iteration {self.iteration} finished twice")
        self.finished[done.episode_id] = done

    @property
    def size(self) -> int:
        return len(self.tasks) * self.group_size

    @property
    def complete(self) -> bool:
        return len(self.finished) + len(self.failed) == self.size


@dataclass
class TrainerState:
    run_id: str
    iteration: int
    """The iteration whose batch is being collected (and is trained on next)."""
    weight_version: str
    """The version of the trainer's weights, which the model server serves."""
    updates: int
    """Weight updates pushed so far (the next version's number)."""
    cursor: DataCursor
    batch: Batch | None
    """The batch in flight, if any."""
    metrics: list[dict[str, Any]] = field(default_factory=list)
    """One row per trained iteration (`metrics.csv`)."""
    batches: list[dict[str, Any]] = field(default_factory=list)
    """One record per trained iteration: its episodes, attempts and rewards (`batches.jsonl`)."""
    config: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        batch = None
        if self.batch is not None:
            batch = {"iteration": self.batch.iteration, "tasks": self.batch.tasks, "group_size": self.batch.group_size}
        return {
            "schema": SCHEMA,
            "run_id": self.run_id,
            "iteration": self.iteration,
            "weight_version": self.weight_version,
            "updates": self.updates,
            "cursor": self.cursor.to_json(),
            "batch": batch,
            "metrics": self.metrics,
            "batches": self.batches,
            "config": self.config,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], finished: Iterable[Finished] = ()) -> TrainerState:
        if data.get("schema") != SCHEMA:
            raise StateError(f"trainer state schema {data.get('schema')!r} is not {SCHEMA}")
        batch = None
        if data["batch"] is not None:
            b = data["batch"]
            batch = Batch(int(b["iteration"]), [int(t) for t in b["tasks"]], int(b["group_size"]))
            for done in finished:
                batch.add(done)
        return cls(
            run_id=str(data["run_id"]),
            iteration=int(data["iteration"]),
            weight_version=str(data["weight_version"]),
            updates=int(data["updates"]),
            cursor=DataCursor.from_json(data["cursor"]),
            batch=batch,
            metrics=list(data["metrics"]),
            batches=list(data["batches"]),
            config=dict(data["config"]),
        )


def write_state(checkpoint_dir: Path, state: TrainerState, save_policy: Callable[[Path], None]) -> Path:
    """`checkpoint_dir/trainer/` from `state` and the policy (`save_policy(folder)`), renamed into place."""
    final = checkpoint_dir / TRAINER_DIR
    tmp = checkpoint_dir / f".{TRAINER_DIR}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_policy(tmp)
    finished = state.batch.finished.values() if state.batch is not None else ()
    _write(tmp / FINISHED_FILE, "".join(json.dumps(f.to_json()) + "\n" for f in finished))
    _write(tmp / STATE_FILE, json.dumps(state.to_json(), indent=1) + "\n")
    _write(tmp / FOLDER_MANIFEST, "".join(f"{digest}  {name}\n" for name, digest in _digests(tmp)))
    if final.exists():  # a retried write of the same checkpoint
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_folder(checkpoint_dir)
    return final


def read_state(folder: Path) -> TrainerState:
    """The state in a trainer folder (`write_state`'s), every file checked against its MANIFEST."""
    try:
        lines = (folder / FOLDER_MANIFEST).read_text().splitlines()
        listed = {name: digest for digest, name in (line.split("  ", 1) for line in lines if line)}
        present = dict(_digests(folder))
        if listed != present:
            changed = sorted(set(listed.items()) ^ set(present.items()))
            raise StateError(f"{folder}: files differ from its {FOLDER_MANIFEST}: {sorted({n for n, _ in changed})}")
        data = json.loads((folder / STATE_FILE).read_text())
        rows = (folder / FINISHED_FILE).read_text().splitlines()
        finished = [Finished.from_json(json.loads(row)) for row in rows if row.strip()]
        return TrainerState.from_json(data, finished)
    except FileNotFoundError as exc:
        raise StateError(f"{exc.filename} is missing: {folder} is not a whole trainer state") from None
    except (ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, StateError):
            raise
        raise StateError(f"{folder / STATE_FILE}: not a trainer state: {exc}") from None


def _digests(folder: Path) -> list[tuple[str, str]]:
    """(relative path, sha256) of every file under `folder` but the MANIFEST, in path order."""
    out = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = path.relative_to(folder).as_posix()
        if name != FOLDER_MANIFEST:
            out.append((name, hashlib.sha256(path.read_bytes()).hexdigest()))
    return out


def _write(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
