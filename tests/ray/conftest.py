"""A two-node Ray cluster on this machine for the Ray launcher tests, stopped by process group.

The head node gets `127.0.0.2` and resource `head`, the worker node `127.0.0.3` and resource
`worker`: two loopback addresses, so servers really bind and advertise per-node addresses and all
traffic stays on loopback. Each `ray start` runs in a session of its own; its daemons (and the
workers and servers under them) keep that process group, which teardown signals. Nothing is
stopped by name: other Ray instances on the machine are left alone.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"
RAY = Path(sys.executable).with_name("ray")
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token"}
"""Token auth with a token of the cluster's own (in `RAY_AUTH_TOKEN`): nothing is read from or written
to `~/.ray`, and only this test session can join or drive the cluster."""


@dataclass
class RayCluster:
    address: str
    temp_dir: Path
    groups: list[int] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def ray_env(self) -> dict[str, str]:
        """What a process needs in its environment to drive this cluster."""
        return {k: v for k, v in self.env.items() if k.startswith("RAY_")}

    def python(self, script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run `script` as a Ray driver on this cluster (in the cluster's folder, away from any run folder)."""
        return subprocess.run(
            [sys.executable, "-c", script, self.address, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
            cwd=self.temp_dir,
        )


def _free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return int(s.getsockname()[1])


def _start_node(cluster: RayCluster, *args: str) -> None:
    proc = subprocess.Popen(
        [str(RAY), "start", "--disable-usage-stats", "--temp-dir", str(cluster.temp_dir), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=cluster.env,
        cwd=cluster.temp_dir,
        start_new_session=True,  # the daemons it leaves behind keep this process group
    )
    cluster.groups.append(proc.pid)
    output, _ = proc.communicate(timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"ray start {' '.join(args)} failed:\n{output}")


def _stop_group(pgid: int, timeout: float = 5.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
        while time.monotonic() < deadline + timeout:  # until the kernel has reaped the group
            os.killpg(pgid, 0)
            time.sleep(0.1)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    pytest.importorskip("ray")
    started = time.monotonic()
    temp_dir = Path(tempfile.mkdtemp(prefix="gr-", dir="/tmp"))  # short: Ray's unix sockets live here
    env = {**os.environ, **RAY_ENV, "RAY_AUTH_TOKEN": secrets.token_hex(32), "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    cluster = RayCluster(address="", temp_dir=temp_dir, env=env)
    try:
        _start_node(
            cluster,
            "--head",
            "--node-ip-address",
            HEAD_IP,
            "--port",
            "0",
            "--ray-client-server-port",
            str(_free_port(HEAD_IP)),
            "--dashboard-agent-listen-port",
            str(_free_port(HEAD_IP)),
            "--include-dashboard=false",
            "--num-cpus",
            "2",
            "--resources",
            '{"head": 1}',
        )
        cluster.address = (temp_dir / "ray_current_cluster").read_text().strip()
        _start_node(
            cluster,
            "--address",
            cluster.address,
            "--node-ip-address",
            WORKER_IP,
            "--dashboard-agent-listen-port",
            str(_free_port(WORKER_IP)),
            "--num-cpus",
            "2",
            "--resources",
            '{"worker": 1}',
        )
        print(f"\nray cluster {cluster.address} up in {time.monotonic() - started:.1f}s", file=sys.stderr)
        yield cluster
    finally:
        for pgid in reversed(cluster.groups):
            _stop_group(pgid)
        shutil.rmtree(temp_dir, ignore_errors=True)
