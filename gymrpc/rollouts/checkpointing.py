"""`gymrpc rollouts --checkpoint-dir`: the collector as the controller of coordinated checkpoints (docs/design.md §7).

The collector knows which episodes are in flight, so it is the one controller that can
name a commit's scope. A checkpoint is taken every `--checkpoint-every` seconds, on
SIGUSR1 (and the collection goes on), and on SIGTERM (with `stop`: the stack parks for
good, and the command exits 75). Beside the participants' folders each checkpoint holds
`collector.json` (the episodes in flight and which of them only restart); `LATEST` names
the newest complete checkpoint (one the controller indexed, `checkpoint.json`: every member
committed) and is replaced atomically, so a crash at any point leaves the previous one
usable; only the last K are kept.

`--resume` restores LATEST into a fresh stack: episodes the agents restored continue as
attempt N+1 from their boundary; the rest of those in flight restart as attempt N+1.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gymrpc.client import Client
from gymrpc.control.index import INDEX
from gymrpc.control.types import EpisodeKey, Kind
from gymrpc.controller import CheckpointResult, Controller, CoordinationError, new_checkpoint_id
from gymrpc.errors import GymrpcError

LATEST = "LATEST"
STATE_FILE = "collector.json"
EXIT_CHECKPOINTED = 75
"""EX_TEMPFAIL: stopped after a checkpoint; `--resume` continues."""


def _keys(items: list[list[Any]]) -> list[EpisodeKey]:
    return [EpisodeKey(str(r), int(a)) for r, a in items]


@dataclass
class Saved:
    """One published checkpoint, as the collector sees it."""

    checkpoint_id: str
    folder: Path
    continued: list[EpisodeKey]
    restarted: list[EpisodeKey]


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointKeeper:
    """The checkpoint folder: `collector.json` in each checkpoint, an atomic LATEST pointer, the last `keep`."""

    def __init__(self, root: Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.root, self.keep = root.absolute(), keep
        self.root.mkdir(parents=True, exist_ok=True)

    def publish(self, result: CheckpointResult) -> Saved:
        """Record the collector's part, then point LATEST at it (last), then drop the oldest.

        Only an indexed checkpoint (every member committed) is published: LATEST never names one
        a restore would refuse.
        """
        if result.index is None or not (result.checkpoint_dir / INDEX).is_file():
            raise ValueError(f"checkpoint {result.checkpoint_id} has no {INDEX}: it is not complete, not published")
        state = {
            "checkpoint_id": result.checkpoint_id,
            "continued": [list(k) for k in result.continued],
            "restarted": [list(k) for k in result.restarted],
        }
        _write_atomic(result.checkpoint_dir / STATE_FILE, json.dumps(state, indent=1))
        _write_atomic(self.root / LATEST, result.checkpoint_id + "\n")
        self.prune(result.checkpoint_id)
        return Saved(result.checkpoint_id, result.checkpoint_dir, list(result.continued), list(result.restarted))

    def latest(self) -> Saved | None:
        try:
            checkpoint_id = (self.root / LATEST).read_text().strip()
        except FileNotFoundError:
            return None
        folder = self.root / checkpoint_id
        state = json.loads((folder / STATE_FILE).read_text())
        return Saved(checkpoint_id, folder, _keys(state["continued"]), _keys(state["restarted"]))

    def prune(self, latest: str) -> None:
        """Keep the `keep` newest published checkpoints; unpublished leftovers (no collector.json) go too."""
        folders = [p for p in self.root.iterdir() if p.is_dir()]
        published = sorted((p for p in folders if (p / STATE_FILE).exists()), key=lambda p: p.stat().st_mtime)
        keep = {p.name for p in published[-self.keep :]} | {latest}
        for folder in folders:
            if folder.name not in keep:
                shutil.rmtree(folder, ignore_errors=True)


@dataclass
class CheckpointingRun:
    """In-flight bookkeeping and the controller calls of one `gymrpc rollouts` run."""

    client: Client
    keeper: CheckpointKeeper
    timeout: float = 30.0
    in_flight: dict[str, int] = field(default_factory=dict)
    """Rollout id -> attempt of every episode started and not finished."""
    attempts: dict[str, int] = field(default_factory=dict)
    continued: set[str] = field(default_factory=set)
    restarted: set[str] = field(default_factory=set)
    taken: int = 0
    stopped: bool = False
    """A `stop` checkpoint was committed: the stack refuses work; failures from here on are not results."""

    restored_from: str | None = None
    """The checkpoint `--resume` restored (None: none); every result then says how it relates to it."""

    def __post_init__(self) -> None:
        self.controller = Controller(self.client)
        self._lock = asyncio.Lock()

    # -- start -------------------------------------------------------------------------------

    async def open(self, resume: bool, done: set[str]) -> None:
        """Restore LATEST (with `resume`) and open the stack's admission (it may await a restore)."""
        await self.controller.discover()
        saved = self.keeper.latest() if resume else None
        if saved is None:
            await self.controller.open()
            return
        operation = new_checkpoint_id("restore")
        pending = [k for k in (*saved.continued, *saved.restarted) if k.rollout_id not in done]
        scope = [k for k in saved.continued if k.rollout_id not in done]
        restored: set[str] = set()
        next_attempt = 1
        if scope:
            try:
                replies = await self.controller.restore(operation, saved.folder, scope)
            except CoordinationError as exc:
                if not all(e.reason == "NOT_FRESH" for e in exc.failures.values()):
                    raise
                # The stack outlived the run that checkpointed (only the caller died): it holds no
                # episode of the checkpoint to continue, so they start over, past any attempt the
                # failed restore fenced where it had installed them.
                whole = len(exc.failures) == len(self.controller.members)
                next_attempt = 1 if whole else 2
                print(
                    f"{saved.checkpoint_id}: the stack has served work since it started "
                    f"({', '.join(sorted(exc.failures))}), so it cannot restore it: its {len(scope)} episodes in "
                    "flight start over instead of continuing (start a fresh stack to continue them)",
                    file=sys.stderr,
                )
            else:
                agents = {m.label for m in self.controller.members if m.kind is Kind.AGENT}  # every replica
                restored = {e.rollout_id for n in agents if n in replies for e in replies[n].restored}
        await self.controller.resume(operation)
        self.attempts = {k.rollout_id: k.attempt + next_attempt for k in pending}
        self.continued = {k.rollout_id for k in pending if k.rollout_id in restored}
        self.restarted = {k.rollout_id for k in pending} - self.continued
        self.restored_from = saved.checkpoint_id

    def outcome(self, rollout_id: str) -> str | None:
        """`EpisodeResult.checkpoint` for an episode of this run."""
        if self.restored_from is None:
            return None
        if rollout_id in self.continued:
            return "continued"
        return "restarted" if rollout_id in self.restarted else "not_in_checkpoint"

    # -- bookkeeping (collector callbacks) ---------------------------------------------------

    def started(self, rollout_id: str) -> None:
        self.in_flight[rollout_id] = self.attempts.get(rollout_id, 0)

    def finished(self, rollout_id: str) -> None:
        self.in_flight.pop(rollout_id, None)

    # -- checkpoints -------------------------------------------------------------------------

    async def checkpoint(self, *, stop: bool = False) -> Saved | None:
        """One checkpoint of every episode in flight; None (and a message) if it was not taken."""
        async with self._lock:
            scope = [EpisodeKey(r, a) for r, a in sorted(self.in_flight.items())]
            try:
                result = await self.controller.checkpoint(
                    self.keeper.root, episode_ids=scope, timeout=self.timeout, stop=stop
                )
            except (CoordinationError, GymrpcError) as exc:
                print(f"gymrpc rollouts: checkpoint failed: {exc}", file=sys.stderr)
                return None
            if not result.committed:
                blockers = sum(len(b) for b in result.prepare.blockers().values())
                print(f"gymrpc rollouts: checkpoint skipped: {blockers} episodes not parked in time", file=sys.stderr)
                return None
            self.stopped = stop
            saved = self.keeper.publish(result)
            self.taken += 1
            return saved

    async def every(self, seconds: float) -> None:
        """Checkpoint every `seconds` until cancelled."""
        while True:
            await asyncio.sleep(seconds)
            await self.checkpoint()
