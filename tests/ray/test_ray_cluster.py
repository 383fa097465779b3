"""The Ray launcher on a two-node local cluster: placement, restarts, discovery, affinity, failover.

`gymrpc up` runs as a user runs it (a subprocess, `launcher: ray` with the cluster's address);
servers are SIGKILLed by pid, host actors by their worker's pid.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
from pathlib import Path
from typing import Any

import pytest

from gymrpc.client import Client
from tests.ray import episodes, sessions
from tests.ray.conftest import HEAD_IP, WORKER_IP, RayCluster
from tests.resume.helpers import POLICY

pytestmark = pytest.mark.slow
SMALL = {"num_cpus": 0.25}
"""Each replica's CPU request: the cluster has 2 + 2 CPUs and a stack has up to 8 servers."""

JOB = """
import asyncio, json, sys
import ray
import gymrpc
from gymrpc.v1 import resources_service_pb2 as pb


async def tools():
    async with gymrpc.Client() as client:  # no address, no run folder: found through Ray
        reply = await client.resources("resources/counter").ListTools(pb.ListToolsRequest())
        return [t.name for t in reply.tools], client.registry.target


@ray.remote(num_cpus=0, resources={"worker": 0.01})
def in_a_task():
    return *asyncio.run(tools()), ray.util.get_node_ip_address()


ray.init(address=sys.argv[1], logging_level="ERROR")
names, target = asyncio.run(tools())
print(json.dumps({"driver": [names, target], "task": ray.get(in_a_task.remote())}))
"""


def ray_stack(
    cluster: RayCluster, config: dict[str, Any], run_dir: Path, namespace: str | None = None
) -> dict[str, Any]:
    """`config` on the cluster; server logs in the run folder, as with the local launcher (one machine here)."""
    ray = {
        "address": cluster.address,
        "namespace": namespace or f"test-{secrets.token_hex(4)}",
        "log_dir": str(run_dir / "logs"),
    }
    return {**config, "launcher": "ray", "ray": ray}


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


