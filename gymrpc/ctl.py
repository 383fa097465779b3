"""`gymrpc ctl`: drive coordinated checkpoints by hand, one `ParticipantService` call at a time.

    gymrpc ctl status [NAME]                                   phase, lease, readiness of every participant
    gymrpc ctl prepare ID [--deadline S]                       close admission, wait for boundaries
    gymrpc ctl commit ID --dir D [--episodes R[:A] ...]        write records, then manifests
    gymrpc ctl resume ID                                       reopen (aborts an uncommitted checkpoint)
    gymrpc ctl restore ID --dir D --episodes R[:A] ... [--source NAME=ID,...]
                                                               install into fresh processes, all or nothing
    gymrpc ctl retire ID --episodes R[:A] ...                  fence attempts, free their state
    gymrpc ctl forget ID --rollouts R ...                      drop retire marks
    gymrpc ctl renew ID [--deadline S]                         extend the open checkpoint's lease
    gymrpc ctl checkpoint --dir D [--episodes ...] [--id ID] [--incremental]
                                                               prepare, commit into D/ID, resume
    gymrpc ctl inspect D                                       a checkpoint folder's index, verified (no stack)
    gymrpc ctl gc ROOT [--dry-run] [--keep N]                  remove unpublished (and old) checkpoint folders

Built on `gymrpc.Controller`, so it keeps its orders (prepare environment, model, agent,
resources and stop at the first stage not ready; resume in reverse; retire callers first)
and its all-or-nothing restore. Participants are every registered name that serves
`ParticipantService` (`--name` picks some). For operators and for debugging a controller:
what it prints is what the participants replied.

A commit of every participant ends with the checkpoint's index (`checkpoint.json`, written by
the controller last); `restore` reads exactly the replicas it lists and refuses a folder without
one (incomplete) unless `--source` names the replicas that committed.

Exit codes: 0 done; 1 some participant refused or failed (each failure is printed with its
gRPC code, `ErrorInfo` reason and message), or the checkpoint folder was refused; 2 bad command
line; 3 prepare (or checkpoint) not ready by the deadline, admission stays closed after `prepare`
until `resume ID`; 4 no stack in the run folder.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message

from gymrpc import text
from gymrpc.client import Client
from gymrpc.control import gc, store
from gymrpc.control.index import INDEX, read_index
from gymrpc.control.types import EpisodeKey
from gymrpc.controller import Controller, CoordinationError, PrepareResult
from gymrpc.errors import GymrpcError
from gymrpc.ids import check_endpoint_id, check_id, check_service_name
from gymrpc.retry import RetryPolicy
from gymrpc.v1 import participant_service_pb2 as pb

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_READY, EXIT_NO_STACK = 0, 1, 2, 3, 4


def episode(value: str) -> EpisodeKey:
    """`ROLLOUT` (attempt 0) or `ROLLOUT:ATTEMPT`."""
    rollout, _, attempt = value.partition(":")
    try:
        check_id(rollout, "episode")
    except GymrpcError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    if attempt and not attempt.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r}: the attempt after ':' must be a number")
    return EpisodeKey(rollout, int(attempt or 0))


def source(value: str) -> tuple[str, list[str]]:
    """`NAME=ID[,ID...]`: the replicas of NAME that committed."""
    name, _, ids = value.partition("=")
    try:
        check_service_name(name)
        endpoint_ids = [check_endpoint_id(i) for i in ids.split(",")]
    except GymrpcError as exc:
        raise argparse.ArgumentTypeError(f"{value!r}: {exc.message} (expected NAME=ID[,ID...])") from None
    return name, endpoint_ids


def _common(parser: argparse.ArgumentParser, default: Any) -> None:
    """Options every command takes, before or after the command name."""
    parser.add_argument(
        "--json",
        action="store_true",
        default=False if default is None else default,
        help="print the replies as JSON (proto field names)",
    )
    parser.add_argument("--name", action="append", default=default, metavar="NAME", help="only this participant")
    parser.add_argument(
        "--timeout", type=float, default=60.0 if default is None else default, help="seconds per control call"
    )
    if default is argparse.SUPPRESS:
        parser.add_argument("--run-dir", default=argparse.SUPPRESS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _common(parser, None)
    sub = parser.add_subparsers(dest="ctl_command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, help=help)
        _common(parser, argparse.SUPPRESS)
        return parser

    status = command("status", "phase, open checkpoint, lease, readiness and retire marks")
    status.add_argument("participant", nargs="?", metavar="NAME", help="one participant (default: all)")

    def with_id(name: str, help: str, id_help: str = "checkpoint id") -> argparse.ArgumentParser:
        command_parser = command(name, help)
        command_parser.add_argument("checkpoint_id", metavar="ID", help=id_help)
        return command_parser

    prepare = with_id("prepare", "close admission everywhere, in order; wait for every episode to park")
    prepare.add_argument("--deadline", type=float, default=30.0, help="seconds to wait (default %(default)s)")
    commit = with_id("commit", "write every participant's records, then its manifest")
    commit.add_argument("--dir", required=True, help="checkpoint folder (absolute on every participant's host)")
    commit.add_argument("--episodes", nargs="+", type=episode, metavar="R[:A]", help="the scope (default: all parked)")
    commit.add_argument("--stop", action="store_true", help="the stack stops after this commit: refuse new work")
    commit.add_argument("--deadline", type=float, default=60.0, help="seconds for the write (default %(default)s)")
    with_id("resume", "reopen admission in reverse order; aborts a checkpoint not committed")
    restore = with_id("restore", "install a committed checkpoint into fresh processes", "id of this restore")
    restore.add_argument("--dir", required=True, help="the committed checkpoint folder")
    restore.add_argument("--episodes", nargs="+", required=True, type=episode, metavar="R[:A]")
    restore.add_argument("--deadline", type=float, default=120.0, help="seconds (default %(default)s)")
    restore.add_argument(
        "--source",
        action="append",
        type=source,
        metavar="NAME=ID,...",
        help="the replicas of NAME that committed; given, the checkpoint's index is not read (a folder "
        "committed by hand, or not visible here)",
    )
    retire = with_id("retire", "fence attempts everywhere (callers first) and free their state", "operation id")
    retire.add_argument("--episodes", nargs="+", required=True, type=episode, metavar="R[:A]")
    retire.add_argument("--deadline", type=float, default=60.0, help="seconds (default %(default)s)")
    forget = with_id("forget", "drop the retire marks of finished rollouts", "operation id")
    forget.add_argument("--rollouts", nargs="+", required=True, metavar="R")
    renew = with_id("renew", "extend the lease of the open checkpoint")
    renew.add_argument("--deadline", type=float, default=60.0, help="new deadline in seconds (default %(default)s)")
    checkpoint = command("checkpoint", "a whole checkpoint: prepare, commit into DIR/ID, resume")
    checkpoint.add_argument("--dir", required=True, help="checkpoint root; the checkpoint goes to DIR/ID")
    checkpoint.add_argument("--id", dest="checkpoint_id", help="checkpoint id (default ckpt-<time>-<random>)")
    checkpoint.add_argument("--episodes", nargs="+", type=episode, metavar="R[:A]", help="continued episodes")
    checkpoint.add_argument("--stop", action="store_true", help="commit with stop and do not resume")
    checkpoint.add_argument("--deadline", type=float, default=30.0, help="seconds per step (default %(default)s)")
    checkpoint.add_argument(
        "--incremental",
        action="store_true",
        help="write only what changed since the newest published checkpoint under DIR (it must then be kept)",
    )
    inspect = command("inspect", "a checkpoint folder's index and manifests, verified; needs no stack")
    inspect.add_argument("dir", metavar="DIR", help="the checkpoint folder (ROOT/ID)")
    sweep = command("gc", "remove the unpublished checkpoint folders under ROOT older than its newest published one")
    sweep.add_argument("root", metavar="ROOT", help="the checkpoint root (the folder holding ROOT/ID folders)")
    sweep.add_argument("--dry-run", action="store_true", help="print what would be removed; remove nothing")
    sweep.add_argument(
        "--keep",
        type=int,
        metavar="N",
        help="also remove published checkpoints but the newest N (never one a kept checkpoint refers to)",
    )


def run(args: argparse.Namespace, run_dir: Path) -> int:
    try:
        for name in [*(args.name or ()), *([args.participant] if getattr(args, "participant", None) else [])]:
            check_service_name(name)
        if getattr(args, "checkpoint_id", None):
            check_id(args.checkpoint_id, "ID")
        for rollout in getattr(args, "rollouts", None) or ():
            check_id(rollout, "rollout")
    except GymrpcError as exc:
        print(f"gymrpc ctl: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    if getattr(args, "dir", None):
        args.dir = os.path.abspath(args.dir)  # as every participant must see it
    if args.ctl_command == "inspect":
        return _inspect(args)
    if args.ctl_command == "gc":
        return _gc(args)
    try:
        return asyncio.run(_main(args, run_dir))
    except FileNotFoundError as exc:
        print(f"gymrpc ctl: {exc}", file=sys.stderr)
        return EXIT_NO_STACK
    except CoordinationError as exc:
        _print_failure(args, exc.operation, exc.failures)
        return EXIT_FAILED
    except GymrpcError as exc:  # discovery itself failed, or the checkpoint folder was refused
        _print_failure(args, args.ctl_command, {"checkpoint" if "checkpoint_dir" in exc.metadata else "registry": exc})
        return EXIT_FAILED


async def _main(args: argparse.Namespace, run_dir: Path) -> int:
    names = args.name or ([args.participant] if getattr(args, "participant", None) else None)
    async with Client(run_dir=run_dir, retry=RetryPolicy.default.with_deadline(args.timeout)) as client:
        controller = Controller(client, names=names)
        command = args.ctl_command
        if command == "status":
            statuses = await controller.status(timeout=args.timeout)
            return _print(args, statuses, _status_table(statuses))
        if command == "prepare":
            result = await controller.prepare(args.checkpoint_id, timeout=args.deadline)
            _print(args, result.replies, _prepare_text(args.checkpoint_id, result))
            return EXIT_OK if result.prepared else EXIT_NOT_READY
        if command == "commit":
            manifests = await controller.commit(
                args.checkpoint_id, args.dir, args.episodes, timeout=args.deadline, stop=args.stop
            )
            indexed = f"indexed in {args.dir}/{INDEX}"
            return _print(args, manifests, [*_manifests_text(manifests), indexed])
        if command == "resume":
            resumed = await controller.resume(args.checkpoint_id, timeout=args.timeout)
            lines = [f"{n}: idle{' (already resumed)' if r.already_resumed else ''}" for n, r in resumed.items()]
            return _print(args, resumed, lines)
        if command == "restore":
            sources = dict(args.source) if args.source else None
            restored = await controller.restore(
                args.checkpoint_id, args.dir, args.episodes, timeout=args.deadline, sources=sources
            )
            lines = [
                f"{n}: restored {len(r.restored)} episodes from {r.source_checkpoint_id}: {_episodes(r.restored)}"
                for n, r in restored.items()
            ]
            return _print(args, restored, [*lines, f"resume with: gymrpc ctl resume {args.checkpoint_id}"])
        if command == "retire":
            retired = await controller.retire(args.checkpoint_id, args.episodes, timeout=args.deadline)
            return _print(args, retired, [f"{n}: retired {_episodes(r.retired)}" for n, r in retired.items()])
        if command == "forget":
            forgotten = await controller.forget(args.checkpoint_id, args.rollouts, timeout=args.timeout)
            lines = [f"{n}: forgot {', '.join(r.forgotten) or '-'}" for n, r in forgotten.items()]
            return _print(args, forgotten, lines)
        if command == "renew":
            renewed = await controller.renew(args.checkpoint_id, timeout=args.deadline)
            lines = [f"{n}: lease until {_time(r.lease_expire_time.ToNanoseconds() / 1e9)}" for n, r in renewed.items()]
            return _print(args, renewed, lines)
        if command == "checkpoint":
            return await _checkpoint(args, controller)
        raise AssertionError(f"unknown ctl command {command!r}")  # argparse allows only the ones above


async def _checkpoint(args: argparse.Namespace, controller: Controller) -> int:
    result = await controller.checkpoint(
        args.dir,
        episode_ids=args.episodes,
        checkpoint_id=args.checkpoint_id,
        timeout=args.deadline,
        stop=args.stop,
        incremental=args.incremental,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "checkpoint_id": result.checkpoint_id,
                    "checkpoint_dir": str(result.checkpoint_dir),
                    "committed": result.committed,
                    "prepare": {n: _dict(r) for n, r in result.prepare.replies.items()},
                    "manifests": {n: _dict(m) for n, m in result.manifests.items()},
                    "index": _dict(result.index) if result.index is not None else None,
                    "continued": [str(e) for e in result.continued],
                    "restarted": [str(e) for e in result.restarted],
                },
                indent=2,
            )
        )
    elif result.committed:
        print(f"checkpoint {result.checkpoint_id} committed in {result.checkpoint_dir}")
        print("\n".join(_manifests_text(result.manifests)))
        print(f"indexed in {result.checkpoint_dir / INDEX}")
        if result.restarted:
            print(f"restart only (not in the checkpoint): {_episodes(result.restarted)}")
        print("stopped: admission stays closed" if args.stop else "resumed")
    else:
        print("\n".join(_prepare_text(result.checkpoint_id, result.prepare)))
        print(f"checkpoint {result.checkpoint_id} aborted (resumed); nothing was committed")
    return EXIT_OK if result.committed else EXIT_NOT_READY


def _inspect(args: argparse.Namespace) -> int:
    """Read and verify a checkpoint folder's index offline; exit 1 if a restore would refuse it."""
    folder = Path(args.dir)
    try:
        index = read_index(folder)
    except GymrpcError as exc:
        if args.json:
            print(json.dumps({"checkpoint_dir": str(folder), "restorable": False, "error": _error(exc)}, indent=2))
        else:
            print(f"gymrpc ctl inspect: {exc.code.name} {exc.reason}: {exc.message}", file=sys.stderr)
        return EXIT_FAILED
    manifests = {}
    for member in index.members:
        label = member.name if member.endpoint_id == "0" else f"{member.name}#{member.endpoint_id}"
        path = folder / member.manifest_path
        manifests[label] = store.parse_manifest(store.read_manifest_bytes(path), path)
    if args.json:
        report = {"checkpoint_dir": str(folder), "restorable": True, "index": _dict(index)}
        print(json.dumps(report | {"manifests": {n: _dict(m) for n, m in manifests.items()}}, indent=2))
        return EXIT_OK
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(index.create_time.ToNanoseconds() / 1e9))
    print(f"checkpoint {index.checkpoint_id} in {folder}: {len(index.members)} members, indexed {when}")
    rows = [("MEMBER", "KIND", "RECORDS", "BYTES", "EPISODES", "MANIFEST", "SHA256")]
    for (label, manifest), member in zip(manifests.items(), index.members, strict=True):
        kind = pb.ParticipantKind.Name(member.kind).removeprefix("PARTICIPANT_KIND_").lower()
        rows.append(
            (
                label,
                kind,
                str(manifest.record_count),
                str(manifest.size_bytes),
                str(len(manifest.episode_ids)),
                member.manifest_path,
                member.manifest_sha256[:12],
            )
        )
    print("\n".join(text.table(rows)))
    return EXIT_OK


