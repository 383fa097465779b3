"""`gymrpc episodes`: what a durable-resume folder (an agent's `--resume-dir`) holds, read without a stack.

    gymrpc episodes list DIR [--state S] [--json]   every episode: state, step, revision, bytes, last save
    gymrpc episodes show DIR ID [--messages N]      one episode's record, its conversation's last N messages
    gymrpc episodes show DIR ID --json              all of the record
    gymrpc episodes verify DIR [--json]             every log and every record read back as an agent would
    gymrpc episodes delete DIR ID ... [--no-archive]
                                                    let episodes start over (a damaged one too)

`list`, `show` and `verify` change nothing and are safe while agents run on the folder: they
read each log as another agent would (gymrpc/store/reader.py), so a batch being written is not
read yet. `verify` reads every frame's checksum and rebuilds every episode's record through its
deltas, then checks it as the agent does before it resumes one; whatever an agent would answer
DATA_LOSS for, `verify` names first. `delete` writes, as an agent would: under each episode's
lease (refused while an agent runs the episode), a copy of a readable record kept in DIR/archive
first, then a deletion newer than any write of the episode, so its next `Run` starts over.

Exit codes: 0 done (verify: nothing damaged); 1 an episode cannot be resumed (verify), the
episode is not in the folder or cannot be read (show), or an episode could not be deleted
(delete); 2 bad command line, or DIR is not a store folder; 3 (verify) damaged log regions
but every episode reads back: the damage held no record still current (a disk to watch), and
it stays until its log is compacted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from gymrpc import text
from gymrpc.errors import DataLoss, GymrpcError
from gymrpc.rollouts.report import Progress
from gymrpc.servers.agent import checkpoint
from gymrpc.store import FilesystemEpisodeStore, LogEpisodeStore
from gymrpc.store.base import EpisodeCheckpoint, EpisodeStore
from gymrpc.store.reader import Entry, StoreFolder
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_DAMAGED_REGIONS = 0, 1, 2, 3
ARCHIVE_REASON = "deleted"
STATES = ("completed", "in-progress", "damaged", "expired", "deleted")
"""`expired`: past its `--completed-ttl`; an agent treats it as gone (and deletes it when it next meets it)."""
_LINE = 160
"""Characters of a message `show` prints."""
_SHOW_PROGRESS_FROM = 500
"""Records read before a progress bar is worth drawing (a few thousand are read per second)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="episodes_command", required=True, metavar="COMMAND")
    listing = sub.add_parser("list", help="every episode in the folder: state, step, revision, bytes, last save")
    listing.add_argument("dir", metavar="DIR", help="the agent's --resume-dir")
    listing.add_argument(
        "--state", choices=STATES, action="append", help="only episodes in this state (repeat for several)"
    )
    listing.add_argument("--json", action="store_true", help="one JSON object per episode (JSON lines)")
    show = sub.add_parser("show", help="one episode's record")
    show.add_argument("dir", metavar="DIR", help="the agent's --resume-dir")
    show.add_argument("rollout_id", metavar="ID", help="the episode's rollout id")
    show.add_argument("--json", action="store_true", help="the whole record as JSON (proto field names)")
    show.add_argument(
        "--messages",
        type=_count,
        default=3,
        metavar="N",
        help="the conversation's last N messages, each cut to a line (default 3; 0: none)",
    )
    verify = sub.add_parser("verify", help="read every log and record back; exit 1 if anything is damaged")
    verify.add_argument("dir", metavar="DIR", help="the agent's --resume-dir")
    verify.add_argument("--json", action="store_true", help="the report as one JSON object")
    delete = sub.add_parser("delete", help="let episodes start over: delete their records (a damaged one too)")
    delete.add_argument("dir", metavar="DIR", help="the agent's --resume-dir")
    delete.add_argument("rollout_ids", nargs="+", metavar="ID", help="the episodes' rollout ids")
    delete.add_argument(
        "--no-archive", action="store_true", help="keep no copy of a readable record (default: one in DIR/archive)"
    )


