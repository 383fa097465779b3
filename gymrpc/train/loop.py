"""The reference GRPO loop, driven through gymrpc: collect, learn, push weights, checkpoint jointly.

One iteration k:

1. wait until batch k is complete (tasks x group size episodes, `gymrpc.rollouts.collect`);
2. start batch k+1 at once (with `max_lag` 1), still on the weights that produced batch k;
3. group-normalised advantages and one optimizer step on batch k (`Policy.step`);
4. save the weights as a safetensors folder and push them (`gymrpc.weights.update_weights`,
   `keep` mode): batch k+1's running generations continue on the new weights, so every token
   the next step trains on is at most one version behind the trainer;
5. every `checkpoint_every` iterations: a coordinated checkpoint of every episode of batch k+1
   in flight, with the trainer's state (weights, optimizer, data cursor, RNG, the episodes of
   batch k+1 already finished) written into the same folder before it is published.

An episode whose tokens came from weights the trainer never pushed (its model server was
restarted and came back with its start weights) is not trained on: the trainer pushes its
current weights again to that replica (`restore_weights`) and the episode runs again as the
next attempt (`reruns` in the metrics).

`resume` restores the newest published checkpoint into a fresh stack: the trainer loads its
state, the model server is given the weights it served then, the stack's episodes continue (or
restart) as attempt N+1, and batch k+1 is completed with the episodes that had not finished.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import secrets
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gymrpc.client import Client
from gymrpc.control.index import read_index
from gymrpc.control.trainer_state import TrainerState as StateRef
from gymrpc.control.trainer_state import read_trainer_state
from gymrpc.control.types import EpisodeKey
from gymrpc.controller import CoordinationError, new_checkpoint_id
from gymrpc.errors import DeadlineExceeded, FailedPrecondition, GymrpcError, Unavailable
from gymrpc.rollouts.checkpointing import CheckpointingRun, CheckpointKeeper, Saved
from gymrpc.rollouts.collector import EpisodeResult, collect
from gymrpc.rollouts.tasks import RolloutTask
from gymrpc.train.cursor import DataCursor
from gymrpc.train.samples import Sample, sample_of, versions_of, with_advantages
from gymrpc.train.state import Batch, Finished, StateError, TrainerState, read_state, write_state
from gymrpc.v1 import common_pb2
from gymrpc.weights import served_by_replica

METRICS = "metrics.csv"
BATCHES = "batches.jsonl"
PLOT = "reward.png"
METRIC_FIELDS = (
    "iteration",
    "reward",
    "solved",
    "episodes",
    "failed",
    "reruns",
    "informative_groups",
    "loss",
    "kl",
    "kl_ref",
    "clipped",
    "grad_norm",
    "trained_tokens",
    "max_lag",
    "weight_version",
    "update_s",
    "kept",
    "collect_s",
    "step_s",
    "elapsed_s",
)


@dataclass(frozen=True)
class TrainConfig:
    out: Path
    """Metrics, the reward curve, pushed weights, and the joint checkpoints (`out/checkpoints`)."""
    iterations: int = 20
    """The budget: iterations trained at most."""
    tasks_per_batch: int = 5
    group_size: int = 8
    concurrency: int = 64
    agent: str = "agent/simple"
    model: str = "model/policy"
    temperature: float = 1.0
    max_tokens: int = 64
    max_steps: int = 4
    max_lag: int = 1
    """1: the next batch runs while the step is taken and the weights pushed; 0: strictly on-policy."""
    update_mode: str = "keep"
    weight_transfer: str = "path"
    """How pushed weights reach the model server: `path` (it reads the saved folder), `stream` (the
    folder's files over gRPC) or `nccl` (the model's tensors through vLLM's NCCL weight-transfer
    engine, `gymrpc.weights.WeightTransfer`: GPU only, the model server started with
    `--weight-transfer nccl`)."""
    transfer_address: str = "127.0.0.1"
    """`nccl`: the address of this trainer the model server's workers reach for the rendezvous."""
    checkpoint_every: int = 0
    """Iterations between joint checkpoints; 0: none."""
    keep_checkpoints: int = 2
    target_reward: float | None = None
    """Stop as soon as a batch's mean reward reaches it."""
    seed: int = 0
    version_prefix: str = "grpo"
    scale_advantages: bool = True

    def compatible(self) -> dict[str, Any]:
        """What a resumed run must agree on with the one that saved the state."""
        return {"tasks_per_batch": self.tasks_per_batch, "group_size": self.group_size, "seed": self.seed}


