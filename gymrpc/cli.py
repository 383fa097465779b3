"""The `gymrpc` command: up, status, down, rollouts, report, demo, call, ctl, episodes, top, train."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gymrpc import logs, rundir
from gymrpc.launch.options import check_stack_args
from gymrpc.launch.spec import TlsSpec, load_stack_spec
from gymrpc.launch.status import format_table, read_state
from gymrpc.tls import read_run_dir_tls


def _run_dir(args: argparse.Namespace) -> Path:
    return Path(args.run_dir).absolute() if args.run_dir else rundir.default_run_dir()


def _alive(pid: int) -> bool:
    """True while the process runs; a zombie (exited, not yet reaped by its parent) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def cmd_up(args: argparse.Namespace) -> int:
    run_dir = _run_dir(args)
    try:
        spec = load_stack_spec(Path(args.config) if args.config else None)
        if args.tls and spec.tls is None:
            spec = dataclasses.replace(spec, tls=TlsSpec(generate=True))
        check_stack_args(spec.servers)
    except ValueError as exc:
        print(f"gymrpc up: {exc}", file=sys.stderr)
        return 2
    if args.detach:
        return _up_detached(args, run_dir)
    from gymrpc.launch import create_launcher

    logs.configure("launcher")

    async def main() -> None:
        launcher = create_launcher(spec, run_dir)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        starting = loop.create_task(launcher.start())
        stopped = loop.create_task(stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
        else:
            starting.result()
            print(format_table(run_dir, read_state(run_dir)), file=sys.stderr, flush=True)
            await stopped
        await launcher.stop()

    try:
        asyncio.run(main())
    except (RuntimeError, ValueError) as exc:
        print(f"gymrpc up: {exc}", file=sys.stderr)
        return 1
    return 0


def _up_detached(args: argparse.Namespace, run_dir: Path) -> int:
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "gymrpc.cli", "up", "--run-dir", str(run_dir)]
    if args.tls:
        argv.append("--tls")
    if args.config:
        argv.append(str(Path(args.config).absolute()))
    (run_dir / rundir.STATE_FILE).unlink(missing_ok=True)
    with open(run_dir / "launcher.log", "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        state = read_state(run_dir)
        if state and state.get("launcher_pid") == proc.pid and state.get("state") == "serving":
            print(format_table(run_dir, state))
            return 0
        if proc.poll() is not None:
            tail = (run_dir / "launcher.log").read_text(errors="replace").splitlines()[-15:]
            print("gymrpc up: the stack failed to start:\n" + "\n".join(tail), file=sys.stderr)
            return 1
        time.sleep(0.1)
    proc.terminate()
    print(
        f"gymrpc up: the stack was not serving after {args.timeout:.0f}s; see {run_dir}/launcher.log",
        file=sys.stderr,
    )
    return 1


def cmd_status(args: argparse.Namespace) -> int:
    run_dir = _run_dir(args)
    state = read_state(run_dir)
    if not state or not _alive(state["launcher_pid"]) or state["state"] == "stopped":
        print(f"no running stack in {run_dir}")
        return 3
    from gymrpc.launch.local import health_serving

    async def probe() -> dict[str, str]:
        tls = read_run_dir_tls(run_dir)
        checks = {s["name"]: health_serving(s["address"], tls=tls) for s in state["servers"] if s["address"]}
        results = await asyncio.gather(*checks.values())
        return {name: "SERVING" if ok else "DOWN" for name, ok in zip(checks, results, strict=True)}

    health = asyncio.run(probe())
    notes = asyncio.run(_notes(run_dir))
    if args.json:
        print(json.dumps({**state, "health": health, "notes": notes}, indent=2))
    else:
        print(format_table(run_dir, state, health, notes))
    return 0


NOTED_DETAILS = ("upstream_mode",)
"""`GetStatus` details worth a column in `gymrpc status` (all of them: `gymrpc ctl status`)."""


async def _notes(run_dir: Path) -> dict[str, str]:
    """Per participant, the noted `GetStatus` details (the model's upstream mode); {} when none answer."""
    from gymrpc.client import Client
    from gymrpc.controller import Controller, CoordinationError
    from gymrpc.errors import GymrpcError

    try:
        async with Client(run_dir=run_dir) as client:
            statuses = await Controller(client).status(timeout=3.0)
    except (GymrpcError, CoordinationError, OSError):
        return {}  # no control token, or a participant did not answer: the table without notes
    notes = {}
    for name, status in statuses.items():
        shown = [f"{key}={status.details[key]}" for key in NOTED_DETAILS if key in status.details]
        if shown:
            notes[name] = " ".join(shown)
    return notes


def cmd_down(args: argparse.Namespace) -> int:
    run_dir = _run_dir(args)
    state = read_state(run_dir)
    if not state or not _alive(state["launcher_pid"]):
        print(f"no running stack in {run_dir}")
        return 0
    pid = state["launcher_pid"]
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        print(f"gymrpc down: launcher {pid} still running after {args.timeout:.0f}s", file=sys.stderr)
        return 1
    print(f"stopped the stack in {run_dir}")
    return 0


def cmd_rollouts(args: argparse.Namespace) -> int:
    from gymrpc.rollouts import command

    return command.run(args, _run_dir(args))


def cmd_report(args: argparse.Namespace) -> int:
    from gymrpc.rollouts.report import read_results, report

    try:
        summary = report(args.results)
        skipped = read_results(args.results)[1]
    except (OSError, UnicodeDecodeError) as exc:
        print(f"gymrpc report: {args.results}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**summary.to_json(), "unreadable_lines": skipped}))
    else:
        print("\n".join(summary.lines()))
        if skipped:
            print(f"skipped   {skipped} lines that are not results (a partial last line of a killed run?)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from gymrpc import demo

    return demo.run(args)


def cmd_call(args: argparse.Namespace) -> int:
    from gymrpc import call

    return call.run(args, _run_dir(args))


def cmd_top(args: argparse.Namespace) -> int:
    from gymrpc import top

    return top.run(args, _run_dir(args))


def cmd_ctl(args: argparse.Namespace) -> int:
    from gymrpc import ctl

    return ctl.run(args, _run_dir(args))


def cmd_episodes(args: argparse.Namespace) -> int:
    from gymrpc import episodes

    return episodes.run(args)


def cmd_train(args: argparse.Namespace) -> int:
    from gymrpc.train import command

    if args.train_command == "run":
        return command.cmd_run(args, _run_dir(args))
    return int(args.train_func(args))


def _stack_options() -> argparse.ArgumentParser:
    """Options every command that reaches a stack takes (a parent parser: added once, not by hand)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--run-dir", default=argparse.SUPPRESS)  # also before the command; see build_parser
    return parent


def _command(
    sub: Any,
    name: str,
    help: str,
    func: Callable[[argparse.Namespace], int],
    add: Callable[[argparse.ArgumentParser], object] | None = None,
    *,
    stack: bool = True,
) -> argparse.ArgumentParser:
    """Subcommand `name` running `func`; `add` adds its own arguments; `stack`: it takes the stack options."""
    parser = sub.add_parser(name, help=help, parents=[_stack_options()] if stack else [])
    if add is not None:
        add(parser)
    parser.set_defaults(func=func)
    return parser


def _up_arguments(up: argparse.ArgumentParser) -> None:
    up.add_argument("config", nargs="?", help="stack YAML (default: the embedded default stack)")
    up.add_argument("--detach", action="store_true", help="run in the background; return once serving")
    up.add_argument(
        "--tls",
        action="store_true",
        help="serve TLS and mTLS: a private CA and per-server certificates in the run folder (docs/security.md)",
    )
    up.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for --detach")


def _report_arguments(report: argparse.ArgumentParser) -> None:
    report.add_argument("results", type=Path, help="a results JSONL written by gymrpc rollouts")
    report.add_argument("--json", action="store_true", help="the summary as one JSON object")


def build_parser() -> argparse.ArgumentParser:
    from gymrpc.call import add_arguments as add_call_arguments
    from gymrpc.ctl import add_arguments as add_ctl_arguments
    from gymrpc.demo import add_arguments as add_demo_arguments
    from gymrpc.episodes import add_arguments as add_episodes_arguments
    from gymrpc.rollouts.command import add_arguments as add_rollouts_arguments
    from gymrpc.top import add_arguments as add_top_arguments
    from gymrpc.train.command import add_arguments as add_train_arguments

    parser = argparse.ArgumentParser(prog="gymrpc", description="Crash-surviving agentic rollouts over gRPC.")
    parser.add_argument("--run-dir", help="run folder (default $GYMRPC_RUN_DIR or ./.gymrpc)")
    sub = parser.add_subparsers(dest="command", required=True)
    _command(sub, "up", "launch a stack and supervise it (foreground unless --detach)", cmd_up, _up_arguments)
    _command(
        sub,
        "status",
        "names, addresses, health and restart counts",
        cmd_status,
        lambda p: p.add_argument("--json", action="store_true"),
    )
    _command(
        sub,
        "down",
        "stop the stack cleanly",
        cmd_down,
        lambda p: p.add_argument("--timeout", type=float, default=60.0),
    )
    _command(
        sub,
        "rollouts",
        "run a task file through an agent; one JSON line per episode",
        cmd_rollouts,
        add_rollouts_arguments,
    )
    _command(
        sub,
        "report",
        "the summary of a results file, rebuilt from its lines",
        cmd_report,
        _report_arguments,
        stack=False,
    )
    _command(
        sub,
        "demo",
        "launch the default stack, collect rollouts, crash it, resume from checkpoints",
        cmd_demo,
        add_demo_arguments,
    )
    _command(
        sub,
        "call",
        "call any method by stable name with JSON, through server reflection",
        cmd_call,
        add_call_arguments,
    )
    _command(
        sub,
        "ctl",
        "coordinated checkpoints by hand: status, prepare, commit, resume, restore, ...",
        cmd_ctl,
        add_ctl_arguments,
    )
    _command(
        sub,
        "episodes",
        "what a durable-resume folder holds: list, show, verify (no stack needed)",
        cmd_episodes,
        add_episodes_arguments,
        stack=False,
    )
    _command(sub, "top", "live view of a running stack from its metrics (`metrics: true`)", cmd_top, add_top_arguments)
    _command(
        sub,
        "train",
        "the reference GRPO trainer: init (a weak start), run (train; --resume)",
        cmd_train,
        add_train_arguments,
    )
    return parser


EXIT_BROKEN_PIPE = 141
"""128 + SIGPIPE, what a shell reports for a command whose reader went away."""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()
    except BrokenPipeError:  # `gymrpc status | head`: the reader left; that is not an error to report
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    return code


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