def run(args: argparse.Namespace) -> int:
    try:
        folder = StoreFolder(args.dir)
    except OSError as exc:
        print(f"gymrpc episodes: {exc}", file=sys.stderr)
        return EXIT_USAGE
    commands = {"list": _list, "show": _show, "verify": _verify, "delete": _delete}
    return commands[args.episodes_command](args, folder)


def summary(entry: Entry, record: EpisodeCheckpoint | None, problem: str | None) -> dict[str, Any]:
    """What `list` shows of an episode (its record is not kept: a folder may hold gigabytes of them)."""
    if problem is not None:
        state = "damaged"
    elif record is None:
        state = "deleted"
    elif record.HasField("expires_at") and record.expires_at.ToNanoseconds() <= time.time_ns():
        state = "expired"
    else:
        state = "completed" if record.phase == agent_pb.EPISODE_PHASE_COMPLETED else "in-progress"
    out: dict[str, Any] = {"rollout_id": entry.rollout_id, "state": state}
    if record is not None:
        out |= {
            "attempt": record.episode_id.attempt,
            "phase": _phase(record.phase),
            "step": record.step,
            "max_steps": record.max_steps,
            "revision": record.revision,
            "policy_version": record.policy_version,
            "resume_count": record.resume_count,
            "restart_count": record.restart_count,
            "updated_at": _time(record.updated_at) if record.HasField("updated_at") else None,
            "expires_at": _time(record.expires_at) if record.HasField("expires_at") else None,
        }
        if record.HasField("final_result"):
            out["reward"] = record.final_result.reward
    out |= {"version": entry.version, "stored_bytes": entry.stored_bytes, "where": entry.where}
    if problem is not None:
        out["problem"] = problem
    return out


def read_all(folder: StoreFolder, label: str) -> list[dict[str, Any]]:
    """Every episode of the folder read back, in rollout id order (a progress bar on stderr for large folders)."""
    entries = sorted(folder.entries().values(), key=lambda e: e.rollout_id)
    progress = _Reading(len(entries), label=label) if len(entries) >= _SHOW_PROGRESS_FROM else None
    episodes = []
    for entry in entries:
        episodes.append(summary(entry, *_read(folder, entry)))
        if progress is not None:
            progress.step()
    if progress is not None:
        progress.close()
    return episodes


def _list(args: argparse.Namespace, folder: StoreFolder) -> int:
    episodes = read_all(folder, "reading")
    wanted = set(args.state or (s for s in STATES if s != "deleted"))
    shown = [e for e in episodes if e["state"] in wanted]
    if args.json:
        for s in shown:
            print(json.dumps(s))
        return EXIT_OK
    if shown:
        rows = [("ROLLOUT ID", "ATTEMPT", "STATE", "STEP", "REVISION", "BYTES", "SAVED", "WHERE")]
        for s in shown:
            rows.append(
                (
                    s["rollout_id"],
                    str(s.get("attempt", "-")),
                    s["phase"] if s["state"] == "in-progress" else s["state"],
                    f"{s['step']}/{s['max_steps']}" if "step" in s else "-",
                    str(s.get("revision", "-")),
                    text.size(s["stored_bytes"]),
                    s.get("updated_at") or "-",
                    s["where"],
                )
            )
        print("\n".join(text.table(rows)))
        for s in shown:
            if "problem" in s:
                print(f"{s['rollout_id']}: {s['problem']}")
    counts = {state: sum(e["state"] == state for e in episodes) for state in STATES}
    in_use = sum(s.in_use for s in folder.logs)
    print(
        f"{text.count(len(episodes) - counts['deleted'], 'episode')} in {args.dir}: {counts['completed']} completed, "
        f"{counts['in-progress']} in progress, {counts['damaged']} damaged, {counts['expired']} expired "
        f"({counts['deleted']} deleted); "
        f"{text.count(len(folder.logs), 'log')}, {in_use} in use by an agent"
    )
    return EXIT_OK


