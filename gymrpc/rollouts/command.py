"""`gymrpc rollouts TASKS.jsonl --agent NAME --out results.jsonl`: the collector as a command.

Exit codes: 0 every episode completed; 1 some failed (each is in the results file with
its error); 2 bad arguments or task file; 3 no stack to talk to; 75 stopped by SIGTERM
after a checkpoint (`--checkpoint-dir`; `--resume` restores it); 130 interrupted (what
was written stays, and `--resume` continues from it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from pathlib import Path

from gymrpc import rundir
from gymrpc.client import Client
from gymrpc.controller import CoordinationError
from gymrpc.errors import GymrpcError, NotFound
from gymrpc.rollouts.checkpointing import EXIT_CHECKPOINTED, CheckpointingRun, CheckpointKeeper
from gymrpc.rollouts.collector import DEFAULT_TIMEOUT, EpisodeResult, collect
from gymrpc.rollouts.report import Progress, ResultWriter, Summary, done_ids
from gymrpc.rollouts.tasks import RolloutTask, TaskFileError, load_tasks

EXIT_FAILED, EXIT_USAGE, EXIT_NO_STACK, EXIT_INTERRUPTED = 1, 2, 3, 130


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("tasks", type=Path, help="task rows in the reference's JSONL format")
    parser.add_argument("--agent", default="agent/simple", help="stable name of the agent (default %(default)s)")
    parser.add_argument("--out", type=Path, required=True, help="results JSONL, one line per finished episode")
    parser.add_argument("--concurrency", type=_positive, default=32, help="episodes at once (default %(default)s)")
    parser.add_argument("--repeats", type=_positive, default=1, help="episodes per task (default %(default)s)")
    parser.add_argument("--limit", type=_positive, help="only the first N tasks")
    parser.add_argument("--policy-version", default="", help="weights version the episodes must use")
    parser.add_argument("--max-steps", type=int, default=0, help="model calls per episode (default: the agent's)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help="seconds one episode may take, retries after restarts included (default %(default)s)",
    )
    parser.add_argument(
        "--max-policy-lag",
        type=int,
        metavar="K",
        help="an episode whose oldest token is more than K weight versions behind when it finishes is stale",
    )
    parser.add_argument(
        "--stale",
        choices=("flag", "restart"),
        default="flag",
        help="stale episodes: keep them flagged, or run them again as the next attempt (default %(default)s)",
    )
    parser.add_argument("--model", default="model/policy", help="model server whose version --max-policy-lag reads")
    parser.add_argument("--id-prefix", help="episode ids are PREFIX-t<task>-r<repeat> (default: the file's stem)")
    existing = parser.add_mutually_exclusive_group()
    existing.add_argument(
        "--resume", action="store_true", help="append to --out, skipping episodes it already has as completed"
    )
    existing.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    group = parser.add_argument_group("coordinated checkpoints (the collector as controller)")
    group.add_argument(
        "--checkpoint-dir",
        type=Path,
        help="checkpoint the stack here (on SIGUSR1, on SIGTERM then exit 75, and every --checkpoint-every); "
        "with --resume, restore its LATEST first",
    )
    group.add_argument("--checkpoint-every", type=float, default=0.0, help="seconds between checkpoints (0: off)")
    group.add_argument("--keep-checkpoints", type=_positive, default=3, help="checkpoints kept (default %(default)s)")
    group.add_argument(
        "--checkpoint-timeout", type=float, default=30.0, help="seconds a checkpoint may take (default %(default)s)"
    )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def run(args: argparse.Namespace, run_dir: Path | None = None) -> int:
    """Run the command; every expected failure becomes a message on stderr and an exit code."""
    try:
        tasks = load_tasks(args.tasks, prefix=args.id_prefix, limit=args.limit)
    except TaskFileError as exc:
        return _fail(str(exc), EXIT_USAGE)
    out: Path = args.out
    if out.exists() and out.stat().st_size and not (args.resume or args.overwrite):
        return _fail(f"{out} already exists; pass --resume to continue it or --overwrite to replace it", EXIT_USAGE)
    skip = done_ids(out) if args.resume else set()
    _take_sigint()
    try:
        return asyncio.run(_main(args, tasks, skip, run_dir or rundir.default_run_dir()))
    except FileNotFoundError as exc:  # no registry address: no stack in the run folder
        return _fail(str(exc), EXIT_NO_STACK)


async def _main(args: argparse.Namespace, tasks: list[RolloutTask], skip: set[str], run_dir: Path) -> int:
    planned = len(tasks) * args.repeats - sum(1 for t in tasks for r in range(args.repeats) if t.episode_id(r) in skip)
    results: list[EpisodeResult] = []
    interrupted = False
    async with Client(run_dir=run_dir) as client:
        try:  # before the results file is touched: a wrong name or a dead stack leaves no trace
            await client.resolve(args.agent)
        except NotFound as exc:
            names = await _agent_names(client)
            return _fail(f"{exc.message} (registered agents: {', '.join(names) or 'none'})", EXIT_USAGE)
        except GymrpcError as exc:
            return _fail(f"cannot reach the stack in {run_dir}: {exc}", EXIT_NO_STACK)
        control = None
        if args.checkpoint_dir is not None:
            control = CheckpointingRun(client, CheckpointKeeper(args.checkpoint_dir, args.keep_checkpoints))
            control.timeout = args.checkpoint_timeout
            try:
                await control.open(args.resume, skip)
            except (GymrpcError, CoordinationError) as exc:  # e.g. the stack is not fresh: nothing was restored
                return _fail(f"cannot restore the latest checkpoint of {args.checkpoint_dir}: {exc}", EXIT_NO_STACK)
            except (OSError, ValueError, KeyError) as exc:
                return _fail(f"{args.checkpoint_dir} holds no readable checkpoint: {exc!r}", EXIT_USAGE)
        progress = Progress(planned, label=args.agent) if not args.quiet else None
        writer = ResultWriter(args.out, append=args.resume)

        def on_result(result: EpisodeResult) -> None:
            if control is not None:
                if control.stopped and not result.ok:
                    return  # refused by the parked stack: not an outcome, the checkpoint has it
                control.finished(result.episode_id)
            writer.write(result.to_json())
            results.append(result)
            if progress is not None:
                progress.update(result)

        def on_start(task: RolloutTask, repeat: int) -> None:
            if control is not None:
                control.started(task.episode_id(repeat))

        loop = asyncio.get_running_loop()
        ticker = loop.create_task(_tick(progress))
        background: list[asyncio.Task[object]] = []
        current = asyncio.current_task()
        checkpointed = False

        async def terminate() -> None:
            nonlocal checkpointed
            assert control is not None
            checkpointed = await control.checkpoint(stop=True) is not None
            if current is not None:
                current.cancel()

        if control is not None:
            loop.add_signal_handler(signal.SIGUSR1, lambda: background.append(loop.create_task(control.checkpoint())))
            loop.add_signal_handler(signal.SIGTERM, lambda: background.append(loop.create_task(terminate())))
            if args.checkpoint_every > 0:
                background.append(loop.create_task(control.every(args.checkpoint_every)))
        started = time.perf_counter()
        try:
            await collect(
                client,
                tasks,
                agent=args.agent,
                concurrency=args.concurrency,
                repeats=args.repeats,
                policy_version=args.policy_version,
                max_steps=args.max_steps,
                timeout=args.timeout,
                skip=skip,
                attempts=control.attempts if control is not None else None,
                on_start=on_start,
                on_result=on_result,
                max_policy_lag=args.max_policy_lag,
                stale=args.stale,
                model=args.model,
            )
        except asyncio.CancelledError:  # Ctrl-C (asyncio.run cancels us) or SIGTERM: keep what was written
            interrupted = True
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
        finally:
            if control is not None:
                loop.remove_signal_handler(signal.SIGUSR1)
                loop.remove_signal_handler(signal.SIGTERM)
            for job in background:
                job.cancel()
            ticker.cancel()
            writer.close()
            if progress is not None:
                progress.close()
    summary = Summary(results, time.perf_counter() - started, planned, skipped=len(skip), interrupted=interrupted)
    print("\n".join(summary.lines()))
    if control is not None:
        print(
            f"checkpoints {control.taken} taken in {args.checkpoint_dir}; "
            f"restored episodes: {len(control.continued)} continued, {len(control.restarted)} restarted"
        )
    print(f"results   {args.out} ({writer.written} lines written)")
    if checkpointed:
        print("stopped after a checkpoint: rerun with --resume on a fresh stack to continue", file=sys.stderr)
        return EXIT_CHECKPOINTED
    if interrupted:
        print(f"interrupted: rerun with --resume to run the {planned - len(results)} remaining", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_FAILED if summary.failed else 0


def _take_sigint() -> None:
    """Make SIGINT interrupt the run even where it was inherited as ignored.

    A non-interactive shell starts background jobs with SIGINT ignored, and asyncio only turns
    SIGINT into a cancellation when it has Python's default handler: the collector then ran every
    episode despite SIGINT. SIGINT is this command's documented way to stop (exit 130).
    """
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


async def _tick(progress: Progress | None) -> None:
    while progress is not None:
        await asyncio.sleep(1.0)
        progress.tick()


async def _agent_names(client: Client) -> list[str]:
    with contextlib.suppress(GymrpcError):
        return sorted({e.name for e in await client.registry.list("agent/")})
    return []


def _fail(message: str, code: int) -> int:
    print(f"gymrpc rollouts: {message}", file=sys.stderr)
    return code