@dataclass(frozen=True)
class GroupMember(RolloutTask):
    """Member `member` of a task's group: episode id `<prefix>-t<index>-r<member>` (run with repeats=1).

    One task per member, not `repeats`, so that each member has its own sampling seed."""

    member: int = 0

    def episode_id(self, repeat: int) -> str:
        return f"{self.prefix}-t{self.index}-r{self.member}"


def sampling_seed(seed: int, iteration: int, task: int, member: int) -> int:
    """A per-episode sampling seed: the group's members differ, a restarted episode draws alike."""
    return (seed * 1_000_003 + iteration * 10_007 + task * 101 + member) % (2**31 - 1)


@dataclass
class Progress:
    """What the command prints and plots; the loop only calls it."""

    line: Callable[[str], None] = print
    iteration: Callable[[dict[str, Any]], None] = lambda row: None


@dataclass
class Outcome:
    state: TrainerState
    reached: bool
    resumed_from: str | None = None
    checkpoints: list[str] = field(default_factory=list)


class JointCheckpoints(CheckpointingRun):
    """The collector's checkpoint bookkeeping, with the trainer's state registered in each checkpoint."""

    async def joint(self, snapshot: Callable[[], tuple[TrainerState, Callable[[Path], None]]]) -> Saved | None:
        """Checkpoint every episode in flight; `snapshot()` is taken at the same instant as the scope.

        The trainer's folder is written first, inside the checkpoint's folder, then registered in
        the index by the controller's commit; LATEST moves only once both are there.
        """
        async with self._lock:
            scope = [EpisodeKey(r, a) for r, a in sorted(self.in_flight.items())]
            state, save_policy = snapshot()  # no await in between: nothing finishes unseen
            checkpoint_id = new_checkpoint_id()
            trainer = await asyncio.to_thread(write_state, self.keeper.root / checkpoint_id, state, save_policy)
            try:
                result = await self.controller.checkpoint(
                    self.keeper.root,
                    episode_ids=scope,
                    checkpoint_id=checkpoint_id,
                    timeout=self.timeout,
                    trainer_state=StateRef(str(trainer), label=f"iteration {state.iteration}"),
                )
            except (CoordinationError, GymrpcError) as exc:
                print(f"gymrpc train: checkpoint failed: {exc}", flush=True)
                return None
            if not result.committed:
                print("gymrpc train: checkpoint skipped: episodes were not parked in time", flush=True)
                return None
            saved = self.keeper.publish(result)  # LATEST last: only a whole joint checkpoint is ever named
            self.taken += 1
            return saved


def trainer_folder(checkpoint: Path) -> tuple[Path, dict[str, str]]:
    """The trainer state a joint checkpoint's index registered (checked), and the weights it names."""
    index = read_index(checkpoint)
    ref = read_trainer_state(index)
    if ref is None:
        raise StateError(f"checkpoint {checkpoint} registers no trainer state: it was not taken by a trainer")
    return Path(ref.uri), dict(index.weight_versions)