def _show(args: argparse.Namespace, folder: StoreFolder) -> int:
    try:
        entry = folder.entry(args.rollout_id)
    except GymrpcError as exc:  # a files-store record whose header is damaged
        entry, record, problem = None, None, exc.message
    else:
        record, problem = (None, None) if entry is None else _read(folder, entry)
    if problem is not None:
        print(f"gymrpc episodes: {problem}", file=sys.stderr)
        return EXIT_FAILED
    if entry is None or record is None:
        print(f"gymrpc episodes: no episode {args.rollout_id!r} in {args.dir}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json_format.MessageToJson(record, preserving_proto_field_name=True, indent=2))
        return EXIT_OK
    s = summary(entry, record, None)
    lines = [
        f"episode {s['rollout_id']} (attempt {s['attempt']}): {s['state']}, phase {s['phase']}, "
        f"step {s['step']} of {s['max_steps']}",
        f"  revision {s['revision']}, saved {s['updated_at'] or '-'}, expires {s['expires_at'] or 'never'}",
        f"  stored in {s['where']}: {text.size(s['stored_bytes'])}"
        + (f" in {text.count(len(entry.chain.frames), 'frame')}" if entry.chain is not None else ""),
        f"  policy version {record.policy_version or '-'}, resumed {record.resume_count}, "
        f"restarted {record.restart_count}, moved {record.failovers}, sessions recovered {record.session_recoveries}",
    ]
    if record.phase == agent_pb.EPISODE_PHASE_COMPLETED:
        result = record.final_result
        lines.append(
            f"  trajectory: reward {result.reward:g}, {text.count(result.steps, 'step')}, "
            f"{text.count(len(result.messages), 'message')}, {text.count(len(result.model_calls), 'model call')}, "
            f"{text.count(len(result.tool_calls), 'tool call')}, stop "
            f"{agent_pb.StopReason.Name(result.stop_reason).removeprefix('STOP_REASON_').lower()}"
        )
    else:
        snapshot = record.resource_snapshot
        lines.append(
            f"  {text.count(len(record.messages), 'message')}, {text.count(len(record.model_calls), 'model call')}, "
            f"{text.count(len(record.tool_calls), 'tool call')}, "
            f"{len(record.pending_tool_calls) - record.next_tool_index} pending"
        )
        if record.HasField("resource_snapshot"):
            lines.append(
                f"  session {record.session_id}: snapshot {snapshot.format_name}, {text.size(snapshot.ByteSize())}"
            )
    messages = record.final_result.messages if record.HasField("final_result") else record.messages
    shown = messages[len(messages) - min(args.messages, len(messages)) :]
    if shown:
        lines.append(f"  the last {text.count(len(shown), 'message')} of {len(messages)}:")
        lines += [f"    {_message_line(m)}" for m in shown]
    print("\n".join(lines))
    return EXIT_OK


def _verify(args: argparse.Namespace, folder: StoreFolder) -> int:
    folder.measure()
    episodes = read_all(folder, "verifying")
    logs = []
    for state in folder.logs:
        damage = state.view.index.damage
        logs.append(
            {
                "name": state.name,
                "in_use": state.in_use,
                "segments": state.segments,
                "bytes": state.read_bytes,
                "damaged_regions": [{"segment": s, "start": a, "end": b} for s, a, b in damage],
                "unread_bytes": state.unread_bytes,
            }
        )
    damaged = [e for e in episodes if e["state"] == "damaged"]
    live = len(episodes) - sum(e["state"] == "deleted" for e in episodes)
    regions = sum(len(log["damaged_regions"]) for log in logs)
    code = EXIT_FAILED if damaged else EXIT_DAMAGED_REGIONS if regions else EXIT_OK
    ok = code == EXIT_OK
    if args.json:
        report = {
            "dir": args.dir,
            "ok": ok,
            "logs": logs,
            "episodes": live,
            "damaged_episodes": [{"rollout_id": e["rollout_id"], "problem": e["problem"]} for e in damaged],
        }
        print(json.dumps(report, indent=2))
        return code
    for log in logs:
        owner = "in use by an agent" if log["in_use"] else "idle"
        line = f"log {log['name']} ({owner}): {text.count(log['segments'], 'segment')}, {text.size(log['bytes'])} read"
        if log["unread_bytes"]:
            line += f"; {text.size(log['unread_bytes'])} past its last whole batch: " + (
                "being written" if log["in_use"] else "never acknowledged, cut off by the next agent to adopt it"
            )
        print(line)
        for region in log["damaged_regions"]:
            print(
                f"  DAMAGED: segment {region['segment']} bytes {region['start']}-{region['end']} fail their checksums"
            )
    for episode in damaged:
        print(f"DAMAGED: {episode['problem']}")
    if damaged:
        verdict = f"DAMAGED ({text.count(len(damaged), 'episode')} cannot be resumed)"
    elif regions:
        verdict = f"every episode reads back, but {text.count(regions, 'log region')} failed its checksums"
    else:
        verdict = "OK"
    print(f"{text.count(live, 'episode')} in {text.count(len(logs), 'log')} read back and checked: {verdict}")
    if damaged:
        ids = " ".join(e["rollout_id"] for e in damaged)
        print(f"to let them start over: gymrpc episodes delete {args.dir} {ids}")
    return code


def _delete(args: argparse.Namespace, folder: StoreFolder) -> int:
    return asyncio.run(_delete_all(folder.root, args.rollout_ids, archive=not args.no_archive))


async def _delete_all(root: Path, rollout_ids: list[str], *, archive: bool) -> int:
    """Each episode under its lease: a copy of its record archived (if readable), then deleted."""
    store: EpisodeStore
    if (root / "logs").is_dir():
        store = LogEpisodeStore(root, commit_delay=0, zero_ahead=0)  # a few writes: no batching, no zeros
    else:
        store = FilesystemEpisodeStore(root)
    failed = 0
    try:
        for rollout_id in rollout_ids:
            try:
                async with store.lease(rollout_id) as lease:
                    kept = None
                    if archive:
                        with contextlib.suppress(DataLoss):  # damaged: nothing readable to keep
                            kept = await store.archive(lease, ARCHIVE_REASON)
                    deleted = await store.delete(lease)
            except GymrpcError as exc:
                failed += 1
                print(f"gymrpc episodes: {rollout_id}: {exc.message}", file=sys.stderr)
                continue
            if deleted:
                print(f"deleted {rollout_id}" + (f"; its record is kept in {kept}" if kept else ""))
            else:
                print(f"{rollout_id}: nothing stored")
    finally:
        await store.close()
    return EXIT_FAILED if failed else EXIT_OK


def _read(folder: StoreFolder, entry: Entry) -> tuple[EpisodeCheckpoint | None, str | None]:
    """The entry's record (None: deleted), checked as the agent checks one before it continues or returns
    it; or why it cannot be read back."""
    try:
        record = folder.load(entry)
        if record is not None and record.phase == agent_pb.EPISODE_PHASE_COMPLETED:
            checkpoint.check_completed(record)
        elif record is not None and record.phase != agent_pb.EPISODE_PHASE_UNSPECIFIED:
            checkpoint.check_running(record)
    except GymrpcError as exc:
        return None, exc.message
    return record, None


class _Reading(Progress):
    """The rollouts' progress bar, counting records read."""

    def step(self) -> None:
        self.done += 1
        self.tick(force=self.done == self.total)

    def line(self) -> str:
        width = 24
        filled = round(width * self.done / self.total)
        rate = self.done / max(time.monotonic() - self.started, 1e-9)
        return f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} episodes, {rate:.0f}/s"


def _message_line(message: common_pb2.Message) -> str:
    """A message as one line: its role, its tool calls by name, its text with newlines shown as ⏎."""
    role = common_pb2.Role.Name(message.role).removeprefix("ROLE_").lower()
    parts = [message.content, *(f"{c.name}({c.arguments_json})" for c in message.tool_calls)]
    body = " ".join(p for p in parts if p).replace("\n", "⏎ ")
    return f"{role}: {body[:_LINE]}…" if len(body) > _LINE else f"{role}: {body}"


def _count(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {n}")
    return n


def _phase(phase: int) -> str:
    return agent_pb.EpisodePhase.Name(phase).removeprefix("EPISODE_PHASE_").lower()


def _time(stamp: Any) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(stamp.seconds))
