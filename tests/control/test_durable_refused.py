"""A stack with a durable-resume agent is refused by every controller, with the reason.

That agent is no `ParticipantService` participant (its per-episode store is its recovery), so a
coordinated checkpoint would silently leave its episodes out (docs/design.md §6).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gymrpc.client import Client
from gymrpc.controller import Controller, CoordinationError

ROOT = Path(__file__).resolve().parents[2]
WHY = "agent/durable runs durable resume (--resume-dir): it is not a ParticipantService participant"


def _config(episodes: Path) -> dict:
    return {
        "servers": [
            {"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}},
            {"name": "model/policy", "role": "model", "args": {"policy": "counter"}},
            {
                "name": "agent/durable",
                "role": "agent",
                "args": {"resources": "resources/counter", "model": "model/policy", "resume_dir": str(episodes)},
            },
        ]
    }


def _run(argv: list[str], run_dir: Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GYMRPC_RUN_DIR": str(run_dir)}
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=cwd)


def test_every_controller_refuses_a_stack_with_a_durable_agent(start_stack, run_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    stack = start_stack(_config(tmp_path / "episodes"))

    async def python_controller() -> None:
        async with Client(run_dir=stack.run_dir) as client:
            with pytest.raises(CoordinationError) as caught:
                await Controller(client).discover()
            assert set(caught.value.failures) == {"agent/durable"}
            assert caught.value.failures["agent/durable"].metadata["recovery"] == "durable"
            assert WHY in str(caught.value)

    asyncio.run(python_controller())

    ctl = _run([sys.executable, "-m", "gymrpc.cli", "ctl", "prepare", "c1"], stack.run_dir)
    assert ctl.returncode != 0
    assert WHY in ctl.stdout + ctl.stderr

    tasks = ROOT / "envs" / "counter" / "data" / "example.jsonl"
    rollouts = _run(
        [
            sys.executable,
            "-m",
            "gymrpc.cli",
            "rollouts",
            str(tasks),
            "--agent",
            "agent/durable",
            "--out",
            str(tmp_path / "out.jsonl"),
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--policy-version",
            "v0",
        ],
        stack.run_dir,
    )
    assert rollouts.returncode != 0
    assert WHY in rollouts.stderr
    assert not (tmp_path / "out.jsonl").exists()

    if shutil.which("node") is None or not (ROOT / "clients" / "node" / "node_modules").is_dir():
        pytest.skip("node or clients/node/node_modules missing: the Node controller is checked by tests/clients")
    node = _run(["node", "bin/gymrpc-node.js", "participants"], stack.run_dir, cwd=ROOT / "clients" / "node")
    assert node.returncode != 0
    assert WHY in node.stdout + node.stderr