class Trainer:
    def __init__(
        self,
        config: TrainConfig,
        client: Client,
        policy: Any,
        tasks: Sequence[RolloutTask],
        progress: Progress | None = None,
    ) -> None:
        self.config = config
        self.client = client
        self.policy = policy
        self.tasks = list(tasks)
        self.progress = progress or Progress()
        self.keeper = CheckpointKeeper(config.out / "checkpoints", config.keep_checkpoints)
        self.joint = JointCheckpoints(client, self.keeper)
        self.started = time.monotonic()
        self.process_nonce = secrets.token_hex(4)
        """In every push's request id: a retry of a push is idempotent, while a push by a resumed or
        another trainer (same version name, maybe other weights) never collides with an old one."""
        self.transfer: Any = None
        """`weight_transfer="nccl"`: the group with the model server, opened at the first push."""
        self._weights_lock = asyncio.Lock()
        """Held while weights are pushed: a push and a restore (`restore_weights`) never overlap."""
        self.restores = 0
        self.served_folder: Path | None = None
        """The folder of the weights the model server was last given (what a restore pushes again)."""
        self._reruns: dict[int, int] = {}
        """Batch iteration -> its episodes run again because weights this trainer did not push made tokens."""

    # -- setup ---------------------------------------------------------------------------------

    async def start(self, resume: bool) -> tuple[TrainerState, str | None]:
        """A fresh state (the start weights pushed as version 0), or the newest joint checkpoint's."""
        self.config.out.mkdir(parents=True, exist_ok=True)
        saved = self.keeper.latest() if resume else None
        if saved is None:
            if resume:
                self.progress.line("gymrpc train: no joint checkpoint to resume from; starting at iteration 0")
            state = TrainerState(
                run_id=secrets.token_hex(3),
                iteration=0,
                weight_version="",
                updates=0,
                cursor=DataCursor(len(self.tasks), self.config.seed),
                batch=None,
                config=self.config.compatible(),
            )
            await self.push(state, self.policy.save_weights(self._weights_dir(state.updates)))
            await self.joint.open(False, set())
            return state, None
        folder, served = await asyncio.to_thread(trainer_folder, saved.folder)
        state = await asyncio.to_thread(read_state, folder)
        if served.get(self.config.model, state.weight_version) != state.weight_version:
            raise StateError(
                f"{saved.folder}: the model server served {served[self.config.model]}, "
                f"the trainer state holds {state.weight_version}"
            )
        if state.config != self.config.compatible():
            raise StateError(f"{saved.folder} was saved by a run with {state.config}, not {self.config.compatible()}")
        if state.cursor.size != len(self.tasks):
            raise StateError(
                f"{saved.folder} was saved for {state.cursor.size} tasks, the task list has {len(self.tasks)}"
            )
        await asyncio.to_thread(self.policy.load_state, folder)
        # The model server serves what it served at the checkpoint before any episode continues. A
        # stack that outlived the trainer may serve it already: only the replicas that do not are given it.
        self.served_folder = folder / "weights"
        if missing := await self._serving_other(state.weight_version):
            await self._update(self.served_folder, state.weight_version, endpoints=sorted(missing))
        done = set(state.batch.finished) if state.batch is not None else set()
        await self.joint.open(True, done)
        self._write_files(state)
        return state, saved.checkpoint_id

    # -- weights -------------------------------------------------------------------------------

    def _weights_dir(self, number: int) -> Path:
        return self.config.out / "weights" / f"{number:05d}"

    async def push(self, state: TrainerState, folder: Path) -> tuple[float, int]:
        """Push `folder` as the next version; returns (seconds, generations kept) and prunes old folders."""
        version = f"{self.config.version_prefix}:{state.updates}"
        started = time.monotonic()
        async with self._weights_lock:
            reply = await self._update(folder, version)
            state.weight_version, state.updates, self.served_folder = version, state.updates + 1, folder
        for old in sorted((self.config.out / "weights").iterdir())[:-2]:  # the served one and the one before
            await asyncio.to_thread(_rmtree, old)
        return time.monotonic() - started, int(getattr(reply, "generations_kept", 0))

    async def restore_weights(self, state: TrainerState) -> None:
        """Push the served version again to each replica that serves other weights now.

        A model server restarted by its supervisor comes back with the weights it started from, and
        every token it makes then is another policy's. Only the folder is read, so a step in progress
        is not waited for. An NCCL group does not survive the restart: the run stops with the reason.
        """
        async with self._weights_lock:
            lost = await self._serving_other(state.weight_version)
            if not lost:
                return
            where = ", ".join(f"{endpoint} serves {version!r}" for endpoint, version in sorted(lost.items()))
            if self.config.weight_transfer == "nccl":
                raise FailedPrecondition(
                    f"{self.config.model} lost the weights {state.weight_version!r} ({where}): its NCCL group did "
                    "not survive the restart; resume from the last joint checkpoint (`gymrpc train run --resume`)",
                    reason="WEIGHTS_LOST",
                    metadata={"model": self.config.model, "weight_version": state.weight_version},
                )
            self.restores += 1
            self.progress.line(
                f"gymrpc train: {self.config.model} restarted ({where}); pushing {state.weight_version} again"
            )
            assert self.served_folder is not None  # set by the first push, or by a resume
            await self._update(
                self.served_folder,
                state.weight_version,
                endpoints=sorted(lost),
                request_id=f"train-{self.process_nonce}-{state.weight_version}-restore{self.restores}",
            )

    async def _serving_other(self, version: str) -> dict[str, str]:
        """The model server's replicas that serve another version than `version`, with the one they serve."""
        served = await served_by_replica(self.client, self.config.model)
        return {endpoint: other for endpoint, other in served.items() if other != version}

    def foreign_versions(self, trajectory: Any) -> list[str]:
        """The weight versions in `trajectory` this trainer never pushed (unnamed spans are not counted)."""
        prefix = self.config.version_prefix
        return sorted({v for v in versions_of(trajectory) if v and version_number(v, prefix) is None})

    async def _rerun_foreign(self, state: TrainerState, batch: Batch, result: EpisodeResult) -> bool:
        """True (run it again, as the next attempt) when weights this trainer did not push made its tokens."""
        assert result.trajectory is not None
        if not self.foreign_versions(result.trajectory):
            return False
        try:
            await self.restore_weights(state)
        except (Unavailable, DeadlineExceeded) as exc:  # the replica is not back yet: the next try checks again
            self.progress.line(f"gymrpc train: could not check the weights {self.config.model} serves: {exc}")
        rollout_id = result.episode_id
        self.joint.attempts[rollout_id] = result.attempt + 1
        self.joint.started(rollout_id)  # in flight again, as the next attempt
        self._reruns[batch.iteration] = self._reruns.get(batch.iteration, 0) + 1
        return True

    async def _update(
        self, folder: Path, version: str, *, endpoints: Sequence[str] | None = None, request_id: str | None = None
    ) -> Any:
        """Push the weights: the folder (`path`, `stream`), or the policy's tensors, which are the folder's (`nccl`)."""
        from gymrpc.weights import WeightTransfer, update_weights

        request_id = request_id or f"train-{self.process_nonce}-{version}"
        if self.config.weight_transfer == "nccl":
            if self.transfer is None:
                self.transfer = await WeightTransfer.open(
                    self.client, self.config.model, master_address=self.config.transfer_address
                )
            mode = self.config.update_mode
            return await self.transfer.send(
                self.policy.model, weight_version=version, mode=mode, request_id=request_id, timeout=300
            )
        source = {"stream_from": folder} if self.config.weight_transfer == "stream" else {"path": str(folder)}
        return await update_weights(
            self.client,
            self.config.model,
            weight_version=version,
            mode=self.config.update_mode,
            request_id=request_id,
            timeout=300,
            endpoints=endpoints,
            **source,  # `folder` is under `out`, which is absolute
        )

    async def close(self) -> None:
        if self.transfer is not None:
            transfer, self.transfer = self.transfer, None
            await transfer.close()

    # -- batches -------------------------------------------------------------------------------

    def draw(self, state: TrainerState, iteration: int) -> Batch:
        return Batch(iteration, state.cursor.take(self.config.tasks_per_batch), self.config.group_size)

    def _members(self, state: TrainerState, batch: Batch) -> list[GroupMember]:
        out = []
        for index in batch.tasks:
            base = self.tasks[index].task
            for member in range(batch.group_size):
                task = common_pb2.Task()
                task.CopyFrom(base)
                task.sampling.temperature = self.config.temperature
                task.sampling.top_p = 1.0
                task.sampling.max_tokens = self.config.max_tokens
                task.sampling.seed = sampling_seed(self.config.seed, batch.iteration, index, member)
                out.append(GroupMember(index, task, f"{state.run_id}-i{batch.iteration}", member=member))
        return out

    async def collect(self, state: TrainerState, batch: Batch) -> float:
        """Run every episode of `batch` not finished yet; returns the seconds it took."""
        started = time.monotonic()
        members = {m.episode_id(0): m for m in self._members(state, batch)}

        def on_start(task: RolloutTask, repeat: int) -> None:
            self.joint.started(task.episode_id(repeat))

        def on_result(result: EpisodeResult) -> None:
            rollout_id = result.episode_id
            self.joint.finished(rollout_id)
            member = members[rollout_id]
            attempt = self.joint.attempts.get(rollout_id, 0)
            if result.trajectory is None:
                batch.failed[rollout_id] = str(result.error)
                return
            foreign = self.foreign_versions(result.trajectory)
            if foreign:  # still, after its reruns: never trained on
                batch.failed[rollout_id] = f"weights this trainer did not push made its tokens: {', '.join(foreign)}"
                return
            batch.add(Finished(rollout_id, member.index, member.member, attempt, result.trajectory))

        await collect(
            self.client,
            list(members.values()),
            agent=self.config.agent,
            concurrency=self.config.concurrency,
            max_steps=self.config.max_steps,
            skip=set(batch.finished),
            attempts=self.joint.attempts,
            on_start=on_start,
            on_result=on_result,
            rerun=lambda result: self._rerun_foreign(state, batch, result),
        )
        return time.monotonic() - started

    # -- the loop ------------------------------------------------------------------------------

    async def run(self, resume: bool = False) -> Outcome:
        state, resumed_from = await self.start(resume)
        outcome = Outcome(state, False, resumed_from)
        if resumed_from is not None:
            self.progress.line(
                f"resumed from {resumed_from}: iteration {state.iteration}, weights {state.weight_version}, "
                f"{len(state.batch.finished) if state.batch else 0} episodes of the batch already finished, "
                f"{len(self.joint.continued)} continued, {len(self.joint.restarted)} restarted"
            )
        if state.iteration >= self.config.iterations:
            return outcome
        if state.batch is None:
            state.batch = self.draw(state, state.iteration)
        collecting = asyncio.create_task(self.collect(state, state.batch))
        try:
            while True:
                batch = state.batch
                collect_s = await collecting
                last = batch.iteration + 1 >= self.config.iterations
                samples = self._samples(batch)
                reward = statistics.fmean(s.reward for s in samples) if samples else 0.0
                reached = self.config.target_reward is not None and reward >= self.config.target_reward
                following = None
                if not (last or reached) and self.config.max_lag >= 1:
                    following = self.draw(state, batch.iteration + 1)
                    collecting = asyncio.create_task(self.collect(state, following))
                await self._learn(state, batch, samples, collect_s)
                if reached:
                    outcome.reached = True
                if last or reached:
                    state.batch = None
                    state.iteration = batch.iteration + 1
                    break
                if following is None:
                    following = self.draw(state, batch.iteration + 1)
                    collecting = asyncio.create_task(self.collect(state, following))
                state.iteration, state.batch = batch.iteration + 1, following
                every = self.config.checkpoint_every
                if every and state.iteration % every == 0:
                    saved = await self.joint.joint(lambda: (self._snapshot(state), self.policy.save_state))
                    if saved is not None:
                        outcome.checkpoints.append(saved.checkpoint_id)
                        self.progress.line(
                            f"checkpoint {saved.checkpoint_id}: iteration {state.iteration}, "
                            f"weights {state.weight_version}, {len(saved.continued)} episodes continued from it"
                        )
        finally:
            if not collecting.done():
                collecting.cancel()
                await asyncio.gather(collecting, return_exceptions=True)
        return outcome

    def _samples(self, batch: Batch) -> list[Sample]:
        samples = []
        for episode_id, done in sorted(batch.finished.items()):
            if done.trajectory.mask_sample:
                continue
            samples.append(sample_of(episode_id, str(done.task_index), done.trajectory))
        return samples

    def _snapshot(self, state: TrainerState) -> TrainerState:
        """A copy of `state` that later results cannot change (the batch's finished episodes as of now)."""
        copy = TrainerState.from_json(json.loads(json.dumps(state.to_json())))
        if state.batch is not None and copy.batch is not None:
            copy.batch.finished = dict(state.batch.finished)
        return copy

    async def _learn(self, state: TrainerState, batch: Batch, samples: list[Sample], collect_s: float) -> dict:
        samples = with_advantages(samples, scale=self.config.scale_advantages)
        trained_on = state.updates - 1  # the version the trainer's weights are now
        started = time.monotonic()
        stats = await asyncio.to_thread(self.policy.step, samples)
        step_s = time.monotonic() - started
        folder = await asyncio.to_thread(self.policy.save_weights, self._weights_dir(state.updates))
        update_s, kept = await self.push(state, folder)
        rewards = [s.reward for s in samples]
        groups: dict[str, list[float]] = {}
        for s in samples:
            groups.setdefault(s.group, []).append(s.reward)
        row = {
            "iteration": batch.iteration,
            "reward": round(statistics.fmean(rewards), 4) if rewards else 0.0,
            "solved": sum(r >= 1.0 for r in rewards),
            "episodes": len(rewards),
            "failed": len(batch.failed),
            "reruns": self._reruns.pop(batch.iteration, 0),
            "informative_groups": sum(len(set(g)) > 1 for g in groups.values()),
            "loss": round(stats.loss, 6),
            "kl": round(stats.kl, 6),
            "kl_ref": round(stats.kl_ref, 6),
            "clipped": round(stats.clipped, 4),
            "grad_norm": round(stats.grad_norm, 4),
            "trained_tokens": stats.trained_tokens,
            "max_lag": max((lag(s, trained_on, self.config.version_prefix) for s in samples), default=0),
            "weight_version": state.weight_version,
            "update_s": round(update_s, 3),
            "kept": kept,
            "collect_s": round(collect_s, 3),
            "step_s": round(step_s, 3),
            "elapsed_s": round(time.monotonic() - self.started, 1),
        }
        state.metrics.append(row)
        state.batches.append(
            {
                "iteration": batch.iteration,
                "tasks": batch.tasks,
                "episodes": [
                    {"episode_id": d.episode_id, "attempt": d.attempt, "reward": d.trajectory.reward}
                    for d in sorted(batch.finished.values(), key=lambda d: d.episode_id)
                ],
                "failed": sorted(batch.failed),
            }
        )
        self._write_files(state)
        self.progress.line(progress_line(row, self.config.iterations))
        self.progress.iteration(row)
        return row

    def _write_files(self, state: TrainerState) -> None:
        """metrics.csv and batches.jsonl as the state has them (a resumed run drops what it redoes)."""
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=METRIC_FIELDS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(state.metrics)
        _write_atomic(self.config.out / METRICS, text.getvalue())
        _write_atomic(self.config.out / BATCHES, "".join(json.dumps(b) + "\n" for b in state.batches))


def lag(sample: Sample, current: int, prefix: str) -> int:
    """Versions between the trainer's weights (`current`) and the oldest that produced `sample`'s tokens."""
    numbers = [version_number(v, prefix) for v in sample.versions]
    known = [n for n in numbers if n is not None]
    return current - min(known) if known else 0


def version_number(version: str, prefix: str) -> int | None:
    head, _, number = version.rpartition(":")
    return int(number) if head == prefix and number.isdigit() else None


def progress_line(row: dict[str, Any], iterations: int) -> str:
    rerun = f", {row['reruns']} rerun" if row.get("reruns") else ""
    return (
        f"iter {row['iteration'] + 1:>3}/{iterations}  reward {row['reward']:.3f} "
        f"({row['solved']}/{row['episodes']}{rerun})  groups {row['informative_groups']} informative  "
        f"loss {row['loss']:+.4f}  kl {row['kl']:+.4f}  clip {row['clipped']:.2f}  lag {row['max_lag']}  "
        f"-> {row['weight_version']} ({row['update_s']:.2f}s, {row['kept']} kept)  "
        f"collect {row['collect_s']:.1f}s  step {row['step_s']:.1f}s"
    )


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
