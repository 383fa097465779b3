"""Shared pieces of the resume tests: stack configs, tasks, and views of the store on disk."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
from pathlib import Path
from typing import Any

from gymrpc.store import read_record
from gymrpc.store.base import EpisodeCheckpoint
from gymrpc.v1 import common_pb2
from tests.agent.fakes import counter_tasks

POLICY = "iteration:7"
MODEL_SCRIPTED = {"backend": "scripted", "policy": "counter"}


def task(i: int) -> common_pb2.Task:
    """Counter example task `i % 5` (the real model solves each: increments in one turn, a read, an answer)."""
    return counter_tasks()[i % 5]


def expected_count(t: common_pb2.Task) -> int:
    return int(json.loads(t.env_json)["expected_count"])


def agent(name: str, resume_dir: Path | None, *, env: dict[str, str] | None = None, **args: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": name,
        "role": "agent",
        "args": {"resources": "resources/counter", "model": "model/policy", "max_steps": 8, **args},
    }
    if resume_dir is not None:
        spec["args"]["resume_dir"] = str(resume_dir)
    if env:
        spec["env"] = env
    return spec


def stack(*servers: dict[str, Any], model_log: Path | None = None, **model_args: Any) -> dict[str, Any]:
    """resources/counter, model/policy (the real scripted model; its calls logged to `model_log`), then `servers`."""
    model: dict[str, Any] = {"name": "model/policy", "role": "model", "args": {**MODEL_SCRIPTED, **model_args}}
    if model_log is not None:
        model.update(role="tests.resume.counting_model", env={"GYMRPC_TEST_MODEL_LOG": str(model_log)})
    return {
        "restart": {"max_restarts": 5, "window_seconds": 60, "backoff_seconds": 0.05},
        "servers": [
            {"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}},
            model,
            *servers,
        ],
    }


def crash_env(at: str, marker: Path) -> dict[str, str]:
    return {"GYMRPC_CRASH_AT": at, "GYMRPC_CRASH_MARKER": str(marker)}


def files(root: Path) -> dict[str, bytes]:
    """Every file under `root` (lock files excluded: empty, and left by design) with its bytes."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.suffix != ".lock"
    }


def record_path(root: Path, rollout_id: str) -> Path:
    key = hashlib.sha256(rollout_id.encode()).hexdigest()
    return root / "episodes" / key[:2] / f"{key}.ckpt"


def record(root: Path, rollout_id: str) -> EpisodeCheckpoint | None:
    """The episode's record in a store folder of either store (read while the agent may be writing)."""
    return read_record(root, rollout_id)


def kill_all(stack: Any) -> None:
    """SIGKILL the launcher and every server at once: a power cut, not a shutdown."""
    state = stack.state()
    pids = [state["launcher_pid"], *(s["pid"] for s in state["servers"] if s["pid"])]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    stack.process.wait(timeout=10)
    stack.log.close()
