"""Helpers of the real-vLLM tier (processes, an event loop thread); the fixtures are in conftest."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from gymrpc.testing.tiny_model import TOKENIZER_SUBDIR

ROOT = Path(__file__).resolve().parents[2]
ENGINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
"""No hub access, and a 1 GiB KV cache (vLLM's CPU default sizes it from free RAM)."""
ENGINE_OPTIONS: dict[str, Any] = {"dtype": "float32", "max_model_len": 2048, "kv_cache_gib": 1, "enforce_eager": True}
"""float32: bf16 is not native on the AVX2 test CPU; eager: torch.compile on CPU is slow."""
START_TIMEOUT = 900.0
"""Upper bound on an engine's start, polled for readiness: 20-40 s on a quiet CPU, and several
minutes beside two CPU burners (`scripts/test.sh --under-load`)."""
TEST_TIMEOUT = 1800
"""The tier's per-test limit (pytest-timeout), which also covers a module fixture's engine start."""

T = TypeVar("T")


# -- an event loop that outlives one test --------------------------------------------------------


class LoopThread:
    """A private event loop on a thread: `AsyncLLM` binds its output task to the first loop it
    runs in, so tests sharing one engine must share one loop (not one `asyncio.run` each)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="vllm-tests-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 180.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


# -- processes -----------------------------------------------------------------------------------


def descendants(pid: int) -> set[int]:
    """Every live descendant of `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@contextlib.contextmanager
def processes_stopped(pids: Iterable[int]) -> Iterator[None]:
    """`pids` stopped (SIGSTOP) meanwhile, continued (SIGCONT) after: frozen, not killed."""
    stopped = list(pids)
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmStack:
    """`gymrpc up` in a subprocess, waiting longer than the main suite's `Stack`: a vLLM model
    server becomes SERVING only once its engine is up (20-40 s, more on a busy machine)."""

    def __init__(self, config: dict[str, Any], timeout: float = START_TIMEOUT) -> None:
        # Unix socket paths are limited to 108 bytes: pytest's tmp_path can be longer.
        self.run_dir = Path(tempfile.mkdtemp(prefix="gymrpc-vllm-", dir="/tmp"))
        (self.run_dir / "stack.yaml").write_text(yaml.safe_dump(config))
        self.log = open(self.run_dir / "up.log", "wb")  # noqa: SIM115 - closed in stop()
        config_file = self.run_dir / "stack.yaml"
        argv = [sys.executable, "-m", "gymrpc.cli", "up", "--run-dir", str(self.run_dir), str(config_file)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=self.log, env=env, cwd=ROOT)
        try:
            self.wait_until(lambda s: s["state"] == "serving" and s["launcher_pid"] == self.process.pid, timeout)
        except BaseException:
            self.stop()
            raise

    def state(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.run_dir / "stack.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def server(self, name: str) -> dict[str, Any]:
        state = self.state()
        assert state is not None
        return next(s for s in state["servers"] if s["name"] == name)

    def wait_until(self, predicate: Any, timeout: float, name: str | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state()
            if state is not None and predicate(self.server(name) if name else state):
                return
            if self.process.poll() is not None:
                raise RuntimeError(f"gymrpc up exited:\n{self.logs()}")
            time.sleep(0.2)
        raise TimeoutError(f"the stack did not get there in {timeout:.0f} s:\n{self.logs()}")

    def logs(self) -> str:
        """The tails of the launcher's log and of every server's (`logs/`), for assertion messages."""
        logs = sorted(self.run_dir.glob("*.log")) + sorted(self.run_dir.glob("logs/*.log"))
        return "\n".join(f"== {p.relative_to(self.run_dir)}\n{p.read_text(errors='replace')[-4000:]}" for p in logs)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def model_server_args(model: Path, **extra: Any) -> dict[str, Any]:
    """Stack-config args of a `--backend vllm` model server on the CPU."""
    return {"backend": "vllm", "model_path": str(model), **ENGINE_OPTIONS, **extra}


class OpenAIServer:
    """vLLM's OpenAI-compatible server on loopback, in dev mode (`/abort_requests`).

    `python -m vllm.entrypoints.openai.api_server`: the `vllm` console script of `vllm-cpu`
    cannot find its own package metadata. Its own session, so the whole tree stops together.
    """

    def __init__(self, model: Path, log: Path, timeout: float = START_TIMEOUT, extra_args: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager", "--enable-prefix-caching",
            *extra_args,
        ]  # fmt: skip
        if (model / TOKENIZER_SUBDIR).is_dir():  # the tokenizer as the model was trained with it
            argv += ["--tokenizer", str(model / TOKENIZER_SUBDIR)]
        self.log_path = log
        self.log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, **ENGINE_ENV, "VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": str(ROOT)}  # test plug-ins
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=self.log, env=env, start_new_session=True)
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the vLLM server exited:\n{self.log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the vLLM server was not healthy in {timeout:.0f} s:\n{self.log_path.read_text()[-4000:]}")

    @contextlib.contextmanager
    def engine_stopped(self) -> Iterator[None]:
        """The engine's processes stopped (SIGSTOP), the API server still answering.

        Nothing generates meanwhile, so an abort sent now reaches a request that is still running,
        however busy the machine: the tests' way to abort "mid-generation" without a race.
        """
        engine = [pid for pid in _group_members(self.process.pid) if pid != self.process.pid]
        if not engine:
            raise RuntimeError("the vLLM server has no engine process to stop")
        with processes_stopped(engine):
            yield

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


def _group_members(group: int) -> list[int]:
    """The live processes of a process group, from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = stat.rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == group:
            members.append(int(entry.name))
    return members