@pytest.fixture(autouse=True)
def _cluster_env(ray_cluster: RayCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """`gymrpc up` (started with this process's environment) joins the cluster with its token."""
    for key, value in ray_cluster.ray_env().items():
        monkeypatch.setenv(key, value)


def test_placement_restarts_and_discovery(ray_cluster: RayCluster, start_stack: Any, run_dir: Path) -> None:
    store = run_dir / "store"
    config = episodes.stack(store, resources=2, placement=SMALL)
    model, agent = config["servers"][1], config["servers"][2]
    model["resources"] = {"head": 0.1}  # a custom resource only the head node has
    agent["node"] = WORKER_IP  # node affinity, by the node's IP
    stack = start_stack(ray_stack(ray_cluster, config, run_dir, namespace="gymrpc"))  # the default namespace
    nodes = {s["name"]: s["node"] for s in stack.state()["servers"]}
    assert nodes["model/policy"] == HEAD_IP
    assert nodes["agent/simple"] == WORKER_IP
    assert {nodes["resources/counter#0"], nodes["resources/counter#1"]} == {HEAD_IP, WORKER_IP}  # spread
    for name, state in ((s["name"], s) for s in stack.state()["servers"]):
        assert state["address"].startswith(f"{state['node']}:"), name  # bound on its own node's address

    # A Ray job finds the stack by the registry actor's name, in its driver and in a task on the worker.
    job = ray_cluster.python(JOB)
    assert job.returncode == 0, job.stderr[-3000:]
    found = json.loads(job.stdout.strip().splitlines()[-1])
    registry = stack.state()["registry"]
    assert found["driver"] == [["increment_counter", "get_counter_value"], registry]
    assert found["task"] == [["increment_counter", "get_counter_value"], registry, WORKER_IP]

    tasks = episodes.episodes(2, "before")
    killed_agent = stack.server("agent/simple")["pid"]

    async def agent_killed_mid_episode() -> dict[str, Any]:
        async with Client(run_dir=run_dir) as client:
            return await episodes.run_and_kill(client, tasks, store, lambda _: os.kill(killed_agent, signal.SIGKILL))

    results = asyncio.run(agent_killed_mid_episode())
    episodes.check_results(results, tasks)
    assert all(t.resume_count == 1 for t in results.values())  # continued from the checkpoint, not rerun
    agent_state = stack.wait_for("agent/simple", lambda s: s["state"] == "serving" and s["restarts"] == 1)
    assert agent_state["pid"] != killed_agent
    assert agent_state["node"] == WORKER_IP

    # Kill the model's host actor (its Ray worker process): Ray restarts the actor, which starts the server again.
    model_pid = stack.server("model/policy")["pid"]
    os.kill(parent_pid(model_pid), signal.SIGKILL)
    model_state = stack.wait_for(
        "model/policy", lambda s: s["state"] == "serving" and s["restarts"] == 1 and s["pid"] != model_pid, 60
    )
    assert model_state["node"] == HEAD_IP
    after = episodes.episodes(2, "after")

    async def run_after() -> list[Any]:
        async with Client(run_dir=run_dir) as client:
            return await asyncio.gather(
                *(client.run(t, episode_id=e, policy_version=POLICY, timeout=60) for e, t in after.items())
            )

    episodes.check_results(dict(zip(after, asyncio.run(run_after()), strict=True)), after)


def test_affinity_under_load_and_an_agent_replica_failover(
    ray_cluster: RayCluster, start_stack: Any, run_dir: Path
) -> None:
    store = run_dir / "store"
    config = episodes.stack(store, agents=2, resources=4, placement=SMALL, restart={"max_restarts": 0})
    stack = start_stack(ray_stack(ray_cluster, config, run_dir))
    nodes = {s["name"]: s["node"] for s in stack.state()["servers"]}
    assert {nodes[f"resources/counter#{i}"] for i in range(4)} == {HEAD_IP, WORKER_IP}
    assert {nodes["agent/simple#0"], nodes["agent/simple#1"]} == {HEAD_IP, WORKER_IP}

    async def load() -> list[sessions.Outcome]:
        async with Client(run_dir=run_dir) as client:

            async def kill() -> None:
                stack.kill("resources/counter#1")

            return await sessions.drive(client, "resources/counter", 32, after_first=kill)

    sessions.check_affinity(asyncio.run(load()), replicas=4, killed="1")

    tasks = episodes.episodes(6)
    placed: dict[str, str | None] = {}

    def kill_agent(client: Client) -> None:
        placed.update({e: client.balancer.endpoint_of("agent/simple", e) for e in tasks})
        stack.kill("agent/simple#0")

    async def failover() -> tuple[dict[str, Any], dict[str, int]]:
        async with Client(run_dir=run_dir) as client:
            results = await episodes.run_and_kill(client, tasks, store, kill_agent)
            return results, {e: client.balancer.failovers("agent/simple", e) for e in tasks}

    results, failovers = asyncio.run(failover())
    episodes.check_results(results, tasks)
    moved = {e for e, where in placed.items() if where == "0"}
    assert moved, f"no episode ran on the killed replica: {placed}"
    for e, trajectory in results.items():
        expected = (1, 1, 1) if e in moved else (0, 0, 0)
        assert (failovers[e], trajectory.failovers, trajectory.resume_count) == expected, e


def test_replicas_on_both_nodes_checkpointed_killed_and_restored_onto_other_replica_counts(
    ray_cluster: RayCluster, start_stack: Any, run_dir: Path
) -> None:
    """Agents and resources x2 spread over both nodes are checkpointed, every process is SIGKILLed, and
    a stack with agents x1, resources x3 and model x2 is restored from it: each record lands on the
    replica clients route its calls to, and every episode ends as an uninterrupted one."""
    from tests.control import replica_stack

    def start(config: dict[str, Any]) -> Any:
        for server in config["servers"]:
            server.update(SMALL)
        stack = start_stack(ray_stack(ray_cluster, config, run_dir))
        nodes: dict[str, set[str]] = {}
        for state in stack.state()["servers"]:
            nodes.setdefault(state["name"].partition("#")[0], set()).add(state["node"])
        for server in config["servers"]:
            if server["replicas"] > 1:
                assert nodes[server["name"]] == {HEAD_IP, WORKER_IP}, server["name"]  # spread over both nodes
        return stack

    replica_stack.run_scenario(
        start,
        run_dir,
        before={"agent/simple": 2, "resources/counter": 2, "model/policy": 1},
        after={"agent/simple": 1, "resources/counter": 3, "model/policy": 2},
    )


def test_coordinated_checkpoint_across_both_nodes_survives_killing_every_server(
    ray_cluster: RayCluster, start_stack: Any, run_dir: Path
) -> None:
    """The control plane through the Ray launcher: participants on both nodes are checkpointed, all
    SIGKILLed (their hosts restart them), restored, and the episodes end as uninterrupted ones."""
    from gymrpc.control import EpisodeKey
    from gymrpc.controller import Controller
    from tests.control.test_process import Driver, config, outcome, restart_all

    servers = config()["servers"]
    where = {"resources/counter": WORKER_IP, "resources/blackjack": HEAD_IP, "model/policy": WORKER_IP}
    for server in servers:
        server.update(SMALL, node=where[server["name"]])
    stack = start_stack(ray_stack(ray_cluster, {**config(), "servers": servers}, run_dir))
    assert {s["name"]: s["node"] for s in stack.state()["servers"] if s["name"] in where} == where
    root = run_dir / "checkpoints"

    async def checkpoint() -> tuple[list[Any], list[Any], Path]:
        async with Client(run_dir=run_dir) as client:
            driver = Driver(client)
            reference = [outcome(t) for t in await asyncio.gather(*(driver.finish(s) for s in driver.episodes("ref")))]
            states = driver.episodes("ep")
            await asyncio.gather(*(driver.advance(s, 2 + i % 2) for i, s in enumerate(states)))
            scope = [EpisodeKey(s.rollout_id, 0) for s in states]
            result = await Controller(client).checkpoint(root, episode_ids=scope, checkpoint_id="ray-1", stop=True)
            assert result.committed
            return reference, states, result.checkpoint_dir

    reference, states, folder = asyncio.run(checkpoint())
    restart_all(stack)

    async def restore() -> list[Any]:
        async with Client(run_dir=run_dir) as client:
            controller, driver = Controller(client), Driver(client)
            await controller.restore("ray-restore", folder, [EpisodeKey(s.rollout_id, 0) for s in states])
            await controller.resume("ray-restore")
            for state in states:
                state.attempt, state.resume_count = 1, state.resume_count + 1
            return [outcome(t) for t in await asyncio.gather(*(driver.finish(s) for s in states))]

    assert asyncio.run(restore()) == reference
