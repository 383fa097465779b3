"""TLS and mTLS: a `gymrpc up --tls` stack runs, checkpoints and restores; plaintext and
certificate-less clients are turned away; plaintext on a non-loopback address refuses to start."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gymrpc import auth, tls
from gymrpc.client import Client
from gymrpc.control import EpisodeKey
from gymrpc.controller import Controller
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2
from gymrpc.v1 import resources_service_pb2 as res_pb
from gymrpc.v1 import resources_service_pb2_grpc as res_grpc
from tests.agent.fakes import counter_tasks
from tests.control.test_process import outcome

ROOT = Path(__file__).resolve().parents[2]
STACK = {
    "servers": [
        {"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}},
        # Slow tokens: episodes are still running when the checkpoint comes.
        {"name": "model/policy", "role": "model", "args": {"policy": "counter", "token_delay": 0.05}},
        {"name": "agent/counter", "role": "agent", "args": {"resources": "resources/counter", "model": "model/policy"}},
    ]
}


async def run(client: Client, rollout_id: str, task: common_pb2.Task, attempt: int = 0) -> Any:
    request = agent_pb.RunRequest(task=task, episode_id=common_pb2.EpisodeId(rollout_id=rollout_id, attempt=attempt))
    return (await client.agent("agent/counter").Run(request, timeout=120)).trajectory


def test_tls_stack_runs_episodes_checkpoints_and_restores(start_stack: Any, tmp_path: Path) -> None:
    stack = start_stack(STACK, "--tls")
    run_dir = stack.run_dir
    described = json.loads((run_dir / tls.TLS_FILE).read_text())
    assert set(described) == {"ca", "cert", "key"}
    for path in [run_dir / tls.TLS_FILE, *(run_dir / tls.TLS_DIR).iterdir()]:
        assert path.stat().st_mode & 0o777 == 0o600, path
    assert not any(p.name.startswith("ca.key") for p in (run_dir / tls.TLS_DIR).iterdir())  # the CA key is gone
    tasks = counter_tasks()[:2]
    scope = [EpisodeKey(f"tls-{i}", 0) for i in range(len(tasks))]

    async def before() -> tuple[list[Any], Path]:
        async with Client(run_dir=run_dir) as client:  # learns TLS from the run folder
            assert client.tls is not None
            reference = [outcome(t) for t in await asyncio.gather(*(run(client, f"ref-{i}", t) for i, t in
                                                                      enumerate(tasks)))]  # fmt: skip
            assert all(r[0] == 1.0 for r in reference)
            running = [asyncio.ensure_future(run(client, e.rollout_id, t)) for e, t in zip(scope, tasks, strict=True)]
            controller = Controller(client)
            await controller.discover()
            result = await controller.checkpoint(tmp_path / "ckpt", episode_ids=scope, checkpoint_id="tls-1", stop=True)
            assert result.committed
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            return reference, result.checkpoint_dir

    reference, folder = asyncio.run(before())
    stack.stop()
    stack = start_stack(STACK, "--tls")  # a fresh stack: a new CA, new certificates, nothing served yet

    async def after() -> list[Any]:
        async with Client(run_dir=run_dir) as client:
            controller = Controller(client)
            await controller.discover()
            await controller.restore("tls-restore", folder, scope)
            await controller.resume("tls-restore")
            return await asyncio.gather(*(run(client, e.rollout_id, t, attempt=1) for e, t in
                                          zip(scope, tasks, strict=True)))  # fmt: skip

    trajectories = asyncio.run(after())
    assert [outcome(t)[0] for t in trajectories] == [r[0] for r in reference]
    assert all(t.episode_id.attempt == 1 for t in trajectories)


def _address(stack: Any, name: str) -> str:
    return str(stack.server(name)["address"])


def test_plaintext_and_certificate_less_clients_are_refused(start_stack: Any, tmp_path: Path) -> None:
    stack = start_stack({"servers": STACK["servers"][:1]}, "--tls")
    address = _address(stack, "resources/counter")
    files = tls.read_run_dir_tls(stack.run_dir)
    assert files is not None
    assert files.ca is not None
    credential = auth.metadata(stack.token)
    other = tls.create_stack_pki(tmp_path / "other", ["x/y"], ["127.0.0.1"])  # a CA the stack never saw

    async def list_tools(channel: grpc.aio.Channel) -> grpc.StatusCode:
        try:
            await res_grpc.ResourcesServiceStub(channel).ListTools(
                res_pb.ListToolsRequest(), metadata=credential, timeout=5
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    ca = Path(files.ca).read_bytes()
    cert, key = Path(files.cert).read_bytes(), Path(files.key).read_bytes()  # type: ignore[arg-type]

    async def probes() -> dict[str, grpc.StatusCode]:
        wrong = tls.TlsFiles(cert=other.client.cert, key=other.client.key, ca=files.ca)
        channels = {
            "plaintext": grpc.aio.insecure_channel(address),
            "no client certificate": grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca)),
            "certificate of another CA": grpc.aio.secure_channel(address, wrong.channel_credentials()),
            "the stack's client certificate": grpc.aio.secure_channel(
                address, grpc.ssl_channel_credentials(ca, private_key=key, certificate_chain=cert)
            ),
        }
        try:
            return {label: await list_tools(channel) for label, channel in channels.items()}
        finally:
            for channel in channels.values():
                await channel.close()

    codes = asyncio.run(probes())
    assert codes == {
        "plaintext": grpc.StatusCode.UNAVAILABLE,
        "no client certificate": grpc.StatusCode.UNAVAILABLE,
        "certificate of another CA": grpc.StatusCode.UNAVAILABLE,
        "the stack's client certificate": grpc.StatusCode.OK,
    }
    assert stack.server("resources/counter")["restarts"] == 0


def _non_loopback_ipv4() -> str | None:
    """An IPv4 address of this machine that is not loopback (`ip -4 addr`), or None."""
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    for line in out.splitlines():
        address = line.split()[3].partition("/")[0]
        if not address.startswith("127."):
            return address
    return None


def _serve(bind: str, *flags: str, ready: Path) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "gymrpc.servers.resources", "--environment", "counter", "--name", "resources/counter",
            "--bind", bind, "--ready-file", str(ready), "--grace", "0", *flags]  # fmt: skip
    return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("host", ["0.0.0.0", "machine"])
def test_plaintext_on_a_non_loopback_address_refuses_to_start(host: str, tmp_path: Path) -> None:
    if host == "machine":
        found = _non_loopback_ipv4()
        if found is None:
            pytest.skip("this machine has no non-loopback IPv4 address (`ip -4 addr`); 0.0.0.0 covers the check")
        host = found
    proc = _serve(f"{host}:0", ready=tmp_path / "ready.json")
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, output
    assert f"refusing to serve plaintext on {host}:0" in output
    assert "--insecure" in output
    assert "TLS" in output
    assert not (tmp_path / "ready.json").exists()


def test_a_non_loopback_address_serves_with_tls_or_insecure(tmp_path: Path) -> None:
    host = _non_loopback_ipv4()
    if host is None:
        pytest.skip("this machine has no non-loopback IPv4 address (`ip -4 addr`)")
    pki = tls.create_stack_pki(tmp_path / "tls", ["resources/counter"], [host])
    server = pki.servers["resources/counter"]
    for label, flags, client in (
        ("tls", ["--tls-cert", server.cert, "--tls-key", server.key, "--tls-ca", server.ca], pki.client),
        ("insecure", ["--insecure"], None),
    ):
        ready = tmp_path / f"{label}.json"
        proc = _serve(f"{host}:0", *flags, ready=ready)  # type: ignore[arg-type]
        try:
            deadline = time.monotonic() + 60
            while not ready.exists():
                assert proc.poll() is None, proc.communicate()[0]
                assert time.monotonic() < deadline
                time.sleep(0.05)
            address = json.loads(ready.read_text())["address"]
            assert address.startswith(host)

            async def health(address: str = address, client: tls.TlsFiles | None = client) -> int:
                channel = (
                    grpc.aio.insecure_channel(address)
                    if client is None
                    else grpc.aio.secure_channel(address, client.channel_credentials())
                )
                async with channel:
                    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                    return reply.status

            assert asyncio.run(health()) == health_pb2.HealthCheckResponse.SERVING
        finally:
            proc.terminate()
            proc.communicate(timeout=30)


def test_generated_certificates_name_this_machine(tmp_path: Path) -> None:
    from cryptography import x509

    pki = tls.create_stack_pki(tmp_path / "tls", ["agent/a", "agent/b"], tls.local_hosts())
    assert set(pki.servers) == {"agent/a", "agent/b"}
    assert pki.servers["agent/a"].cert != pki.servers["agent/b"].cert  # one certificate per server
    cert = x509.load_pem_x509_certificate(Path(pki.servers["agent/a"].cert).read_bytes())  # type: ignore[arg-type]
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in names.get_values_for_type(x509.DNSName)
    assert socket.gethostname() in names.get_values_for_type(x509.DNSName)
    assert any(str(ip) == "127.0.0.1" for ip in names.get_values_for_type(x509.IPAddress))
