"""Fixtures shared by the whole suite: short run folders and real stacks started with `gymrpc up`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def run_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 108 bytes: pytest's tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="gymrpc-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Stack:
    """A stack started by `gymrpc up` in a subprocess, as a user would start it."""

    def __init__(self, run_dir: Path, config: dict | None, flags: tuple[str, ...] = ()) -> None:
        self.run_dir = run_dir
        argv = [sys.executable, "-m", "gymrpc.cli", "up", "--run-dir", str(run_dir), *flags]
        if config is not None:
            path = run_dir / "stack.yaml"
            path.write_text(yaml.safe_dump(config))
            argv.append(str(path))
        self.log = open(run_dir / "up.log", "wb")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=self.log, env=env, cwd=ROOT)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            state = self.state()
            if state and state["state"] == "serving" and state["launcher_pid"] == self.process.pid:
                return
            if self.process.poll() is not None:
                raise RuntimeError(f"gymrpc up failed:\n{(run_dir / 'up.log').read_text()}")
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"stack not serving after 90 s:\n{(run_dir / 'up.log').read_text()}")

    @property
    def token(self) -> str:
        """The stack token: raw stubs send it (every data-plane call needs a credential)."""
        return (self.run_dir / "token").read_text().strip()

    def state(self) -> dict | None:
        try:
            return json.loads((self.run_dir / "stack.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def server(self, name: str) -> dict:
        state = self.state()
        assert state is not None
        return next(s for s in state["servers"] if s["name"] == name)

    def wait_for(self, name: str, predicate, timeout: float = 30.0) -> dict:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            server = self.server(name)
            if predicate(server):
                return server
            time.sleep(0.05)
        raise AssertionError(f"{name} never reached the expected state: {self.server(name)}")

    def kill(self, name: str) -> int:
        pid = self.server(name)["pid"]
        os.kill(pid, signal.SIGKILL)
        return pid

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()


@pytest.fixture
def start_stack(run_dir: Path) -> Iterator:  # type: ignore[type-arg]
    """`start_stack(config_dict_or_None, *up_flags)` → a serving `Stack`, stopped after the test."""
    stacks: list[Stack] = []

    def start(config: dict | None = None, *flags: str) -> Stack:
        stack = Stack(run_dir, config, flags)
        stacks.append(stack)
        return stack

    yield start
    for stack in stacks:
        stack.stop()
