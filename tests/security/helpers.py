"""Real server processes for the security probes, raw stubs, and what "nothing changed" compares.

Each probe starts the role's own `python -m gymrpc.servers.<role>` (optionally under a memory ceiling,
`RLIMIT_AS`, so a runaway read fails in the server instead of exhausting the machine), calls it
with plain generated stubs so the test sees the wire status itself, and compares the server's
state (participant status over gRPC, session snapshots, files) before and after.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from gymrpc.channels import bearer_interceptors, service_channel_options
from gymrpc.errors import DOMAIN
from gymrpc.v1 import participant_service_pb2 as pb
from gymrpc.v1 import participant_service_pb2_grpc as pb_grpc
from tests.control.deployment import TOKEN  # one token, so DirectClient and Controller reach these servers too

ROOT = Path(__file__).resolve().parents[2]
CONTROL = (("authorization", f"Bearer {TOKEN}"),)


class ServerProcess:
    """One server process started as the launcher would, on 127.0.0.1:0."""

    def __init__(
        self,
        module: str,
        name: str,
        args: Sequence[str],
        folder: Path,
        *,
        memory_limit: int | None = None,
    ) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        token = folder / "token"
        token.write_text(TOKEN)
        ready = folder / f"{name.replace('/', '_')}.ready"
        self.log_path = folder / f"{name.replace('/', '_')}.log"
        argv = [sys.executable, "-m", module, "--name", name, "--token-file", str(token), "--ready-file", str(ready)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("GYMRPC_REGISTRY", None)

        def ceiling() -> None:
            if memory_limit is not None:
                resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))

        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [*argv, *args], cwd=ROOT, env=env, stdout=log, stderr=log, preexec_fn=ceiling
            )
        deadline = time.monotonic() + 60
        while not ready.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"{module} exited:\n{self.log_path.read_text()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{module} not ready after 60 s:\n{self.log_path.read_text()}")
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        self.address: str = info["address"]
        self.pid: int = info["pid"]
        assert self.pid == self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def open_files(self) -> list[str]:
        """Where the process's file descriptors point (`/proc/<pid>/fd`)."""
        out = []
        for fd in os.listdir(f"/proc/{self.pid}/fd"):
            try:
                out.append(os.readlink(f"/proc/{self.pid}/fd/{fd}"))
            except FileNotFoundError:
                continue
        return out

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def channel(address: str) -> grpc.aio.Channel:
    """A raw channel whose calls carry the stack token unless they bring their own credential."""
    return grpc.aio.insecure_channel(
        address, options=service_channel_options(), interceptors=bearer_interceptors(TOKEN)
    )


def error_info(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    trailers: Any = error.trailing_metadata() or ()
    for key, value in trailers:
        if key == rpc_status.GRPC_DETAILS_METADATA_KEY:  # type: ignore[attr-defined]
            for detail in status_pb2.Status.FromString(value).details:
                if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    detail.Unpack(info)
                    return info
    raise AssertionError(f"{error.code().name} {error.details()!r} carries no ErrorInfo")


async def refused(call: Any, code: grpc.StatusCode, reason: str, *, says: str = "") -> grpc.aio.AioRpcError:
    """Await `call`; it must fail with `code` and an ErrorInfo `reason` of our domain whose message has `says`."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    error = caught.value
    info = error_info(error)
    assert (error.code(), info.reason, info.domain) == (code, reason, DOMAIN), (error.code(), error.details())
    assert says in (error.details() or ""), error.details()
    return error


async def healthy(address: str) -> bool:
    async with channel(address) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return reply.status == health_pb2.HealthCheckResponse.SERVING


async def participant_status(address: str) -> pb.GetStatusResponse:
    async with channel(address) as ch:
        return await pb_grpc.ParticipantServiceStub(ch).GetStatus(pb.GetStatusRequest(), timeout=10, metadata=CONTROL)


def comparable(status: pb.GetStatusResponse) -> tuple[Any, ...]:
    """What "changes nothing" compares in a participant's status (not its lease time or start)."""
    return (
        status.phase,
        status.checkpoint_id,
        dict(status.retired),
        dict(status.report.counts),
        status.report.ready,
        dict(status.details),
    )


def tree(root: Path) -> dict[str, str]:
    """Every regular file under `root` with its sha256, and every symlink with its target."""
    out = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            out[key] = "-> " + os.readlink(path)
        elif path.is_file() and path.stat().st_size < 1 << 24:
            out[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        elif path.is_file():
            out[key] = f"size {path.stat().st_size}"
    return out


RAY_JOB_PRELUDE = """
import sys, types

info = {"registry": "10.0.0.1:5000", "token": "t", "ca": "CA PEM", "client_cert": "CERT PEM",
        "client_key": "KEY PEM", "server_name": "gymrpc"}
ray = types.ModuleType("ray")
ray.is_initialized = lambda: True
ray.get_actor = lambda name, namespace: types.SimpleNamespace(info=types.SimpleNamespace(remote=lambda: "ref"))
ray.get = lambda ref, timeout: dict(info)
sys.modules["ray"] = ray

from gymrpc.launch.ray import discover_registry
"""
"""The start of a Ray job's script with a stand-in for `ray` whose registry actor serves a TLS stack's
client material: what `discover_registry` leaves on disk is tested, not Ray."""
