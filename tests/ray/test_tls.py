"""A TLS stack on the two-node local cluster: the launcher makes the certificates, every host
actor gets its own server's, servers on both nodes speak mTLS, and episodes run end to end."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from gymrpc import auth
from gymrpc.client import Client
from gymrpc.v1 import resources_service_pb2 as res_pb
from gymrpc.v1 import resources_service_pb2_grpc as res_grpc
from tests.ray import episodes
from tests.ray.conftest import WORKER_IP, RayCluster
from tests.ray.test_ray_cluster import JOB, SMALL, ray_stack
from tests.resume.helpers import POLICY

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _cluster_env(ray_cluster: RayCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in ray_cluster.ray_env().items():
        monkeypatch.setenv(key, value)


def test_a_tls_stack_spans_both_nodes(ray_cluster: RayCluster, start_stack: Any, run_dir: Path) -> None:
    config = episodes.stack(run_dir / "store", resources=2, placement=SMALL)
    config["servers"][2]["node"] = WORKER_IP
    stack = start_stack({**ray_stack(ray_cluster, config, run_dir, namespace="gymrpc"), "tls": True})  # JOB looks there
    assert (run_dir / "tls.json").exists()
    servers = {s["name"]: s for s in stack.state()["servers"]}
    assert servers["agent/simple"]["node"] == WORKER_IP
    tasks = episodes.episodes(2, "tls")

    async def scenario() -> tuple[list[Any], grpc.StatusCode]:
        async with Client(run_dir=run_dir) as client:
            trajectories = await asyncio.gather(
                *(client.run(t, episode_id=e, policy_version=POLICY, timeout=120) for e, t in tasks.items())
            )
        plain = grpc.aio.insecure_channel(servers["resources/counter#0"]["address"])
        try:
            await res_grpc.ResourcesServiceStub(plain).ListTools(
                res_pb.ListToolsRequest(), metadata=auth.metadata(stack.token), timeout=5
            )
            code = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
        finally:
            await plain.close()
        return trajectories, code

    trajectories, plaintext = asyncio.run(scenario())
    episodes.check_results(dict(zip(tasks, trajectories, strict=True)), tasks)
    assert plaintext == grpc.StatusCode.UNAVAILABLE

    # A Ray job with no run folder finds the stack, its token and its client certificate through Ray.
    job = ray_cluster.python(JOB)
    assert job.returncode == 0, job.stderr[-3000:]
    found = json.loads(job.stdout.strip().splitlines()[-1])
    registry = stack.state()["registry"]
    assert found["driver"] == [["increment_counter", "get_counter_value"], registry]
    assert found["task"] == [["increment_counter", "get_counter_value"], registry, WORKER_IP]
