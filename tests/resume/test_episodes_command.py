"""`gymrpc episodes list | show | verify | delete` on a folder real agents wrote, one of them SIGKILLed mid-episode.

Two agents share one resume folder (two logs): one completes two episodes and stays up, the
other kills itself right after a durable boundary and is not restarted, leaving its episode in
progress. The reading commands must read both logs as an agent would, change nothing, and name
damage that a resume would answer DATA_LOSS for; `delete` must let such an episode start over
on the agent still up, and refuse one an agent holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import shlex
import time
from pathlib import Path
from typing import Any

import pytest

from gymrpc.cli import main
from gymrpc.client import Client
from gymrpc.errors import DataLoss
from gymrpc.store import FilesystemEpisodeStore, LogEpisodeStore, frames, ranges
from gymrpc.store.reader import StoreFolder
from tests.resume.helpers import POLICY, agent, crash_env, files, stack, task


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["episodes", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def folder(start_stack: Any, run_dir: Path) -> Path:
    store = run_dir / "episodes"
    config = stack(
        agent("agent/plain", store),
        agent("agent/crash", store, env=crash_env("after_tool:0", run_dir / "crashed")),
    )
    s = start_stack({**config, "restart": {"max_restarts": 0}})

    async def scenario() -> None:
        async with Client(run_dir=run_dir) as client:
            for i in range(2):
                await client.run(task(i), episode_id=f"done-{i}", policy_version=POLICY, agent="agent/plain")
            cut = asyncio.create_task(client.run(task(1), episode_id="cut", policy_version=POLICY, agent="agent/crash"))
            # The agent is down for good (no restarts): the run would wait for its name to come back.
            await asyncio.to_thread(s.wait_for, "agent/crash", lambda server: server["state"] == "failed", 120)
            cut.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await cut

    asyncio.run(scenario())
    assert (run_dir / "crashed").exists()
    return store


def test_list_show_and_verify_read_both_logs_and_change_nothing(folder: Path, capsys: Any) -> None:
    before = files(folder)

    code, out, _ = _run(capsys, "list", str(folder))
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:-1]}
    assert set(rows) == {"done-0", "done-1", "cut"}
    assert rows["done-0"][2] == "completed"
    assert rows["cut"][2] == "ready_for_tool"  # one of the turn's two increments applied, one pending
    assert out.splitlines()[-1] == (
        f"3 episodes in {folder}: 2 completed, 1 in progress, 0 damaged, 0 expired (0 deleted); "
        "2 logs, 1 in use by an agent"
    )

    code, out, _ = _run(capsys, "list", str(folder), "--json", "--state", "in-progress")
    (line,) = out.splitlines()
    cut = json.loads(line)
    assert (cut["rollout_id"], cut["state"], cut["policy_version"]) == ("cut", "in-progress", POLICY)
    assert cut["stored_bytes"] > 0
    assert cut["revision"] >= 2

    code, out, _ = _run(capsys, "show", str(folder), "cut")
    assert code == 0
    assert out.startswith("episode cut (attempt 0): in-progress, phase ready_for_tool")
    assert "1 tool call, 1 pending" in out
    assert "snapshot " in out
    conversation = out.split("  the last 3 messages of ", 1)[1].splitlines()
    assert [line.split(":")[0].strip() for line in conversation[1:]] == ["user", "assistant", "tool"]
    assert conversation[2] == '    assistant: increment_counter({"count": 4}) increment_counter({"count": 5})'
    code, out, _ = _run(capsys, "show", str(folder), "cut", "--messages", "0")
    assert "the last" not in out

    code, out, _ = _run(capsys, "show", str(folder), "done-1", "--json")
    shown = json.loads(out)
    assert (shown["phase"], shown["final_result"]["reward"]) == ("EPISODE_PHASE_COMPLETED", 1.0)

    code, out, _ = _run(capsys, "verify", str(folder))
    assert code == 0, out
    assert out.splitlines()[-1] == "3 episodes in 2 logs read back and checked: OK"
    assert files(folder) == before


def test_verify_names_an_episode_a_flipped_byte_made_unreadable_and_delete_lets_it_start_over(
    folder: Path, run_dir: Path, capsys: Any
) -> None:
    view = next(s for s in StoreFolder(folder).logs if not s.in_use)
    chain = view.view.index.chains["cut"]
    segment, offset, length = chain.frames[-1]
    path = view.view.folder / f"{segment:012d}.seg"
    data = bytearray(path.read_bytes())
    data[offset + length - 1] ^= 0xFF  # the last byte of the episode's last frame: its checksum fails
    path.write_bytes(bytes(data))

    code, out, _ = _run(capsys, "verify", str(folder))
    printed = out.splitlines()[-1]
    assert code == 1
    assert f"DAMAGED: segment {segment} bytes {offset}-" in out
    assert "the checkpoint of episode 'cut'" in out
    assert "lost to a damaged log region" in out
    assert out.splitlines()[-2] == "3 episodes in 2 logs read back and checked: DAMAGED (1 episode cannot be resumed)"
    assert out.splitlines()[-1] == f"to let them start over: gymrpc episodes delete {folder} cut"

    code, out, _ = _run(capsys, "verify", str(folder), "--json")
    report = json.loads(out)
    assert (code, report["ok"], [e["rollout_id"] for e in report["damaged_episodes"]]) == (1, False, ["cut"])

    code, out, err = _run(capsys, "show", str(folder), "cut")
    assert code == 1
    assert "lost to a damaged log region" in err

    async def run_cut() -> Any:
        async with Client(run_dir=run_dir) as client:
            return await client.run(task(1), episode_id="cut", policy_version=POLICY, agent="agent/plain")

    with pytest.raises(DataLoss) as refused:  # what a trainer's retry meets: the way out is in the message
        asyncio.run(run_cut())
    assert f"`gymrpc episodes delete {folder} cut` lets the episode start over" in refused.value.message
    code, out, _ = _run(capsys, "list", str(folder), "--state", "damaged")
    assert out.splitlines()[1].split()[:3] == ["cut", "-", "damaged"]  # nothing of its record is known

    # The command verify printed, as printed: the episode is let go, nothing readable was left to keep.
    command = shlex.split(printed.split(": ", 1)[1])
    assert command[:2] == ["gymrpc", "episodes"]
    code, out, _ = _run(capsys, *command[2:])
    assert (code, out) == (0, "deleted cut\n")
    code, out, _ = _run(capsys, "verify", str(folder))
    assert code == 3  # the flipped byte is still on the disk, but it holds nothing current now
    assert out.splitlines()[-1].endswith("every episode reads back, but 1 log region failed its checksums")
    code, out, _ = _run(capsys, "list", str(folder), "--json", "--state", "deleted")
    assert [json.loads(line)["rollout_id"] for line in out.splitlines()] == ["cut"]

    result = asyncio.run(run_cut())  # the agent still up on the folder runs the episode afresh
    assert (result.reward, result.resume_count) == (1.0, 0)
    code, out, _ = _run(capsys, "list", str(folder), "--json")
    assert {r["rollout_id"]: r["state"] for r in map(json.loads, out.splitlines())}["cut"] == "completed"


def test_delete_keeps_a_copy_and_refuses_an_episode_in_use(folder: Path, capsys: Any) -> None:
    held = ranges.RangeLocks(folder / ranges.FOLDER)  # another holder of done-0's lease, as a running agent is
    try:
        assert held.take(ranges.slot(hashlib.sha256(b"done-0").hexdigest()))
        code, out, err = _run(capsys, "delete", str(folder), "done-0", "done-1", "never-run")
    finally:
        held.close()
    assert code == 1
    assert "gymrpc episodes: done-0: episode 'done-0' is being run by another call" in err
    kept = out.splitlines()[0].split("; its record is kept in ")[1]
    assert out.splitlines() == [f"deleted done-1; its record is kept in {kept}", "never-run: nothing stored"]
    assert Path(kept).parent == folder / "archive"
    assert Path(kept).name.endswith(".deleted.ckpt")
    code, out, _ = _run(capsys, "list", str(folder), "--json")
    assert {json.loads(line)["rollout_id"] for line in out.splitlines()} == {"done-0", "cut"}


def test_delete_in_a_folder_of_the_files_store(tmp_path: Path, capsys: Any) -> None:
    async def write() -> None:
        store = FilesystemEpisodeStore(tmp_path)
        await _save_new(store, "ep-f")
        await store.close()

    asyncio.run(write())
    code, out, _ = _run(capsys, "delete", str(tmp_path), "ep-f", "--no-archive")
    assert (code, out) == (0, "deleted ep-f\n")
    assert not list((tmp_path / "episodes").rglob("*.ckpt"))
    assert not list((tmp_path / "archive").iterdir())
    assert not (tmp_path / "logs").exists()  # deleted by the folder's own store: no log made in it


def test_a_torn_tail_is_reported_not_counted_as_damage(tmp_path: Path, capsys: Any) -> None:
    async def write() -> None:
        store = LogEpisodeStore(tmp_path, zero_ahead=0)
        await _save_new(store, "ep-1")
        await store.close()

    asyncio.run(write())
    (segment,) = (tmp_path / "logs").glob("*/*.seg")
    with open(segment, "ab") as f:
        f.write(frames.MAGIC + b"\x07" * 100)  # a batch a crash cut short: never acknowledged

    code, out, _ = _run(capsys, "verify", str(tmp_path))
    assert code == 0
    assert "104 B past its last whole batch: never acknowledged, cut off by the next agent to adopt it" in out


def test_records_of_the_files_store_are_listed(tmp_path: Path, capsys: Any) -> None:
    async def write() -> None:
        store = FilesystemEpisodeStore(tmp_path)
        await _save_new(store, "ep-f")
        await store.close()

    asyncio.run(write())
    code, out, _ = _run(capsys, "list", str(tmp_path), "--json")
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert (code, row["rollout_id"], row["phase"], row["where"]) == (0, "ep-f", "unspecified", "files")


def test_bad_folders_and_unknown_episodes_are_clear_errors(tmp_path: Path, capsys: Any) -> None:
    code, _, err = _run(capsys, "list", str(tmp_path / "nowhere"))
    assert code == 2
    assert "is not an episode store folder" in err
    asyncio.run(LogEpisodeStore(tmp_path).close())
    code, _, err = _run(capsys, "show", str(tmp_path), "ep-x")
    assert code == 1
    assert f"no episode 'ep-x' in {tmp_path}" in err
    code, out, _ = _run(capsys, "list", str(tmp_path))
    assert code == 0
    assert out.startswith(f"0 episodes in {tmp_path}")


def test_a_record_past_its_ttl_is_listed_as_expired(tmp_path: Path, capsys: Any) -> None:
    async def write() -> None:
        store = LogEpisodeStore(tmp_path)
        await _save_new(store, "ep-old", expires_ns=time.time_ns() - 1)
        await _save_new(store, "ep-new", expires_ns=time.time_ns() + 3600 * 10**9)
        await store.close()

    asyncio.run(write())
    code, out, _ = _run(capsys, "list", str(tmp_path), "--json")
    assert code == 0
    assert {(r["rollout_id"], r["state"]) for r in map(json.loads, out.splitlines())} == {
        ("ep-old", "expired"),
        ("ep-new", "in-progress"),
    }


async def _save_new(store: Any, rollout_id: str, expires_ns: int = 0) -> None:
    from gymrpc.servers.agent import checkpoint
    from gymrpc.servers.agent.state import EpisodeState

    state = EpisodeState(rollout_id, 0, task(0), 8, policy_version=POLICY)
    record = checkpoint.new_record(state, checkpoint.fingerprint(state.task))
    if expires_ns:
        record.expires_at.FromNanoseconds(expires_ns)
    async with store.lease(rollout_id) as lease:
        await store.save(lease, record)


def test_a_large_folder_reads_with_progress_on_stderr(tmp_path: Path, capsys: Any) -> None:
    async def write() -> None:
        store = LogEpisodeStore(tmp_path)
        await asyncio.gather(*(_save_new(store, f"ep-{i:03d}") for i in range(500)))
        await store.close()

    asyncio.run(write())
    code, out, err = _run(capsys, "list", str(tmp_path), "--json")
    assert code == 0
    assert len(out.splitlines()) == 500
    assert err.splitlines()[-1].startswith("reading [########################] 500/500 episodes, ")
