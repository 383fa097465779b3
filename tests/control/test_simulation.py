"""Randomized simulation of coordinated checkpoints over real gRPC (issue 5, "What must be shown").

One seed drives a deployment of in-process participant servers (an agent-kind participant, two
models, three counter resources servers; `tests/control/deployment.py`) through a random
interleaving of episodes starting, advancing (sometimes left between boundaries) and finishing,
with whole checkpoints and single prepare / commit / resume calls, retire and forget, crashes of
participants followed by a restore into fresh processes, while record writes fail or hang and
installs fail. After every step it checks the invariants of the reference's simulation
(`nemo-gym.md` §4):

- all participants are open whenever all are idle;
- prepare closes in order (environment, model, agent, resources), resume reopens in reverse
  (a non-stop checkpoint instead reopens each member once it and its callers captured: no
  caller ever captures after a callee reopened), retire reaches callers before callees;
- after a retire every participant refuses the attempt (status marks and data-plane calls);
- a commit returns only continued episodes;
- every manifest on disk verifies (size, sha256, count, decode);
- a checkpoint resumed without a manifest on some participant never gets one there (a
  stop-the-world checkpoint, `nonstop=False`, or a single commit);
- a non-stop checkpoint (captured, resumed, then persisted) that failed never gets an index,
  though the writes of members that captured may finish later (a commit that failed elsewhere,
  say at a deadline a loaded machine missed, is resumed: those members' captures are written);
- every committed checkpoint restores into a fresh deployment, each episode exactly at its boundary;
- a failed restore leaves everyone idle and open with nothing restored.

A failure prints the seed and the step log; re-run one seed with `SIM_SEED=N` (`SIM_TIMES=1` adds
each step's duration to the log). The default tier
runs 20 seeds of 40 steps; the slow tier 60 more (`SIM_SLOW_SEEDS` changes that).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import os
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from gymrpc.control import PREPARE_ORDER, RESUME_ORDER, RETIRE_ORDER, EpisodeKey, Kind, Phase
from gymrpc.control import store as store_module
from gymrpc.control.index import INDEX, index_sources, read_index
from gymrpc.control.types import CALLERS
from gymrpc.controller import CoordinationError
from gymrpc.errors import GymrpcError, InvalidArgument, NotFound
from tests.control.deployment import Deployment, FakeAgent, Node

NAMES = ("agent/a", "model/m0", "model/m1", "resources/r0", "resources/r1", "resources/r2")
RESOURCES = tuple(n for n in NAMES if n.startswith("resources/"))
MODELS = tuple(n for n in NAMES if n.startswith("model/"))
RETIRE_STAGE = {kind: stage for stage, kinds in enumerate(RETIRE_ORDER) for kind in kinds}
STEPS = 40
FAST_SEEDS = 20
SLOW_SEEDS = int(os.environ.get("SIM_SLOW_SEEDS", "60"))
MISS, SHORT, LONG = 0.05, 0.15, 60.0
"""Control deadlines: a prepare with a blocker misses MISS and a hung write SHORT on purpose; LONG never
(it bounds calls that return on their own, so a loaded machine's slowness never reaches it)."""


@dataclass(frozen=True)
class Episode:
    """The simulation's truth about one live episode."""

    key: EpisodeKey
    resources: str
    model: str
    steps: int = 0
    running: bool = False


class Writes:
    """Record writes that fail or hang for a chosen participant (the reference's `GatedWrites`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.faults: dict[str, str] = {}
        self.release = threading.Event()
        self.pending: list[threading.Event] = []
        real = store_module.write_checkpoint

        def write(root: Path, kind: Kind, name: str, *args: Any) -> Any:
            fault = self.faults.pop(name, None)
            if fault == "fail":
                raise OSError(28, "No space left on device (injected)")
            if fault == "hang":
                done = threading.Event()
                self.pending.append(done)
                try:
                    self.release.wait(30)
                    return real(root, kind, name, *args)
                finally:
                    done.set()
            return real(root, kind, name, *args)

        monkeypatch.setattr(store_module, "write_checkpoint", write)

    def settle(self) -> None:
        """Let hung writes go on (they must find their checkpoint resumed) and wait for them."""
        self.release.set()
        for done in self.pending:
            done.wait(10)
        self.pending.clear()
        self.release = threading.Event()


class Simulation:
    def __init__(self, seed: int, root: Path, writes: Writes) -> None:
        self.seed, self.rng, self.root, self.writes = seed, random.Random(seed), root, writes
        self.log: list[str] = []
        self.events: list[tuple[str, Kind]] = []
        self.nonstop = False
        """The step is a non-stop checkpoint: its members reopen as they and their callers capture."""
        self.deployment: Deployment | None = None
        self.live: dict[str, Episode] = {}
        self.retired: dict[str, int] = {}
        self.open: str | None = None
        self.prepared = False
        self.latest_snapshot: dict[str, Episode] = {}
        self.first_commit: tuple[dict[str, Any], list[EpisodeKey]] | None = None
        self.latest: tuple[Path, dict[str, Episode]] | None = None
        self.never: set[tuple[Path, str]] = set()
        self.unpublished: set[Path] = set()
        """Folders of non-stop checkpoints whose publish failed: none may get an index."""
        self.modes = random.Random(seed + 7919)
        """Draws non-stop or stop-the-world per checkpoint, apart from `rng` (which drives the steps)."""
        """(checkpoint folder, participant) resumed without a manifest: none may appear later."""
        self.ids = itertools.count()
        self.verified: set[Path] = set()

    # -- plumbing --------------------------------------------------------------------------

    @property
    def d(self) -> Deployment:
        assert self.deployment is not None
        return self.deployment

    def note(self, text: str) -> None:
        self.log.append(f"{len(self.log):3d} {text}")

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{self.seed}-{next(self.ids)}"

    def watch(self, node: Node) -> None:
        """Log every admission close and open of `node`, with its kind, for the order checks."""
        participant = node.participant
        close, reopen, retire = participant.close_admission, participant.open_admission, participant.retire
        capture = participant.capture

        async def logged_close() -> None:
            self.events.append(("close", node.kind))
            await close()

        async def logged_open() -> None:
            self.events.append(("open", node.kind))
            await reopen()

        async def logged_retire(episodes: Any) -> None:
            self.events.append(("retire", node.kind))
            await retire(episodes)

        async def logged_capture(scope: Any) -> Any:
            self.events.append(("capture", node.kind))
            return await capture(scope)

        participant.capture = logged_capture  # type: ignore[method-assign]
        participant.close_admission = logged_close
        participant.open_admission = logged_open
        participant.retire = logged_retire

    async def start(self, *, watch: bool = True) -> Deployment:
        deployment = await Deployment.start(NAMES)
        if watch:
            for node in deployment.nodes.values():
                self.watch(node)
        return deployment

    def agent(self, deployment: Deployment | None = None) -> FakeAgent:
        return (deployment or self.d).nodes["agent/a"].participant

    # -- steps -----------------------------------------------------------------------------

    async def step(self) -> None:
        self.events.clear()
        self.nonstop = False
        self.writes.settle()
        choices: list[tuple[str, int]] = [("start", 4), ("checkpoint", 3), ("crash", 1)]
        if self.open is None:
            choices += [("prepare", 1), ("forget", 1 if self.retired else 0)]
            if self.live:
                choices += [("advance", 8), ("finish", 2), ("retire", 2)]
        else:
            choices += [("commit", 3 if self.prepared else 0), ("resume", 3), ("retire_open", 1)]
            choices = [(c, w) for c, w in choices if c not in ("start", "checkpoint")]
        names, weights = zip(*[(c, w) for c, w in choices if w], strict=True)
        action = self.rng.choices(names, weights)[0]
        started = time.monotonic()
        await getattr(self, f"do_{action}")()
        if os.environ.get("SIM_TIMES"):
            self.note(f"    ({action} took {time.monotonic() - started:.3f}s)")
        await self.check(action)

    async def do_start(self) -> None:
        key = EpisodeKey(f"e{next(self.ids)}", 0)
        episode = Episode(key, self.rng.choice(RESOURCES), self.rng.choice(MODELS))
        await self.d.seed(episode.resources, key)
        self.agent().track(key)
        self.live[key.rollout_id] = episode
        self.note(f"start {key} on {episode.resources}, {episode.model}")

    async def do_advance(self) -> None:
        episode = self.live[self.rng.choice(sorted(self.live))]
        key, agent = episode.key, self.agent()
        if episode.running:  # the step left between boundaries reaches its boundary
            agent.end(key)
            self.live[key.rollout_id] = replace(episode, running=False, steps=episode.steps + 1)
            self.note(f"advance {key}: reaches boundary {episode.steps + 1}")
            return
        agent.begin(key)
        await self.d.generate(episode.model, key, episode.steps)
        await self.d.increment(episode.resources, key, f"call-{episode.steps}")
        if self.rng.random() < 0.3:
            self.live[key.rollout_id] = replace(episode, running=True)
            self.note(f"advance {key}: left between boundaries after step {episode.steps}")
            return
        agent.end(key)
        self.live[key.rollout_id] = replace(episode, steps=episode.steps + 1)
        self.note(f"advance {key}: boundary {episode.steps + 1}")

    async def do_finish(self) -> None:
        episode = self.live.pop(self.rng.choice(sorted(self.live)))
        await self.d.close_session(episode.resources, episode.key)
        self.agent().drop(episode.key)
        self.note(f"finish {episode.key}")

    def arm_faults(self, folder: Path) -> str:
        """Maybe make one participant's next record write fail or hang (one that has not committed yet)."""
        roll = self.rng.random()
        writers = [n for n in NAMES if not self.manifest(folder, n).exists()]
        if roll < 0.6 or not writers:
            return ""
        fault = "fail" if roll < 0.8 else "hang"
        name = self.rng.choice(writers)
        self.writes.faults = {name: fault}
        return f" ({fault} write on {name})"

    @staticmethod
    def missed(error: CoordinationError) -> bool:
        """A deadline short on purpose (MISS) can pass before a slow machine delivers the call at all."""
        return {e.reason for e in error.failures.values()} == {"DEADLINE_EXCEEDED"}

    @classmethod
    def expect_failure(cls, faults: str, error: CoordinationError) -> None:
        """A failed write fails only its participant; a hung one fails its own, and others may miss SHORT
        too: on a busy machine SHORT can pass before a call reaches the hung participant at all (in the
        prepare, or in a non-stop commit, where the hung write comes only later)."""
        assert faults, f"a commit without injected faults failed: {error}"
        name = faults.split(" on ")[1].rstrip(")")
        if faults.startswith(" (fail"):
            assert list(error.failures) == [name], error
        else:
            assert name in error.failures or cls.missed(error), error

    def scope(self) -> list[EpisodeKey]:
        return sorted(e.key for e in self.live.values())

    async def do_checkpoint(self) -> None:
        checkpoint_id = self.new_id("ckpt")
        folder = self.root / checkpoint_id
        faults = self.arm_faults(folder)
        blocked = any(e.running for e in self.live.values())
        timeout = MISS if blocked else SHORT if faults.startswith(" (hang") else LONG
        snapshot = dict(self.live)
        nonstop = self.nonstop = self.modes.random() < 0.5
        mode = "non-stop" if nonstop else "stop-the-world"
        try:
            result = await self.d.controller.checkpoint(
                self.root, episode_ids=self.scope(), checkpoint_id=checkpoint_id, timeout=timeout, nonstop=nonstop
            )
        except CoordinationError as exc:
            self.note(f"checkpoint {checkpoint_id} {mode}{faults}: failed, aborted: {sorted(exc.failures)}")
            if not (blocked and self.missed(exc)):
                self.expect_failure(faults, exc)
            if nonstop:  # whoever captured writes once resumed, whatever failed (commit or persist): no index
                assert not (folder / INDEX).exists(), "a checkpoint whose publish failed was indexed"
                self.unpublished.add(folder)
            else:
                self.after_resume(folder)
            return
        finally:
            self.writes.faults = {}
        self.after_resume(folder)
        if not result.committed:
            self.note(f"checkpoint {checkpoint_id} t={timeout}{faults}: not prepared, {result.prepare.blockers()}")
            assert blocked, f"prepare missed its deadline with nothing running: {result.prepare.blockers()}"
            assert set(result.prepare.blockers()) == {"agent/a"}
            assert "resources/r0" not in result.prepare.replies  # stopped at the first stage not ready
            return
        assert not blocked, "a checkpoint committed while an episode was between boundaries"
        assert not faults.startswith(" (fail"), "a failed write still committed"
        self.note(f"checkpoint {checkpoint_id} {mode}{faults}: committed {len(result.continued)} episodes")
        await self.committed(folder, result.manifests, snapshot)

    async def do_prepare(self) -> None:
        self.open, self.prepared, self.first_commit = self.new_id("ckpt"), False, None
        blocked = any(e.running for e in self.live.values())
        try:
            result = await self.d.controller.prepare(self.open, timeout=MISS if blocked else LONG)
        except CoordinationError as exc:
            if not (blocked and self.missed(exc)):
                raise
            self.note(f"prepare {self.open}: deadline passed before it reached {sorted(exc.failures)}")
            return
        self.prepared = result.prepared
        self.note(f"prepare {self.open}: prepared={result.prepared}")
        assert result.prepared != blocked
        if not blocked:  # nothing can change any more: this is what a commit must store
            self.latest_snapshot = dict(self.live)

    async def do_commit(self) -> None:
        assert self.open is not None
        folder = self.root / self.open
        if self.first_commit is not None:  # a retry gets the first reply: the first export, once
            manifests = await self.d.controller.commit(self.open, folder, self.first_commit[1], timeout=LONG)
            assert manifests == self.first_commit[0], "a retried commit did not return its first reply"
            self.note(f"commit {self.open} again: the first reply")
            return
        faults = self.arm_faults(folder)
        timeout = SHORT if faults.startswith(" (hang") else LONG
        scope = self.scope()
        try:
            manifests = await self.d.controller.commit(self.open, folder, scope, timeout=timeout)
        except CoordinationError as exc:
            self.note(f"commit {self.open}{faults}: failed on {sorted(exc.failures)}")
            self.expect_failure(faults, exc)
            return
        finally:
            self.writes.faults = {}
        assert not faults.startswith(" (fail"), "a failed write still committed"
        self.first_commit = (manifests, scope)
        self.note(f"commit {self.open}{faults}: committed")
        await self.committed(folder, manifests, self.latest_snapshot)

    async def do_resume(self) -> None:
        assert self.open is not None
        await self.d.controller.resume(self.open)
        self.note(f"resume {self.open}")
        self.after_resume(self.root / self.open)
        self.open = None

    async def do_retire_open(self) -> None:
        key = EpisodeKey("somebody", 0)
        with pytest.raises(CoordinationError) as caught:
            await self.d.controller.retire(self.new_id("op"), [key])
        assert {e.reason for e in caught.value.failures.values()} == {"INVALID_PHASE"}
        self.note(f"retire while {self.open} is open: refused")

    async def do_retire(self) -> None:
        episode = self.live.pop(self.rng.choice(sorted(self.live)))
        await self.d.controller.retire(self.new_id("op"), [episode.key])
        self.retired[episode.key.rollout_id] = max(self.retired.get(episode.key.rollout_id, -1), episode.key.attempt)
        self.note(f"retire {episode.key}")
        await self.check_refused(episode.key)

    async def do_forget(self) -> None:
        rollout = self.rng.choice(sorted(self.retired))
        await self.d.controller.forget(self.new_id("op"), [rollout])
        del self.retired[rollout]
        for name, status in (await self.d.statuses()).items():
            assert rollout not in status.retired, f"{name} kept the mark of {rollout} after forget"
        self.note(f"forget {rollout}")

    async def do_crash(self) -> None:
        """Some participants die; the controller restores the latest checkpoint into fresh processes."""
        dead = self.rng.sample(NAMES, self.rng.randint(1, 3))
        for name in dead:
            await self.d.nodes[name].kill()
        self.note(f"crash {dead} (open checkpoint {self.open})")
        with pytest.raises(CoordinationError) as caught:  # the dead are reported, by name
            await self.d.controller.status(timeout=LONG)
        assert set(caught.value.failures) == set(dead)
        await self.d.close()
        self.open = None
        self.deployment = await self.start()
        if self.latest is None:
            self.live, self.retired = {}, {}
            self.note("no checkpoint yet: every episode starts over")
            return
        folder, snapshot = self.latest
        if self.rng.random() < 0.3:  # restores refused as a whole change nothing: the same processes restore next
            await self.refused_restores(folder, snapshot)
        if self.rng.random() < 0.3:  # a restore that fails on one participant installs nothing anywhere
            self.agent().fail_install = True
            with pytest.raises(CoordinationError):
                await self.d.controller.restore(self.new_id("restore"), folder, [e.key for e in snapshot.values()])
            await self.check_failed_restore(self.d)
            self.note(f"restore of {folder.name} failed on agent/a: everyone open, nothing installed")
            await self.d.close()
            self.deployment = await self.start()
        restore_id = self.new_id("restore")
        await self.d.controller.restore(restore_id, folder, [e.key for e in snapshot.values()])
        await self.check_restored(self.d, snapshot)
        self.events.clear()  # restores close all at once; only the resume has an order
        await self.d.controller.resume(restore_id)
        self.live = {r: replace(e, key=e.key.next(), running=False) for r, e in snapshot.items()}
        self.retired = {}
        self.note(f"restored {folder.name}: {len(self.live)} episodes continue as the next attempt")

    async def refused_restores(self, folder: Path, snapshot: dict[str, Episode]) -> None:
        """Restores of episodes the checkpoint does not hold, or of an attempt out of range, are refused
        whole: up front by the controller, and by every participant when the controller's check is
        bypassed (`sources` named by hand); every participant stays idle, open, empty and fresh."""
        keys = [e.key for e in snapshot.values()]
        ghost = EpisodeKey(f"ghost-{next(self.ids)}", self.rng.randint(0, 3))
        sources = index_sources(read_index(folder))
        cases: list[tuple[str, list[EpisodeKey], Any, type[Exception], str]] = [
            ("not held", [*keys, ghost], None, NotFound, "holds no episode"),
            ("attempt 2^32-1", [*keys, EpisodeKey("big", 2**32 - 1)], None, InvalidArgument, "attempt"),
            ("not held, past the controller", [*keys, ghost], sources, CoordinationError, "holds no episode"),
        ]
        for label, episodes, named, error, says in self.rng.sample(cases, self.rng.randint(1, len(cases))):
            with pytest.raises(error, match=says) as caught:
                await self.d.controller.restore(self.new_id("bad"), folder, self.rng.sample(episodes, len(episodes)),
                                                sources=named)  # fmt: skip
            if isinstance(caught.value, CoordinationError):
                assert set(caught.value.failures) == set(NAMES), caught.value
                assert {type(e) for e in caught.value.failures.values()} == {NotFound}, caught.value
            await self.check_failed_restore(self.d)
            for name, status in (await self.d.statuses()).items():
                assert not status.retired, f"{name} fenced attempts after a restore refused as a whole"
                assert self.d.nodes[name].participant.not_fresh() is None, f"{name} is no longer fresh"
            self.note(f"restore of {folder.name} refused ({label}): nothing changed")

    # -- invariants --------------------------------------------------------------------------

    @staticmethod
    def manifest(folder: Path, name: str) -> Path:
        kind, instance = name.split("/")
        return folder / kind / instance / store_module.MANIFEST

    def after_resume(self, folder: Path) -> None:
        """Remember which participants of a resumed checkpoint had no manifest: they never may."""
        for name in NAMES:
            if not self.manifest(folder, name).exists():
                self.never.add((folder, name))

    async def committed(self, folder: Path, manifests: dict[str, Any], snapshot: dict[str, Episode]) -> None:
        scope = {e.key for e in snapshot.values()}
        assert sorted(manifests) == sorted(NAMES)
        for name, manifest in manifests.items():
            stored = {EpisodeKey.of(e) for e in manifest.episode_ids}
            assert stored <= scope, f"{name} committed episodes outside the scope: {stored - scope}"
        self.latest = (folder, snapshot)
        fresh = await self.start(watch=False)  # every committed checkpoint restores into a fresh deployment
        try:
            restore_id = self.new_id("verify")
            await fresh.controller.restore(restore_id, folder, sorted(scope))
            await self.check_restored(fresh, snapshot)
            await fresh.controller.resume(restore_id)
        finally:
            await fresh.close()

    async def check_restored(self, deployment: Deployment, snapshot: dict[str, Episode]) -> None:
        """Each episode is back as the next attempt, exactly at its boundary, and only where it lived."""
        statuses = await deployment.statuses()
        assert {s.phase for s in statuses.values()} == {Phase.RESTORED}
        agent = self.agent(deployment)
        assert agent.steps == {e.key.next(): e.steps for e in snapshot.values()}
        for name in MODELS:
            ledger = deployment.nodes[name].participant.ledger
            for episode in snapshot.values():
                rows = len(ledger.rows(episode.key.next()))
                assert rows == (episode.steps if episode.model == name else 0), (name, episode, rows)
        for name in RESOURCES:
            live = deployment.nodes[name].servicer.host.live()
            expected = {e.key.rollout_id: e for e in snapshot.values() if e.resources == name}
            assert sorted(live) == sorted(expected), (name, sorted(live))
            for session_id, slot in live.items():
                episode = expected[session_id]
                assert (slot.episode.rollout_id, slot.episode.attempt) == episode.key.next()
                assert slot.session.count == episode.steps, (name, episode, slot.session.count)

    async def check_failed_restore(self, deployment: Deployment) -> None:
        for name, status in (await deployment.statuses()).items():
            assert status.phase == Phase.IDLE, f"{name} is {Phase(status.phase).name} after a failed restore"
        for name, node in deployment.nodes.items():
            assert node.participant.admission.is_open, f"{name} is closed after a failed restore"
        assert not self.agent(deployment).steps
        for name in RESOURCES:
            assert not deployment.nodes[name].servicer.host.live(), f"{name} kept restored sessions"
        for name in MODELS:
            assert not deployment.nodes[name].participant.ledger.episodes(), f"{name} kept restored ledger rows"

    async def check_refused(self, key: EpisodeKey) -> None:
        """Every participant marks the attempt, and its data-plane calls are refused everywhere."""
        for name, status in (await self.d.statuses()).items():
            assert status.retired.get(key.rollout_id, -1) >= key.attempt, f"{name} does not fence {key}"
        for name in RESOURCES:
            with pytest.raises(GymrpcError) as caught:
                await self.d.increment(name, key, "late")
            assert caught.value.reason == "STALE_ATTEMPT", (name, caught.value)
        for name in MODELS:
            with pytest.raises(GymrpcError) as caught:
                await self.d.generate(name, key, 99)
            assert caught.value.reason == "STALE_ATTEMPT", (name, caught.value)
        with pytest.raises(GymrpcError) as caught:
            self.agent().track(key)
        assert caught.value.reason == "STALE_ATTEMPT"

    async def check(self, action: str) -> None:
        statuses = await self.d.statuses()
        phases = {name: Phase(s.phase) for name, s in statuses.items()}
        if set(phases.values()) == {Phase.IDLE}:
            for name, node in self.d.nodes.items():
                assert node.participant.admission.is_open, f"{name} is closed although every participant is idle"
        if self.open is None:
            assert set(phases.values()) == {Phase.IDLE}, phases
        closes = [PREPARE_ORDER.index(k) for op, k in self.events if op == "close"]
        opens = [RESUME_ORDER.index(k) for op, k in self.events if op == "open"]
        if action in ("checkpoint", "prepare"):
            assert closes == sorted(closes), f"prepare closed out of order: {self.events}"
        if not self.nonstop:  # a non-stop checkpoint (this step's, at "end" the last one's) reopens as members capture
            assert opens == sorted(opens), f"resume reopened out of order: {self.events}"
        for index, (op, kind) in enumerate(self.events):
            if op == "open":  # a callee reopened before a caller captured would hand it held replies
                late = [k for o, k in self.events[index:] if o == "capture" and k in CALLERS[kind]]
                assert not late, f"{kind.name} reopened before its callers {late} captured: {self.events}"
        retires = [RETIRE_STAGE[k] for op, k in self.events if op == "retire"]
        assert retires == sorted(retires), f"retire reached a callee before its callers: {self.events}"
        for name, status in statuses.items():
            for rollout, attempt in self.retired.items():
                assert status.retired.get(rollout, -1) >= attempt, f"{name} lost the mark of {rollout}"
        for manifest in self.root.glob("*/*/*/manifest.json"):
            if manifest not in self.verified:  # manifests are create-only: one full read each
                kind, instance = manifest.parent.parent.name, manifest.parent.name
                store_module.read_checkpoint(manifest.parents[2], Kind[kind.upper()], f"{kind}/{instance}")
                self.verified.add(manifest)
        for folder in self.unpublished:
            assert not (folder / INDEX).exists(), f"{folder.name} was indexed after its publish failed"
        for folder, name in self.never:
            assert not self.manifest(folder, name).exists(), (
                f"{name} published a manifest for {folder.name} after it was resumed without one"
            )

    async def run(self, steps: int) -> None:
        self.deployment = await self.start()
        try:
            for _ in range(steps):
                await self.step()
            self.writes.settle()
            await self.check("end")
        finally:
            self.writes.settle()
            await self.d.close()
            self.deployment = None
            gc.collect()  # stopped grpc.aio servers must be collected while their loop still runs


@contextlib.contextmanager
def report(sim: Simulation) -> Iterator[None]:
    try:
        yield
    except BaseException as exc:
        steps = "\n".join(sim.log[-60:])
        raise AssertionError(f"simulation seed {sim.seed} failed: {exc!r}\nsteps:\n{steps}") from exc


def simulate(seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steps: int = STEPS) -> None:
    root = tmp_path / f"seed{seed}"
    root.mkdir()
    sim = Simulation(seed, root, Writes(monkeypatch))
    with report(sim):
        asyncio.run(asyncio.wait_for(sim.run(steps), 900))  # a hang, not a slow machine, ends here


def _seeds() -> list[int]:
    if "SIM_SEED" in os.environ:
        return [int(os.environ["SIM_SEED"])]
    return list(range(FAST_SEEDS))


@pytest.mark.parametrize("seed", _seeds())
def test_simulation(seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    simulate(seed, tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(FAST_SEEDS, FAST_SEEDS + SLOW_SEEDS))
def test_simulation_slow(seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    simulate(seed, tmp_path, monkeypatch, steps=2 * STEPS)


def test_an_empty_commit_scope_commits_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        deployment = await Deployment.start(["model/m0", "resources/r0"])
        try:
            finished = EpisodeKey("done", 0)
            await deployment.seed("resources/r0", finished)
            await deployment.generate("model/m0", finished, 0)
            await deployment.close_session("resources/r0", finished)
            result = await deployment.controller.checkpoint(tmp_path, episode_ids=[], checkpoint_id="c1")
            assert {n: m.record_count for n, m in result.manifests.items()} == {"model/m0": 0, "resources/r0": 0}
            # No scope at all keeps the older meaning: every parked episode, finished ledgers included.
            result = await deployment.controller.checkpoint(tmp_path, checkpoint_id="c2")
            assert {n: m.record_count for n, m in result.manifests.items()} == {"model/m0": 1, "resources/r0": 0}
        finally:
            await deployment.close()

    asyncio.run(main())
