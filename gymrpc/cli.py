"""The `gymrpc` command: `up`, `status`, `down`, `rollouts`, `demo`, `call` (later issues add more subcommands)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gymrpc import logs, rundir
from gymrpc.launch.spec import load_stack_spec


def _run_dir(args: argparse.Namespace) -> Path:
    return Path(args.run_dir).absolute() if args.run_dir else rundir.default_run_dir()


def _read_state(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / rundir.STATE_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


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
    except ValueError as exc:
        print(f"gymrpc up: {exc}", file=sys.stderr)
        return 2
    if args.detach:
        return _up_detached(args, run_dir)
    from gymrpc.launch.base import create_launcher

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
            print(_format_table(run_dir, _read_state(run_dir)), file=sys.stderr, flush=True)
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
    if args.config:
        argv.append(str(Path(args.config).absolute()))
    (run_dir / rundir.STATE_FILE).unlink(missing_ok=True)
    with open(run_dir / "launcher.log", "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        state = _read_state(run_dir)
        if state and state.get("launcher_pid") == proc.pid and state.get("state") == "serving":
            print(_format_table(run_dir, state))
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


def _format_table(run_dir: Path, state: dict | None, health: dict[str, str] | None = None) -> str:
    if not state:
        return f"no stack in {run_dir}"
    rows = [("NAME", "STATE", "HEALTH" if health is not None else "", "PID", "ADDRESS", "RESTARTS", "LAST EXIT")]
    for s in state["servers"]:
        rows.append(
            (
                s["name"],
                s["state"],
                (health or {}).get(s["name"], "") if health is not None else "",
                str(s["pid"] or "-"),
                s["address"] or "-",
                str(s["restarts"]),
                s["last_exit"] or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        f"stack {state['state']} in {run_dir} (launcher pid {state['launcher_pid']}, registry {state['registry']})"
    ]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    run_dir = _run_dir(args)
    state = _read_state(run_dir)
    if not state or not _alive(state["launcher_pid"]) or state["state"] == "stopped":
        print(f"no running stack in {run_dir}")
        return 3
    from gymrpc.launch.local import health_serving

    async def probe() -> dict[str, str]:
        checks = {s["name"]: health_serving(s["address"]) for s in state["servers"] if s["address"]}
        results = await asyncio.gather(*checks.values())
        return {name: "SERVING" if ok else "DOWN" for name, ok in zip(checks, results, strict=True)}

    health = asyncio.run(probe())
    if args.json:
        print(json.dumps({**state, "health": health}, indent=2))
    else:
        print(_format_table(run_dir, state, health))
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    run_dir = _run_dir(args)
    state = _read_state(run_dir)
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


def cmd_demo(args: argparse.Namespace) -> int:
    from gymrpc import demo

    return demo.run(args)


def cmd_call(args: argparse.Namespace) -> int:
    from gymrpc import call

    return call.run(args, _run_dir(args))


def cmd_ctl(args: argparse.Namespace) -> int:
    from gymrpc import ctl

    return ctl.run(args, _run_dir(args))


def cmd_train(args: argparse.Namespace) -> int:
    from gymrpc.train import command

    if args.train_command == "run":
        return command.cmd_run(args, _run_dir(args))
    return int(args.train_func(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gymrpc", description="Crash-surviving agentic rollouts over gRPC.")
    parser.add_argument("--run-dir", help="run folder (default $GYMRPC_RUN_DIR or ./.gymrpc)")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="launch a stack and supervise it (foreground unless --detach)")
    up.add_argument("config", nargs="?", help="stack YAML (default: the embedded default stack)")
    up.add_argument("--run-dir", default=argparse.SUPPRESS)
    up.add_argument("--detach", action="store_true", help="run in the background; return once serving")
    up.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for --detach")
    up.set_defaults(func=cmd_up)
    status = sub.add_parser("status", help="names, addresses, health and restart counts")
    status.add_argument("--run-dir", default=argparse.SUPPRESS)
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)
    down = sub.add_parser("down", help="stop the stack cleanly")
    down.add_argument("--run-dir", default=argparse.SUPPRESS)
    down.add_argument("--timeout", type=float, default=60.0)
    down.set_defaults(func=cmd_down)
    from gymrpc.rollouts.command import add_arguments as add_rollouts_arguments

    rollouts = sub.add_parser("rollouts", help="run a task file through an agent; one JSON line per episode")
    rollouts.add_argument("--run-dir", default=argparse.SUPPRESS)
    add_rollouts_arguments(rollouts)
    rollouts.set_defaults(func=cmd_rollouts)
    from gymrpc.demo import add_arguments as add_demo_arguments

    demo = sub.add_parser("demo", help="launch the default stack, collect rollouts, crash it, resume from checkpoints")
    demo.add_argument("--run-dir", default=argparse.SUPPRESS)
    add_demo_arguments(demo)
    demo.set_defaults(func=cmd_demo)
    from gymrpc.call import add_arguments as add_call_arguments

    call = sub.add_parser("call", help="call any method by stable name with JSON, through server reflection")
    call.add_argument("--run-dir", default=argparse.SUPPRESS)
    add_call_arguments(call)
    call.set_defaults(func=cmd_call)
    from gymrpc.ctl import add_arguments as add_ctl_arguments

    ctl = sub.add_parser("ctl", help="coordinated checkpoints by hand: status, prepare, commit, resume, restore, ...")
    ctl.add_argument("--run-dir", default=argparse.SUPPRESS)
    add_ctl_arguments(ctl)
    ctl.set_defaults(func=cmd_ctl)
    from gymrpc.train.command import add_arguments as add_train_arguments

    train = sub.add_parser("train", help="the reference GRPO trainer: init (a weak start), run (train; --resume)")
    train.add_argument("--run-dir", default=argparse.SUPPRESS)
    add_train_arguments(train)
    train.set_defaults(func=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
