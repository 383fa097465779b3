"""The Node controller (clients/node): stubs current, and its tests against real Python stacks.

Node dependencies come from the committed lockfile (`npm ci`, re-run only when the lockfile
changed). The generated stubs are committed and compared with a fresh `buf generate`.
"""

from __future__ import annotations

import asyncio
import filecmp
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gymrpc.balancing import place
from gymrpc.servers.agent.state import session_id_for
from tests.control.test_checkpoint_index import EPISODES, ReplicaClient, close, controller_of, seeded

ROOT = Path(__file__).resolve().parents[2]
NODE_PROJECT = ROOT / "clients" / "node"
BUF = Path(sys.executable).parent / "buf"
STAMP = NODE_PROJECT / "node_modules" / ".gymrpc-lockfile-sha256"
# The model emits a token every 50 ms, so a model call is still running when the checkpoint comes.
PARTICIPANTS_STACK = {
    "servers": [
        {"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}},
        {"name": "model/policy", "role": "model", "args": {"policy": "counter", "token_delay": 0.05}},
    ]
}
AGENT_STACK = {
    "servers": [
        *PARTICIPANTS_STACK["servers"],
        {"name": "agent/counter", "role": "agent", "args": {"resources": "resources/counter", "model": "model/policy"}},
    ]
}
REPLICA_EPISODES = [f"node-rep-{i}" for i in range(6)]


def replica_stack(resources: int) -> dict[str, Any]:
    """AGENT_STACK with `resources` replicas of resources/counter."""
    servers = [dict(s, replicas=resources) if s["name"] == "resources/counter" else s for s in AGENT_STACK["servers"]]
    return {"servers": servers}


@pytest.fixture(scope="module")
def node_project() -> Path:
    """clients/node with its dependencies installed from the lockfile."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed (CI has Node 20); the Node controller is not tested")
    lock = hashlib.sha256((NODE_PROJECT / "package-lock.json").read_bytes()).hexdigest()
    if not STAMP.exists() or STAMP.read_text() != lock:
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_PROJECT, check=True, capture_output=True, timeout=600
        )
        STAMP.write_text(lock)
    return NODE_PROJECT


def node_test(project: Path, *test_files: str, **env: str) -> dict[str, int]:
    """Run Node test files; fail on any failure; return the TAP counts (pass, skipped, ...)."""
    proc = subprocess.run(
        ["node", "--test", "--test-reporter=tap", *test_files],
        cwd=project,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, f"node --test {' '.join(test_files)} failed:\n{proc.stdout}\n{proc.stderr}"
    return {key: int(value) for key, value in re.findall(r"^# (\w+) (\d+)$", proc.stdout, re.MULTILINE)}


def test_committed_stubs_match_a_fresh_buf_generate(node_project: Path, tmp_path: Path) -> None:
    subprocess.run(
        [str(BUF), "generate", "--template", "buf.gen.yaml", "--output", str(tmp_path)],
        cwd=node_project,
        check=True,
        capture_output=True,
        timeout=120,
    )
    fresh, committed = tmp_path / "gen", node_project / "gen"
    stale = _differences(fresh, committed)
    assert stale == [], f"clients/node/gen is stale ({', '.join(stale)}): run `npm run generate` in clients/node"


def _differences(a: Path, b: Path) -> list[str]:
    files = {p.relative_to(a) for p in a.rglob("*") if p.is_file()} | {
        p.relative_to(b) for p in b.rglob("*") if p.is_file()
    }
    return sorted(
        str(f) for f in files if not (a / f).exists() or not (b / f).exists() or not filecmp.cmp(a / f, b / f, False)
    )


def test_unit_tests(node_project: Path) -> None:
    counts = node_test(node_project, "test/unit.test.js", "test/controller.test.js")
    assert counts["skipped"] == 0
    assert counts["pass"] >= 10


def test_the_node_controller_reads_and_checks_an_index_the_python_controller_wrote(
    node_project: Path, tmp_path: Path
) -> None:
    """One index format for both controllers (`gymrpc.v1.CheckpointIndex` in JSON)."""

    async def checkpoint() -> Path:
        replicas = await seeded()
        controller = controller_of(ReplicaClient(replicas))
        result = await controller.checkpoint(tmp_path, episode_ids=EPISODES, checkpoint_id="c1")
        await close(replicas)
        return result.checkpoint_dir

    folder = asyncio.run(checkpoint())

    def inspect() -> subprocess.CompletedProcess[str]:
        argv = ["node", "bin/gymrpc-node.js", "inspect", str(folder)]
        return subprocess.run(argv, cwd=node_project, capture_output=True, text=True, timeout=60, check=False)

    read = inspect()
    assert read.returncode == 0, read.stderr
    index = json.loads(read.stdout)
    assert index == json.loads((folder / "checkpoint.json").read_text())
    (folder / "resources" / "counter#1" / "manifest.json").write_text("{}")
    refused = inspect()
    assert refused.returncode == 1
    assert "resources/counter#1/manifest.json is not the manifest that was committed" in refused.stderr


def test_names_episodes_and_a_killed_agent_against_a_python_stack(node_project: Path, start_stack) -> None:
    stack = start_stack()
    counts = node_test(node_project, "test/stack.test.js", GYMRPC_RUN_DIR=str(stack.run_dir))
    assert counts["skipped"] == 0
    assert counts["pass"] == 4


def checkpoint_scenario(
    project: Path,
    start_stack: Callable[..., Any],
    first: Any,
    config: dict,
    test_file: str,
    scenario_dir: Path,
    between: Callable[[], None] | None = None,
    **extra: str,
) -> None:
    """Phase 1 on the `first` stack (it ends by SIGKILLing it), `between`, phase 2 on a fresh one of `config`."""
    env = {"GYMRPC_NODE_SCENARIO_DIR": str(scenario_dir), **extra}
    counts = node_test(project, test_file, GYMRPC_RUN_DIR=str(first.run_dir), GYMRPC_NODE_PHASE="checkpoint", **env)
    assert counts["pass"] == 1
    assert first.process.wait(timeout=10) == -9  # the Node test SIGKILLed the whole stack
    if between is not None:
        between()

    fresh = start_stack(config)  # new processes, same run folder
    counts = node_test(project, test_file, GYMRPC_RUN_DIR=str(fresh.run_dir), GYMRPC_NODE_PHASE="restore", **env)
    assert counts["pass"] == 1


@pytest.mark.slow
def test_checkpoint_sigkill_restore_and_the_episode_continues(node_project: Path, start_stack, tmp_path: Path) -> None:
    """The episode is driven by a stand-in agent in Node, over the resources and model participants."""
    first = start_stack(PARTICIPANTS_STACK)
    checkpoint_scenario(node_project, start_stack, first, PARTICIPANTS_STACK, "test/checkpoint.test.js", tmp_path)


@pytest.mark.slow
def test_checkpoint_through_the_agent(node_project: Path, start_stack, tmp_path: Path) -> None:
    """The same scenario through AgentService: the agent parks, is checkpointed and continues the episode."""
    first = start_stack(AGENT_STACK)
    services = subprocess.run(
        [sys.executable, "-m", "gymrpc.cli", "call", "--run-dir", str(first.run_dir), "agent/counter", "list"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if "gymrpc.v1.ParticipantService" not in services:
        pytest.skip("the agent server does not serve ParticipantService yet (issue 5)")
    checkpoint_scenario(node_project, start_stack, first, AGENT_STACK, "test/agent-checkpoint.test.js", tmp_path)


@pytest.mark.slow
def test_a_checkpoint_of_resources_replicas_restores_onto_another_replica_count(
    node_project: Path, start_stack, tmp_path: Path
) -> None:
    """resources/counter x2 -> x3 through the Node controller: every replica is a member, commits its
    own folder, and installs on restore the sessions `gymrpc.balancing.place` puts on it."""
    sessions = {e: session_id_for(e, 0) for e in REPLICA_EPISODES}
    placement = {
        "checkpoint": {e: place(s, ["0", "1"]) for e, s in sessions.items()},
        "restore": {e: place(s, ["0", "1", "2"]) for e, s in sessions.items()},
    }
    assert len(set(placement["restore"].values())) == 3  # the episodes really spread over every replica

    def python_reads_the_index() -> None:
        folder = json.loads((tmp_path / "replicas-handover.json").read_text())["checkpointDir"]
        inspect = subprocess.run(
            [sys.executable, "-m", "gymrpc.cli", "ctl", "inspect", folder, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert inspect.returncode == 0, inspect.stderr
        members = json.loads(inspect.stdout)["index"]["members"]
        assert [(m["name"], m["endpoint_id"]) for m in members if m["name"] == "resources/counter"] == [
            ("resources/counter", "0"),
            ("resources/counter", "1"),
        ]

    first = start_stack(replica_stack(2))
    checkpoint_scenario(
        node_project,
        start_stack,
        first,
        replica_stack(3),
        "test/replicas-checkpoint.test.js",
        tmp_path,
        between=python_reads_the_index,
        GYMRPC_NODE_PLACEMENT=json.dumps(placement),
    )


PLAINTEXT_PROBE = """
import { GymClient } from "./src/index.js";
const gym = new GymClient({ tls: false, timeoutMs: 3000 });  // plaintext against a TLS stack
try {
  await gym.resolve("agent/counter");
  console.log("ANSWERED");
} catch (err) {
  console.log(`REFUSED ${err.code}`);
} finally {
  gym.close();
}
"""


def test_names_and_episodes_against_a_tls_stack(node_project: Path, start_stack) -> None:
    """The Node client learns TLS and mTLS from the run folder's tls.json, and sends the token."""
    stack = start_stack(None, "--tls")
    counts = node_test(node_project, "test/stack.test.js", GYMRPC_RUN_DIR=str(stack.run_dir))
    assert counts["skipped"] == 0
    assert counts["pass"] == 4
    probe = subprocess.run(
        ["node", "--input-type=module", "-e", PLAINTEXT_PROBE],
        cwd=node_project,
        env={**os.environ, "GYMRPC_RUN_DIR": str(stack.run_dir)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert probe.stdout.startswith("REFUSED"), probe.stdout + probe.stderr
