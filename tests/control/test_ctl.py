"""`gymrpc ctl` against a real stack (`gymrpc up`: resources and model servers serving ParticipantService).

A manual checkpoint of a live session, a SIGKILL of every participant, a manual restore into
the fresh processes, then retire and forget; refusals print the participant, code and reason
and exit 1. Commands run in-process through `gymrpc.cli.main` (fast); one runs as a subprocess
to cover the installed entry point.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gymrpc import cli
from gymrpc.client import Client
from gymrpc.v1 import common_pb2
from gymrpc.v1 import resources_service_pb2 as res_pb
from tests.agent.fakes import counter_task
from tests.control.test_process import restart_all

PARTICIPANTS = ("model/policy", "resources/counter")
CONFIG = {
    "restart": {"max_restarts": 5, "window_seconds": 60, "backoff_seconds": 0.05},
    "servers": [
        {"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}},
        {"name": "model/policy", "role": "model", "args": {"policy": "counter"}},
    ],
}


class Ctl:
    def __init__(self, run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
        self.run_dir, self.capsys = run_dir, capsys

    def __call__(self, *argv: str, code: int = 0) -> tuple[str, str]:
        self.capsys.readouterr()
        got = cli.main(["--run-dir", str(self.run_dir), "ctl", *argv])
        out, err = self.capsys.readouterr()
        assert got == code, f"gymrpc ctl {' '.join(argv)} exited {got}, expected {code}:\n{out}\n{err}"
        return out, err

    def json(self, *argv: str, code: int = 0) -> Any:
        return json.loads(self(*argv, "--json", code=code)[0])


def seed(run_dir: Path, rollout: str, attempt: int = 0) -> None:
    async def main() -> None:
        async with Client(run_dir=run_dir) as client:
            request = res_pb.SeedSessionRequest(
                session_id=rollout,
                episode_id=common_pb2.EpisodeId(rollout_id=rollout, attempt=attempt),
                task=counter_task("count", 0, 3),
            )
            stub: Any = client.resources("resources/counter")
            await stub.SeedSession(request, timeout=10)

    asyncio.run(main())


def test_ctl_drives_every_participant_rpc(start_stack: Any, capsys: pytest.CaptureFixture[str]) -> None:
    stack = start_stack(CONFIG)
    ctl = Ctl(stack.run_dir, capsys)
    folder = stack.run_dir / "checkpoints" / "c1"

    out, _ = ctl("status")
    assert out.splitlines()[0].split()[:3] == ["NAME", "KIND", "PHASE"]
    assert sorted(line.split()[0] for line in out.splitlines()[1:]) == sorted(PARTICIPANTS)
    seed(stack.run_dir, "e1")

    out, _ = ctl("prepare", "c1", "--deadline", "10")
    assert "model/policy: prepared" in out
    assert "resources/counter: prepared" in out
    statuses = ctl.json("status")
    assert {s["phase"] for s in statuses.values()} == {"PARTICIPANT_PHASE_PREPARED"}
    assert {s["checkpoint_id"] for s in statuses.values()} == {"c1"}

    _, err = ctl("retire", "op1", "--episodes", "e1", code=1)  # refused while a checkpoint is open
    assert "resources/counter: FAILED_PRECONDITION INVALID_PHASE" in err
    failure = ctl.json("prepare", "c2", code=1)["error"]
    assert {f["reason"] for f in failure["failures"].values()} == {"CHECKPOINT_CONFLICT"}

    manifests = ctl.json("commit", "c1", "--dir", str(folder), "--episodes", "e1")
    assert manifests["resources/counter"]["record_count"] == "1"  # uint64 is a JSON string
    assert manifests["resources/counter"]["episode_ids"] == [{"rollout_id": "e1"}]
    assert ctl.json("renew", "c1")["model/policy"]["lease_expire_time"]
    out, _ = ctl("resume", "c1")
    assert "resources/counter: idle" in out
    assert "(already resumed)" in ctl("resume", "c1")[0]
    assert ctl.json("prepare", "c1", code=1)["error"]["failures"]["model/policy"]["reason"] == "STALE_CHECKPOINT"

    _, err = ctl("restore", "x0", "--dir", str(folder), "--episodes", "e1", code=1)  # these processes served
    assert "restore only into freshly started processes" in err
    restart_all(stack, PARTICIPANTS)
    failure = ctl.json("restore", "x1", "--dir", str(folder.parent / "missing"), "--episodes", "e1", code=1)
    assert {f["code"] for f in failure["error"]["failures"].values()} == {"NOT_FOUND"}
    restart_all(stack, PARTICIPANTS)  # the failed restore fenced attempt 1: start over with fresh processes
    out, _ = ctl("restore", "x2", "--dir", str(folder), "--episodes", "e1")
    assert "resources/counter: restored 1 episodes from c1: e1:1" in out
    statuses = ctl.json("status")
    assert {s["phase"] for s in statuses.values()} == {"PARTICIPANT_PHASE_RESTORED"}
    ctl("resume", "x2")

    out, _ = ctl("retire", "op2", "--episodes", "e1:1")
    assert "model/policy: retired e1:1" in out
    assert all(s["retired"] == {"e1": 1} for s in ctl.json("status").values())
    assert "forgot e1" in ctl("forget", "op3", "--rollouts", "e1")[0]
    assert all("retired" not in s for s in ctl.json("status").values())

    out, _ = ctl("checkpoint", "--dir", str(folder.parent), "--id", "c3")
    assert f"checkpoint c3 committed in {folder.parent / 'c3'}" in out
    assert (folder.parent / "c3" / "resources" / "counter" / "manifest.json").exists()

    # Bad input never reaches a participant.
    _, err = ctl("prepare", "../etc", code=2)
    assert "is invalid" in err
    _, err = ctl("status", "no/such", code=1)
    assert "never registered" in err
    proc = subprocess.run(
        [sys.executable, "-m", "gymrpc.cli", "--run-dir", str(stack.run_dir), "ctl", "status", "model/policy"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1].split()[:3] == ["model/policy", "model", "idle"]


def test_ctl_without_a_stack_exits_4(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--run-dir", str(tmp_path), "ctl", "status"]) == 4
    assert "no stack found" in capsys.readouterr().err
