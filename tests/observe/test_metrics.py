"""Prometheus metrics of a live stack: they move with a coordinated checkpoint, a SIGKILL and a resume.

The stack runs with `metrics: true`; each server's `/metrics` is found through its registry entry
(label `metrics`), as Prometheus service discovery or `gymrpc top` would find it.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gymrpc import rundir
from gymrpc.client import Client
from gymrpc.launch.spec import parse_stack_spec
from gymrpc.registry import RegistryClient
from gymrpc.rollouts.checkpointing import LATEST
from gymrpc.servers.bootstrap import ServerConfig, ServiceBinding, start_server
from gymrpc.servers.metrics import PARTICIPANT
from gymrpc.servers.registry.service import CONTROL_METHODS, RegistryServicer
from gymrpc.v1 import registry_service_pb2 as registry_pb
from gymrpc.v1 import registry_service_pb2_grpc as registry_grpc
from tests.resume.helpers import POLICY, agent, stack, task
from tests.rollouts.test_checkpointing import ROOT, SERVERS, argv, config, env, lines, wait

MORE = ("--repeats", "8")
"""40 episodes, so the run is still going when the test stops it."""


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a metrics page: (name, sorted labels) -> value."""
    text = httpx.get(url, timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def settled(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A page whose store counters two scrapes agree on: a store's commit thread goes on after it acknowledges
    a batch (zeroes ahead, compacts) and bumps its counters one statement at a time, so a scrape taken
    meanwhile can see `fsyncs` counted and `zero_ahead_syncs` not yet."""
    previous: dict = {}
    for _ in range(200):
        page = scrape(url)
        store = {k: v for k, v in page.items() if k[0].startswith("gymrpc_store_")}
        if store == previous:
            return page
        previous = store
        time.sleep(0.05)
    raise AssertionError(f"the store counters of {url} never stopped moving")


def total(samples: dict, metric: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == metric and all((k, w) in ls for k, w in labels.items()))


def metrics_urls(run_dir: Path) -> dict[str, str]:
    async def go() -> dict[str, str]:
        address = (run_dir / "registry.addr").read_text().strip()
        async with RegistryClient(address) as client:
            return {e.name: e.labels["metrics"] for e in await client.list()}

    return asyncio.run(go())


def top(run_dir: Path) -> str:
    """One frame of `gymrpc top`, as a user runs it."""
    command = [sys.executable, "-m", "gymrpc.cli", "--run-dir", str(run_dir), "top", "--once", "--interval", "0.2"]
    done = subprocess.run(command, env=env(), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_documented_stack_serves_metrics_from_every_server() -> None:
    block = re.search(r"```yaml\n(.*?)```", (ROOT / "docs" / "metrics.md").read_text(), re.DOTALL)
    assert block is not None
    spec = parse_stack_spec(yaml.safe_load(block[1]), "docs/metrics.md")
    assert spec.metrics
    assert all(s.args["metrics_port"] == 0 for s in spec.servers)
    assert "--metrics-port" in spec.servers[0].argv()


def test_metrics_must_be_a_boolean() -> None:
    with pytest.raises(ValueError, match="metrics must be true or false"):
        parse_stack_spec({"metrics": "yes", "servers": [{"name": "model/policy", "role": "model"}]})


def test_every_call_is_counted_by_code_and_reason_and_the_page_goes_with_the_server() -> None:
    asyncio.run(_count_calls())


async def _count_calls() -> None:
    config = ServerConfig(name="registry/main", bind="127.0.0.1:0", token="t0ken", metrics_port=0)
    binding = ServiceBinding(
        registry_pb.DESCRIPTOR.services_by_name["RegistryService"],
        RegistryServicer(),
        registry_grpc.add_RegistryServiceServicer_to_server,
        CONTROL_METHODS,
    )
    server = await start_server(config, [binding])
    assert server.metrics_url is not None
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = registry_grpc.RegistryServiceStub(channel)
            await stub.ListEndpoints(registry_pb.ListEndpointsRequest())
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Register(registry_pb.RegisterRequest(name="model/x", address="127.0.0.1:1"))
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        samples = await asyncio.to_thread(scrape, server.metrics_url)
        listed = "/gymrpc.v1.RegistryService/ListEndpoints"
        register = "/gymrpc.v1.RegistryService/Register"
        assert total(samples, "gymrpc_rpc_calls_total", method=listed, code="OK") == 1
        assert total(samples, "gymrpc_rpc_calls_total", method=register, code="UNAUTHENTICATED") == 1
        assert total(samples, "gymrpc_rpc_errors_total", method=register, reason="UNAUTHENTICATED") == 1
        assert total(samples, "gymrpc_rpc_duration_seconds_count", method=listed) == 1
        assert total(samples, "gymrpc_rpc_inflight", method=listed) == 0
        assert total(samples, "process_cpu_seconds_total") > 0
    finally:
        await server.stop(0)
    with pytest.raises(httpx.HTTPError):
        await asyncio.to_thread(httpx.get, server.metrics_url, timeout=5)


@pytest.mark.slow
def test_counters_move_through_a_checkpoint_a_sigkill_and_a_resume(start_stack: Any, tmp_path: Path) -> None:
    stack = start_stack({**config(), "metrics": True})
    urls = metrics_urls(stack.run_dir)
    assert set(SERVERS) <= set(urls)

    out, ckpt = tmp_path / "out.jsonl", tmp_path / "ck"
    proc = subprocess.Popen(argv(stack.run_dir, out, ckpt, "ep", *MORE), env=env(), cwd=ROOT, text=True)
    wait(lambda: len(lines(out)) >= 1, "no episode finished")
    proc.send_signal(signal.SIGUSR1)  # a coordinated checkpoint; the run goes on
    wait(lambda: (ckpt / LATEST).exists(), "SIGUSR1 took no checkpoint")
    for name in SERVERS:
        samples = scrape(urls[name])
        assert total(samples, "gymrpc_rpc_duration_seconds_count", method=PARTICIPANT + "Prepare") >= 1, name
        assert total(samples, "gymrpc_rpc_duration_seconds_count", method=PARTICIPANT + "Commit") >= 1, name
        assert total(samples, "gymrpc_checkpoint_written_bytes_total") > 0, name
        assert total(samples, "gymrpc_checkpoint_last_commit_timestamp_seconds") > 0, name
    proc.send_signal(signal.SIGTERM)  # checkpoint, stop, exit 75 (the rollout is still running)
    model = scrape(urls["model/policy"])
    assert total(model, "gymrpc_model_completion_tokens_total") > 0
    assert total(model, "gymrpc_model_weight_version_info") == 1
    assert proc.wait(timeout=60) == 75
    before = {n: stack.server(n)["restarts"] for n in SERVERS}
    for name in SERVERS:
        stack.kill(name)
    for name in SERVERS:
        stack.wait_for(name, lambda s, n=name: s["restarts"] > before[n] and s["state"] == "serving")
    resume = argv(stack.run_dir, out, ckpt, "ep", "--resume", *MORE)
    resumed = subprocess.run(resume, env=env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    continued = int(re.search(r"(\d+) continued", resumed.stdout)[1])  # type: ignore[index]
    assert continued >= 1

    urls = metrics_urls(stack.run_dir)  # the restarted servers serve their metrics on new ports
    agent = scrape(urls["agent/counter"])
    assert total(agent, "gymrpc_episodes_resumed_total") == continued
    assert total(agent, "gymrpc_episodes_inflight") == 0
    for name in SERVERS:
        assert total(scrape(urls[name]), "gymrpc_rpc_duration_seconds_count", method=PARTICIPANT + "Restore") == 1, name
    registry = scrape(json.loads(rundir.registry_ready(stack.run_dir).read_text())["metrics"])
    for name in SERVERS:
        assert total(registry, "gymrpc_registry_registrations_total", name=name) >= 2, name  # started, restarted

    frame = top(stack.run_dir)
    rows = {line.split()[0]: line.split() for line in frame.splitlines()[2:]}
    assert set(rows) == {"registry/main", *SERVERS}, frame
    assert all(row[1] == "serving" for row in rows.values()), frame
    assert int(rows["agent/counter"][4]) >= continued, frame  # finished episodes, from its metrics


def test_the_durable_episode_store_reports_its_writes_and_fsyncs(start_stack: Any, run_dir: Path) -> None:
    """An agent with `resume_dir`: its records, group commits and fsyncs are counters on its page (and one
    with `--resume-zero-ahead 0` writes no zeros ahead of its log)."""
    plain = agent("agent/plain", run_dir / "plain-episodes", resume_zero_ahead=0)
    config = {**stack(agent("agent/durable", run_dir / "episodes"), plain), "metrics": True}
    start_stack(config)

    async def episodes() -> list[Any]:
        async with Client(run_dir=run_dir) as client:
            return await asyncio.gather(
                *(
                    client.run(task(i), episode_id=f"m-{i}", policy_version=POLICY, agent="agent/durable")
                    for i in range(3)
                ),
                client.run(task(3), episode_id="m-plain", policy_version=POLICY, agent="agent/plain"),
            )

    assert [t.reward for t in asyncio.run(episodes())] == [1.0] * 4
    page = settled(metrics_urls(run_dir)["agent/durable"])
    records = total(page, "gymrpc_store_records_written_total")
    assert records >= 3 * 3  # each episode has at least three durable boundaries
    assert total(page, "gymrpc_store_full_frames_total") + total(page, "gymrpc_store_delta_frames_total") == records
    assert total(page, "gymrpc_store_delta_frames_total") > 0  # later boundaries store only what changed
    assert 1 <= total(page, "gymrpc_store_group_commits_total") <= records
    assert total(page, "gymrpc_store_fsyncs_total") >= total(page, "gymrpc_store_group_commits_total")
    assert total(page, "gymrpc_store_written_bytes_total") > 0
    assert total(page, "gymrpc_store_failed_writes_total") == 0
    assert ("gymrpc_store_full_commit_delays_total", ()) in page, "the commit delay's counter is exported"
    assert total(page, "gymrpc_store_full_commit_delays_total") <= total(page, "gymrpc_store_group_commits_total")
    zero_syncs = total(page, "gymrpc_store_zero_ahead_syncs_total")
    assert zero_syncs >= 1, "the log keeps zeros written ahead of its end"
    assert total(page, "gymrpc_store_fsyncs_total") == total(page, "gymrpc_store_group_commits_total") + zero_syncs
    plain_page = scrape(metrics_urls(run_dir)["agent/plain"])
    assert total(plain_page, "gymrpc_store_records_written_total") >= 3
    assert total(plain_page, "gymrpc_store_zero_ahead_syncs_total") == 0, "--resume-zero-ahead 0: none"
    assert "gymrpc_store_fsyncs_total" not in {n for n, _ in scrape(metrics_urls(run_dir)["model/policy"])}
    # The session snapshots came in the replies of SeedSession and CallTool (`snapshot_in_replies`).
    resources = scrape(metrics_urls(run_dir)["resources/counter"])
    calls = "gymrpc_rpc_duration_seconds_count"
    assert total(resources, calls, method="/gymrpc.v1.ResourcesService/CallTool") >= 3
    assert total(resources, calls, method="/gymrpc.v1.ResourcesService/CheckpointSession") == 0
    frame = top(run_dir)
    rows = {line.split()[0]: line for line in frame.splitlines()[2:]}
    assert "durable, 0 saves/s" in rows["agent/durable"], frame  # its own store, idle once the runs ended
    assert "durable" not in rows["model/policy"], frame