def _gc(args: argparse.Namespace) -> int:
    """Sweep a checkpoint root offline; exit 1 if the root is refused."""
    try:
        verdicts = gc.sweep(os.path.abspath(args.root), dry_run=args.dry_run, keep=args.keep)
    except (GymrpcError, OSError) as exc:
        message = f"{exc.code.name} {exc.reason}: {exc.message}" if isinstance(exc, GymrpcError) else str(exc)
        print(f"gymrpc ctl gc: {message}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        rows = [{"path": str(v.path), "removed": v.removed and not args.dry_run, "reason": v.reason} for v in verdicts]
        print(json.dumps({"root": os.path.abspath(args.root), "dry_run": args.dry_run, "folders": rows}, indent=2))
        return EXIT_OK
    verb = "would remove" if args.dry_run else "removed"
    for verdict in verdicts:
        print(f"{verb if verdict.removed else 'kept'} {verdict.path}: {verdict.reason}")
    if not verdicts:
        print(f"nothing to remove under {os.path.abspath(args.root)}")
    return EXIT_OK


# -- output ----------------------------------------------------------------------------------------


def _dict(message: Message) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def _print(args: argparse.Namespace, replies: Mapping[str, Message], lines: Sequence[str]) -> int:
    if args.json:
        print(json.dumps({name: _dict(reply) for name, reply in replies.items()}, indent=2))
    else:
        print("\n".join(lines) if lines else "no participants")
    return EXIT_OK


def _error(err: GymrpcError) -> dict[str, Any]:
    return {"code": err.code.name, "reason": err.reason, "message": err.message, "metadata": err.metadata}


def _print_failure(args: argparse.Namespace, operation: str, failures: dict[str, GymrpcError]) -> None:
    if args.json:
        errors = {name: _error(err) for name, err in failures.items()}
        print(json.dumps({"error": {"operation": operation, "failures": errors}}, indent=2))
        return
    print(f"gymrpc ctl {operation}: failed on {len(failures)} participant(s)", file=sys.stderr)
    for name, err in sorted(failures.items()):
        print(f"  {name}: {err.code.name} {err.reason}: {err.message}", file=sys.stderr)


def _episodes(episodes: Sequence[Any]) -> str:
    keys = [e if isinstance(e, EpisodeKey) else EpisodeKey(e.rollout_id, e.attempt) for e in episodes]
    shown = ", ".join(f"{k.rollout_id}:{k.attempt}" for k in keys[:20])
    return (shown + (f", ... ({len(keys)} in all)" if len(keys) > 20 else "")) or "-"


def _time(epoch: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(epoch)) + f" (in {epoch - time.time():.0f}s)"


def _status_table(statuses: dict[str, pb.GetStatusResponse]) -> list[str]:
    rows = [("NAME", "KIND", "PHASE", "CHECKPOINT", "LEASE", "READY", "BLOCKERS", "RESTARTS", "RETIRED", "DETAILS")]
    for name, s in statuses.items():
        lease = _time(s.lease_expire_time.ToNanoseconds() / 1e9) if s.HasField("lease_expire_time") else "-"
        rows.append(
            (
                name,
                pb.ParticipantKind.Name(s.kind).removeprefix("PARTICIPANT_KIND_").lower(),
                pb.ParticipantPhase.Name(s.phase).removeprefix("PARTICIPANT_PHASE_").lower(),
                s.checkpoint_id or "-",
                lease,
                "yes" if s.report.ready else "no",
                str(s.report.blocker_count),
                str(len(s.report.restarts)),
                str(len(s.retired)),
                " ".join(f"{k}={v}" for k, v in sorted(s.details.items())) or "-",
            )
        )
    return text.table(rows)


def _prepare_text(checkpoint_id: str, result: PrepareResult) -> list[str]:
    lines = []
    for name, reply in result.replies.items():
        phase = pb.ParticipantPhase.Name(reply.phase).removeprefix("PARTICIPANT_PHASE_").lower()
        line = f"{name}: {phase}"
        if reply.report.blocker_count:
            line += f", {reply.report.blocker_count} blockers: {_episodes(reply.report.blockers)}"
        if reply.report.restarts:
            line += f", restart only: {_episodes(reply.report.restarts)}"
        lines.append(line)
    if result.prepared:
        lines.append(f"prepared {checkpoint_id}; next: gymrpc ctl commit {checkpoint_id} --dir DIR, then resume")
    else:
        lines.append(
            f"not prepared by the deadline; admission stays closed on the stages reached. "
            f"Retry the prepare, or abort with: gymrpc ctl resume {checkpoint_id}"
        )
    return lines


def _manifests_text(manifests: dict[str, pb.CheckpointManifest]) -> list[str]:
    return [
        f"{name}: {m.record_count} records, {m.size_bytes} bytes, sha256 {m.sha256[:12]}..., "
        f"episodes {_episodes(m.episode_ids)}"
        for name, m in manifests.items()
    ]
