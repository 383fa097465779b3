"""Replicas behind one name with the local launcher: registration, affinity under load, failover, resume.

The same behaviour runs on Ray in `test_ray_cluster.py`; here it needs no cluster.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gymrpc.balancing import place
from gymrpc.client import Client
from gymrpc.envs.counter import example_tasks_path
from gymrpc.launch.spec import parse_stack_spec
from gymrpc.launch.storage import CheckpointDirError, check_checkpoint_dir, write_marker
from gymrpc.rollouts import EpisodeResult, Summary, load_tasks
from gymrpc.servers.agent.state import session_id_for
from tests.ray import episodes, sessions
from tests.resume.helpers import POLICY

ROOT = Path(__file__).resolve().parents[2]
NO_RESTARTS = {"max_restarts": 0}


def counters(replicas: int, **extra: Any) -> dict[str, Any]:
    server = {"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}}
    return {"lease_ttl": 3, **extra, "servers": [server | {"replicas": replicas}]}


def test_replicas_register_under_one_name_with_their_endpoint_ids(start_stack: Any) -> None:
    stack = start_stack(counters(3))
    states = {s["name"]: s for s in stack.state()["servers"]}
    labels = [f"resources/counter#{i}" for i in range(3)]
    assert [states[label]["endpoint_id"] for label in labels] == ["0", "1", "2"]
    assert len({states[label]["pid"] for label in labels}) == 3

    async def endpoints() -> list[tuple[str, str]]:
        async with Client(run_dir=stack.run_dir) as client:
            return [(e.endpoint_id, e.address) for e in await client.registry.resolve("resources/counter")]

    assert asyncio.run(endpoints()) == [(str(i), states[label]["address"]) for i, label in enumerate(labels)]
    stack.kill("resources/counter#1")
    stack.wait_for("resources/counter#1", lambda s: s["state"] == "serving" and s["restarts"] == 1)
    assert [stack.server(label)["restarts"] for label in labels] == [0, 1, 0]
    status = subprocess.run(
        [sys.executable, "-m", "gymrpc.cli", "status", "--run-dir", str(stack.run_dir)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
    )
    assert all(f"{label}  serving  SERVING" in status.stdout for label in labels), status.stdout


def test_session_affinity_holds_under_load_and_only_a_failover_moves_a_session(start_stack: Any) -> None:
    stack = start_stack(counters(4, restart=NO_RESTARTS))

    async def scenario() -> list[sessions.Outcome]:
        async with Client(run_dir=stack.run_dir) as client:

            async def kill() -> None:
                stack.kill("resources/counter#1")

            return await sessions.drive(client, "resources/counter", 40, after_first=kill)

    sessions.check_affinity(asyncio.run(scenario()), replicas=4, killed="1")


@pytest.mark.slow
def test_an_agent_replica_killed_mid_episode_its_episodes_resume_on_the_other(start_stack: Any, run_dir: Path) -> None:
    store = run_dir / "store"
    stack = start_stack(episodes.stack(store, agents=2, resources=2, restart=NO_RESTARTS))
    tasks = episodes.episodes(8)
    placed: dict[str, str | None] = {}

    def kill(client: Client) -> None:
        placed.update({e: client.balancer.endpoint_of("agent/simple", e) for e in tasks})
        stack.kill("agent/simple#0")

    async def scenario() -> tuple[dict[str, Any], dict[str, int]]:
        async with Client(run_dir=stack.run_dir) as client:
            results = await episodes.run_and_kill(client, tasks, store, kill)
            return results, {e: client.balancer.failovers("agent/simple", e) for e in tasks}

    results, failovers = asyncio.run(scenario())
    episodes.check_results(results, tasks)
    moved = {e for e, where in placed.items() if where == "0"}
    assert moved, f"no episode ran on the killed replica: {placed}"
    assert moved != set(tasks), f"every episode ran on the killed replica: {placed}"
    for e, trajectory in results.items():
        # The trajectory counts the move of its `Run` (its model and resources calls did not move).
        expected = (1, 1, 1) if e in moved else (0, 0, 0)
        assert (failovers[e], trajectory.failovers, trajectory.resume_count) == expected, e
    # `gymrpc rollouts` reports them in its summary.
    task = load_tasks(example_tasks_path())[0]
    summary = Summary([EpisodeResult(task, 0, "agent/simple", POLICY, 0.0, 1.0, t) for t in results.values()], 1.0, 8)
    assert summary.to_json()["failovers"] == len(moved)
    assert f"failovers {len(moved)} calls of {len(moved)} episodes moved to another replica" in summary.lines()


@pytest.mark.slow
def test_a_resources_replica_killed_the_agent_restores_its_sessions_on_the_other(
    start_stack: Any, run_dir: Path
) -> None:
    store = run_dir / "store"
    stack = start_stack(episodes.stack(store, agents=1, resources=2, restart=NO_RESTARTS))
    tasks = episodes.episodes(6)

    async def scenario() -> dict[str, Any]:
        async with Client(run_dir=stack.run_dir) as client:
            return await episodes.run_and_kill(client, tasks, store, lambda _: stack.kill("resources/counter#0"))

    results = asyncio.run(scenario())
    episodes.check_results(results, tasks)
    # Sessions were placed by rendezvous hashing over both replicas: those on replica 0 moved once.
    moved = {e for e in tasks if place(session_id_for(e, 0), ["0", "1"]) == "0"}
    assert moved, "no session was on the killed replica"
    assert {e: t.failovers for e, t in results.items()} == {e: int(e in moved) for e in tasks}
    log = (run_dir / "logs" / "agent__simple.log").read_text()
    assert "replica unavailable; its sessions move to other replicas" in log
    assert "the resources session was lost; continuing from the last checkpoint" in log


# -- checkpoint folders --------------------------------------------------------------------------


def test_a_checkpoint_folder_that_cannot_be_created_fails_up_with_the_folder_and_the_step(run_dir: Path) -> None:
    (run_dir / "file").write_text("not a folder")
    config = episodes.stack(run_dir / "file" / "store")
    (run_dir / "stack.yaml").write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [sys.executable, "-m", "gymrpc.cli", "up", "--run-dir", str(run_dir), str(run_dir / "stack.yaml")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=90,
    )
    assert result.returncode == 1
    assert f"agent/simple: checkpoint folder {run_dir / 'file' / 'store'}" in result.stderr
    assert "cannot create the folder" in result.stderr


def test_an_agent_whose_resume_dir_is_unusable_exits_at_start_with_the_folder_and_the_step(run_dir: Path) -> None:
    """The agent checks its own folder too (started by hand, or by a launcher that does not check)."""
    (run_dir / "file").write_text("not a folder")
    folder = run_dir / "file" / "store"
    argv = ["--registry", f"unix:{run_dir}/none.sock", "--resume-dir", str(folder)]
    result = subprocess.run(
        [sys.executable, "-m", "gymrpc.servers.agent", *argv], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert result.returncode == 2, result.stderr
    assert f"--resume-dir: checkpoint folder {folder} on " in result.stderr
    assert "cannot create the folder" in result.stderr


def test_check_checkpoint_dir_proves_every_operation_the_shared_marker_and_the_lock(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    marker = write_marker(folder)
    assert check_checkpoint_dir(folder, marker=marker.proof)  # the filesystem type, e.g. ext4 or overlay
    assert sorted(p.name for p in folder.iterdir()) == [marker.name]  # the probe is gone
    with pytest.raises(CheckpointDirError, match="holds other content: a different folder"):
        check_checkpoint_dir(folder, marker=(marker.name, "something else"))
    with pytest.raises(CheckpointDirError, match="is the folder shared with the launcher's node"):
        check_checkpoint_dir(tmp_path / "elsewhere", marker=marker.proof)
    os.close(marker.fd)  # as if neither lock reached from the launcher's node to this one
    marker.fd = -1
    with pytest.raises(CheckpointDirError, match="OFD locks here do not see the launcher's lock"):
        check_checkpoint_dir(folder, marker=marker.proof)
    with pytest.raises(CheckpointDirError, match="flock here ignores the launcher's lock"):
        check_checkpoint_dir(folder, marker=marker.proof, ofd=False)  # the files store's agents
    marker.remove()
    assert list(folder.iterdir()) == []


# -- config --------------------------------------------------------------------------------------


def test_placement_and_replicas_parse_and_default() -> None:
    spec = parse_stack_spec(
        {
            "launcher": "ray",
            "ray": {"address": "auto", "namespace": "team-a"},
            "servers": [
                {
                    "name": "model/policy",
                    "role": "model",
                    "num_gpus": 1,
                    "num_cpus": 2,
                    "resources": {"gpu-node": 1},
                    "node": "10.0.0.7",
                },
                {"name": "agent/simple", "role": "agent", "replicas": 4},
            ],
        }
    )
    model, agent = spec.servers
    assert (spec.launcher, spec.ray.address, spec.ray.namespace) == ("ray", "auto", "team-a")
    assert (model.num_gpus, model.num_cpus, model.node) == (1.0, 2.0, "10.0.0.7")
    assert dict(model.resources) == {"gpu-node": 1.0}
    assert (agent.replicas, agent.num_cpus, agent.num_gpus, agent.node) == (4, 1.0, 0.0, None)
    assert [agent.label(e) for e in agent.endpoint_ids()] == [f"agent/simple#{i}" for i in range(4)]
    assert model.label("0") == "model/policy"


@pytest.mark.parametrize(
    ("server", "top", "message"),
    [
        ({"replicas": 0}, {}, "replicas must be an integer from 1 to 1024"),
        ({"replicas": "2"}, {}, "replicas must be an integer"),
        ({"replicas": 2, "bind": "127.0.0.1:5000"}, {}, "their bind must end in ':0'"),
        ({"num_gpus": -1}, {}, "num_gpus must be a number >= 0"),
        ({"resources": ["head"]}, {}, "resources must be a mapping"),
        ({"resources": {"head": "x"}}, {}, "resources.head must be a number"),
        ({}, {"ray": "auto"}, "ray: must be a mapping"),
        ({}, {"ray": {"adress": "auto"}}, "unexpected keyword argument 'adress'"),
        ({}, {"ray": {"namespace": ""}}, "namespace must be a non-empty string"),
    ],
)
def test_bad_placement_is_refused_with_the_key_named(server: dict, top: dict, message: str) -> None:
    config = {**top, "servers": [{"name": "a/b", "role": "resources", **server}]}
    with pytest.raises(ValueError, match="stack config") as info:
        parse_stack_spec(config)
    assert message in str(info.value)
