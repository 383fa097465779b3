"""`gymrpc rollouts --checkpoint-dir`: SIGUSR1 and SIGTERM checkpoints, a killed stack, `--resume` into a fresh one."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gymrpc.envs.counter import example_tasks_path
from gymrpc.rollouts.checkpointing import LATEST, STATE_FILE

ROOT = Path(__file__).resolve().parents[2]
COMMON = {"checkpoint_lease_grace": 5, "await_restore": True}
SERVERS = ("resources/counter", "model/policy", "agent/counter")


def config() -> dict[str, Any]:
    return {
        "restart": {"max_restarts": 5, "window_seconds": 60, "backoff_seconds": 0.05},
        "servers": [
            {"name": "resources/counter", "role": "resources", "args": {"environment": "counter", **COMMON}},
            {"name": "model/policy", "role": "model", "args": {"policy": "counter", "token_delay": 0.03, **COMMON}},
            {
                "name": "agent/counter",
                "role": "agent",
                "args": {"resources": "resources/counter", "model": "model/policy", **COMMON},
            },
        ],
    }


def argv(run_dir: Path, out: Path, ckpt: Path, prefix: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gymrpc.cli",
        "--run-dir",
        str(run_dir),
        "rollouts",
        str(example_tasks_path()),
        "--agent",
        "agent/counter",
        "--out",
        str(out),
        "--checkpoint-dir",
        str(ckpt),
        "--id-prefix",
        prefix,
        "--repeats",
        "4",
        "--concurrency",
        "8",
        "--quiet",
        *extra,
    ]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def rewards(path: Path) -> dict[tuple[int, int], float]:
    return {(x["task_index"], x["repeat"]): x["reward"] for x in lines(path)}


def wait(predicate: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_sigterm_checkpoints_and_exits_75_and_resume_continues_in_a_fresh_stack(
    start_stack: Any, tmp_path: Path
) -> None:
    stack = start_stack(config())
    ref = tmp_path / "ref.jsonl"
    done = subprocess.run(argv(stack.run_dir, ref, tmp_path / "ck-ref", "ref"), env=env(), cwd=ROOT, timeout=120)
    assert done.returncode == 0
    assert len(lines(ref)) == 20

    out, ckpt = tmp_path / "out.jsonl", tmp_path / "ck"
    proc = subprocess.Popen(
        argv(stack.run_dir, out, ckpt, "ep", "--keep-checkpoints", "2"),
        env=env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait(lambda: len(lines(out)) >= 1, "no episode finished")
    proc.send_signal(signal.SIGUSR1)  # checkpoint and continue
    wait(lambda: (ckpt / LATEST).exists(), "SIGUSR1 took no checkpoint")
    first = (ckpt / LATEST).read_text().strip()
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)  # checkpoint, stop, exit 75
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 75, stdout + stderr
    latest = (ckpt / LATEST).read_text().strip()
    assert latest != first
    state = json.loads((ckpt / latest / STATE_FILE).read_text())
    assert state["continued"]
    finished = len(lines(out))
    assert finished < 20
    assert all(x["ok"] for x in lines(out))

    before = {n: stack.server(n)["restarts"] for n in SERVERS}
    for name in SERVERS:
        stack.kill(name)
    for name in SERVERS:
        stack.wait_for(name, lambda s, n=name: s["restarts"] > before[n] and s["state"] == "serving")

    resumed = subprocess.run(
        argv(stack.run_dir, out, ckpt, "ep", "--resume"),
        env=env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    match = re.search(r"(\d+) continued, (\d+) restarted", resumed.stdout)
    assert match, resumed.stdout
    continued, restarted = int(match[1]), int(match[2])
    assert continued >= 1
    assert continued + restarted <= len(state["continued"]) + len(state["restarted"])  # some finished meanwhile
    final = lines(out)
    assert len(final) == 20
    assert all(x["ok"] for x in final)
    assert rewards(out) == rewards(ref)  # as if never interrupted
    resumed_lines = [x for x in final if x["trajectory"]["episode_id"].get("attempt", 0) == 1]
    assert sum(1 for x in resumed_lines if x["resume_count"] == 1) == continued
