"""`gymrpc demo`: the main job in one command, with no GPU and no downloads.

Starts the embedded default stack in a fresh run folder, with every agent checkpointing its episodes
at each boundary (`--resume-dir`, one folder per agent), collects rollouts of the counter and
blackjack example tasks, and SIGKILLs servers mid-run: by default the model server a third of the
way through and `agent/counter` at two thirds, once one of its episodes in flight is checkpointed
mid-run. The supervisor brings each back on a new port under the same name; model calls are
idempotent and retried by name, and the episodes the killed agent held continue on its new process
from their last checkpoint (`resume_count`), not from the start. Every episode completes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gymrpc import logs, rundir

if TYPE_CHECKING:  # the command line imports this module; the stack's modules load only when it runs
    from gymrpc.launch.local import LocalLauncher, ServerState
    from gymrpc.launch.spec import StackSpec
    from gymrpc.rollouts import Progress, RolloutTask, Summary

DEFAULT_DIR = Path(".gymrpc") / "demo"
MARKER = "demo.json"
KILLABLE = ("model/policy", "agent/counter", "agent/blackjack")
"""Servers whose death costs no episode: model calls and whole `Run`s are retried by name."""
ENVS = ("counter", "blackjack")
POLICY_VERSION = "demo-policy-1"
"""The weights every episode runs with: a resumed episode continues only under the same version."""
MAX_SOCKET_PATH = 100


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=4, help="episodes per example task (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=8, help="episodes at once per env (default %(default)s)")
    parser.add_argument(
        "--kill",
        default="model/policy,agent/counter",
        type=_kill_list,
        help=f"servers to SIGKILL, spread over the run, comma-separated from {', '.join(KILLABLE)}, "
        "or none (default %(default)s)",
    )
    model = parser.add_argument_group("a real model instead of the scripted policy (needs vLLM; see README)")
    model.add_argument("--model-path", help="serve model/policy with vLLM from this HF model directory")
    model.add_argument("--dtype", help="bfloat16 on a GPU, float32 on a CPU (default: vLLM's auto)")
    model.add_argument("--tensor-parallel-size", type=int, help="GPUs for the model")
    model.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    model.add_argument("--kv-cache-gib", type=float, help="KV cache size in GiB")


def _kill_list(text: str) -> list[str]:
    names = [] if text == "none" else [n.strip() for n in text.split(",") if n.strip()]
    if unknown := [n for n in names if n not in KILLABLE]:
        raise argparse.ArgumentTypeError(f"cannot kill {', '.join(unknown)}: choose from {', '.join(KILLABLE)} or none")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError("each server at most once")
    return names


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.concurrency < 1:
        print("gymrpc demo: --repeats and --concurrency must be at least 1", file=sys.stderr)
        return 2
    try:
        run_dir = _fresh_run_dir(Path(args.run_dir) if args.run_dir else DEFAULT_DIR)
    except RuntimeError as exc:
        print(f"gymrpc demo: {exc}", file=sys.stderr)
        return 2
    handler = logging.FileHandler(run_dir / "launcher.log")
    handler.setFormatter(logs.JsonFormatter("demo"))
    logging.getLogger().handlers[:] = [handler]  # server restarts are the story; log them to a file
    logging.getLogger().setLevel(logging.INFO)
    try:
        return asyncio.run(_demo(run_dir, args))
    except KeyboardInterrupt:
        print("gymrpc demo: interrupted; the stack was stopped", file=sys.stderr)
        return 130
    except RuntimeError as exc:  # the stack did not start: the message carries the server's log tail
        print(f"gymrpc demo: {exc}", file=sys.stderr)
        return 1


def _fresh_run_dir(wanted: Path) -> Path:
    """`wanted`, emptied if an earlier demo left it; a temp folder if its socket path would be too long."""
    run_dir = wanted.absolute()
    if len(str(rundir.registry_socket(run_dir))) > MAX_SOCKET_PATH:
        return Path(tempfile.mkdtemp(prefix="gymrpc-demo-"))
    if run_dir.exists() and any(run_dir.iterdir()):
        if not (run_dir / MARKER).exists():
            raise RuntimeError(f"{run_dir} exists and was not made by `gymrpc demo`; pick another --run-dir")
        _check_not_running(run_dir)
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / MARKER).write_text(json.dumps({"created_at": time.time()}) + "\n")
    return run_dir


def _check_not_running(run_dir: Path) -> None:
    lock = run_dir / "launcher.lock"
    if not lock.exists():
        return
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RuntimeError(f"a stack is running in {run_dir}; stop it with `gymrpc down --run-dir {run_dir}`") from None
    finally:
        os.close(fd)


@dataclass
class _Kill:
    """The crash we inflict, and what the supervisor did about it."""

    name: str
    at_done: int
    """Episodes done (of `env`'s agent, or of all) when it dies."""
    env: str | None = None
    pid: int | None = None
    address: str | None = None
    in_flight: int = 0
    killed_at: float = 0.0
    restarted: asyncio.Event = field(default_factory=asyncio.Event)
    watcher: asyncio.Task[None] | None = None
    waiting: asyncio.Task[None] | None = None
    """An agent's kill, due, waiting for one of its episodes in flight to be checkpointed mid-run."""


async def _demo(run_dir: Path, args: argparse.Namespace) -> int:
    import gymrpc.envs.blackjack
    import gymrpc.envs.counter
    from gymrpc.client import Client
    from gymrpc.launch.local import LocalLauncher
    from gymrpc.launch.spec import load_stack_spec, with_vllm_model
    from gymrpc.rollouts import EpisodeResult, Progress, ResultWriter, Summary, collect, load_tasks

    say(f"gymrpc demo: run folder {_short(run_dir)}")
    spec = _with_resume_dirs(load_stack_spec(None), run_dir)
    if args.model_path:
        engine = {k: getattr(args, k) for k in ("dtype", "tensor_parallel_size", "max_model_len", "kv_cache_gib")}
        spec = with_vllm_model(spec, args.model_path, **engine)
    launcher = LocalLauncher(spec, run_dir)
    started = time.perf_counter()
    model = f"vLLM serving {args.model_path}" if args.model_path else "the scripted policy"
    say(f"starting the embedded default stack ({model}) ...")
    try:
        await launcher.start()
        say(f"{len(launcher.server_states())} servers serving in {time.perf_counter() - started:.1f} s:")
        for s in launcher.server_states():
            say(f"  {s.name:<20} {s.address}  (pid {s.pid})")
        paths = {
            "counter": gymrpc.envs.counter.example_tasks_path(),
            "blackjack": gymrpc.envs.blackjack.example_tasks_path(),
        }
        tasks = {env: load_tasks(paths[env], prefix=env) for env in ENVS}
        total = sum(len(t) for t in tasks.values()) * args.repeats
        plan = ", ".join(f"{env} {len(t)} tasks x {args.repeats}" for env, t in tasks.items())
        say(f"collecting {total} episodes ({plan}), {args.concurrency} at once per agent")
        out = run_dir / "results.jsonl"
        writer, progress = ResultWriter(out), Progress(total, sys.stdout, interval=2.0)
        kills = []
        for i, name in enumerate(args.kill):
            # An agent dies when its own episodes are in flight (the rest of its share still runs).
            env = name.partition("/")[2] if name.startswith("agent/") else None
            planned = len(tasks[env]) * args.repeats if env else total
            kills.append(_Kill(name, at_done=max(planned * (i + 1) // (len(args.kill) + 1), 1), env=env))
        results: dict[str, list[EpisodeResult]] = {env: [] for env in ENVS}
        flying: dict[str, set[str]] = {env: set() for env in ENVS}
        """Episode ids in flight, by env."""

        def on_start(task: RolloutTask, repeat: int) -> None:
            episode = task.episode_id(repeat)
            flying[episode.partition("-")[0]].add(episode)

        def on_result(result: EpisodeResult) -> None:
            env = result.agent.partition("/")[2]
            flying[env].discard(result.task.episode_id(result.repeat))
            writer.write(result.to_json())
            results[env].append(result)
            progress.update(result)
            for kill in kills:
                done = len(results[kill.env]) if kill.env else progress.done
                if kill.pid is not None or kill.waiting is not None or done < kill.at_done:
                    continue
                if kill.env is None:
                    _inflict(launcher, kill, sum(map(len, flying.values())), progress)
                else:
                    store = _resume_dir(run_dir, kill.name)
                    kill.waiting = asyncio.get_running_loop().create_task(
                        _inflict_mid_episode(launcher, kill, store, flying, progress)
                    )

        t0 = time.perf_counter()
        async with Client(run_dir=run_dir) as client:
            await asyncio.gather(
                *(
                    collect(
                        client,
                        tasks[env],
                        agent=f"agent/{env}",
                        concurrency=args.concurrency,
                        repeats=args.repeats,
                        policy_version=POLICY_VERSION,
                        on_start=on_start,
                        on_result=on_result,
                    )
                    for env in ENVS
                )
            )
        wall = time.perf_counter() - t0
        writer.close()
        progress.close()
        for kill in kills:
            if kill.waiting is not None:
                await kill.waiting
        for kill in kills:
            if kill.watcher is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(kill.watcher, timeout=30)
        everything = [r for env in ENVS for r in results[env]]
        summary = Summary(everything, wall, total)
        say(f"results ({_short(out)}, {writer.written} lines):")
        for env in ENVS:
            say("  " + _env_line(env, Summary(results[env], wall, len(tasks[env]) * args.repeats)))
        p = summary.to_json()
        say(
            f"  {'all':<10} {len(summary.ok)}/{total} completed, {len(summary.failed)} failed, in {wall:.2f} s"
            f" = {p['episodes_per_s']:.1f} episodes/s; latency p50 {p['latency_p50_s']:.3f} s"
            f", p95 {p['latency_p95_s']:.3f} s"
        )
        for line in summary.lines()[1:]:
            if line.startswith(("failures", "  ")):
                say("  " + line)
        resumed = [r for r in summary.ok if r.trajectory is not None and r.trajectory.resume_count]
        restarted = [r for r in summary.ok if r.trajectory is not None and r.trajectory.restart_count]
        say(
            f"  {'resume':<10} {len(resumed)} episodes continued from their last checkpoint after a crash,"
            f" {len(restarted)} started over"
        )
        say("the stack after the run, as `gymrpc status` shows it:")
        say(await _status_table(run_dir))
    finally:
        stopping = time.perf_counter()
        await launcher.stop()
    say(f"stopped the stack in {time.perf_counter() - stopping:.1f} s; logs in {_short(run_dir / rundir.LOG_DIR)}")
    folders = ", ".join(_short(_resume_dir(run_dir, s.name)) for s in spec.servers if s.role == "agent")
    say(f"the agents' checkpoints (read them with `gymrpc episodes list DIR`): {folders}")
    complete = not summary.failed and len(summary.results) == total
    lost = [k.name for k in kills if not k.restarted.is_set()]
    if complete and not lost:
        crash = f" although {' and '.join(k.name for k in kills)} were SIGKILLed mid-run" if kills else ""
        say(f"OK: all {total} episodes completed{crash}")
        return 0
    say(f"FAILED: {len(summary.failed)} episodes failed" + (f"; {', '.join(lost)} never came back" if lost else ""))
    return 1


def _resume_dir(run_dir: Path, agent: str) -> Path:
    return run_dir / "episodes" / agent.replace("/", "-")


def _with_resume_dirs(spec: StackSpec, run_dir: Path) -> StackSpec:
    """Every agent checkpoints its episodes at each boundary, in a folder of its own."""
    servers = tuple(
        dataclasses.replace(s, args={**s.args, "resume_dir": str(_resume_dir(run_dir, s.name))})
        if s.role == "agent"
        else s
        for s in spec.servers
    )
    return dataclasses.replace(spec, servers=servers)


def _server(launcher: LocalLauncher, name: str) -> ServerState:
    return next(s for s in launcher.server_states() if s.name == name)


def _inflict(launcher: LocalLauncher, kill: _Kill, running: int, progress: Progress, detail: str = "") -> None:
    """SIGKILL the server now (stopped or not), while its episodes are in flight."""
    state = _server(launcher, kill.name)
    if state.pid is None:
        return
    kill.pid, kill.address, kill.in_flight, kill.killed_at = state.pid, state.address, running, time.perf_counter()
    os.kill(state.pid, signal.SIGKILL)
    kill.watcher = asyncio.get_running_loop().create_task(_watch_restart(launcher, kill, progress))
    progress.note(
        f"  ! SIGKILL {kill.name} (pid {kill.pid}, {kill.address}) with {progress.done}/{progress.total}"
        f" episodes done, {running} in flight{detail}"
    )


async def _inflict_mid_episode(
    launcher: LocalLauncher, kill: _Kill, store: Path, flying: dict[str, set[str]], progress: Progress
) -> None:
    """Kill an agent while one of its episodes in flight has a checkpoint mid-run, so that the demo shows a
    resume: right after a result, its episodes in flight may all be finishing or not yet seeded, and a
    scripted episode lasts milliseconds. So the agent is stopped (SIGSTOP), its records read, and it is
    killed there if one is mid-run, else let go and looked at again 20 ms later; with none of its
    episodes left, it dies all the same."""
    from gymrpc.store.reader import read_record
    from gymrpc.v1 import agent_service_pb2 as agent_pb

    ended = (agent_pb.EPISODE_PHASE_UNSPECIFIED, agent_pb.EPISODE_PHASE_COMPLETED)  # never seeded, or done

    def mid_run(episodes: list[str]) -> int:
        records = [read_record(store, episode) for episode in episodes]
        return sum(r is not None and r.phase not in ended for r in records)

    assert kill.env is not None
    while True:
        episodes = sorted(flying[kill.env])
        pid, checkpointed = _server(launcher, kill.name).pid, 0
        if episodes and pid is not None:
            os.kill(pid, signal.SIGSTOP)  # what it saved is all it will have saved when it dies
            try:
                checkpointed = mid_run(episodes)
            finally:
                if not checkpointed:
                    os.kill(pid, signal.SIGCONT)
        if checkpointed or not flying[kill.env]:
            running = sum(map(len, flying.values()))
            _inflict(launcher, kill, running, progress, f", {checkpointed} of its own checkpointed mid-episode")
            return
        await asyncio.sleep(0.02)


async def _watch_restart(launcher: LocalLauncher, kill: _Kill, progress: Progress) -> None:
    while True:
        state = _server(launcher, kill.name)
        if state.restarts >= 1 and state.state == "serving" and state.pid != kill.pid:
            progress.note(
                f"  + the supervisor restarted {kill.name}: pid {state.pid} on {state.address}"
                f" (was {kill.address}), serving {time.perf_counter() - kill.killed_at:.1f} s after the kill"
            )
            kill.restarted.set()
            return
        await asyncio.sleep(0.05)


def _env_line(env: str, s: Summary) -> str:
    mean = s.mean_reward
    line = f"{env:<10} {len(s.ok)}/{s.planned} completed  mean reward {mean:+.3f}" if mean is not None else env
    if env == "counter":
        by_task = "  ".join(f"t{k} {sum(v) / len(v):.2f}" for k, v in sorted(s.by_task.items()))
        return f"{line}  (by task: {by_task})"
    outcomes = Counter(
        json.loads(r.trajectory.verify_details_json or "{}").get("result", "?") for r in s.ok if r.trajectory
    )
    return f"{line}  (hands: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())) + ")"


async def _status_table(run_dir: Path) -> str:
    from gymrpc.launch.local import health_serving
    from gymrpc.launch.status import format_table, read_state

    state = read_state(run_dir)
    assert state is not None
    servers = [s for s in state["servers"] if s["address"]]
    checks = await asyncio.gather(*(health_serving(s["address"]) for s in servers))
    health = {s["name"]: "SERVING" if ok else "DOWN" for s, ok in zip(servers, checks, strict=True)}
    return "\n".join(format_table(run_dir, state, health).splitlines()[1:])


def say(text: str) -> None:
    print(text, flush=True)


def _short(path: Path) -> str:
    with contextlib.suppress(ValueError):
        return str(path.relative_to(Path.cwd()))
    return str(path)
