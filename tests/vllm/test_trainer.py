"""The reference trainer (`gymrpc train run`) on real vLLM: it learns, and it survives losing everything.

One stack (one engine) serves the first test and is then killed, every process of it with
SIGKILL together with the trainer, mid-iteration; the resumed run continues on a fresh stack.
The start policy is `gymrpc train init`'s deliberately weak one, built once per module.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.vllm.helpers import ROOT, START_TIMEOUT, TEST_TIMEOUT, VllmStack, alive, descendants

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(TEST_TIMEOUT),
]

TARGET = 0.9
START = 0.3
"""The start's mean reward is at most this (its recipe aims at 0.16)."""


DOC = ROOT / "docs" / "training.md"
BLOCK = re.compile(r"<!-- run: trainer-(\w+) -->\n```\w*\n(.*?)\n```", re.DOTALL)
WORK = "/tmp/grpo"
"""The folder the doc's commands use; the tests put a temporary one in its place."""


def doc_blocks() -> dict[str, str]:
    """docs/training.md's worked example: init, stack, run, resume (the tests run these)."""
    found = dict(BLOCK.findall(DOC.read_text()))
    assert sorted(found) == ["init", "resume", "run", "stack"]
    return found


def command(kind: str, work: Path, run_dir: Path | None = None) -> list[str]:
    """A documented `gymrpc ...` command as argv for this interpreter, in `work` instead of /tmp/grpo."""
    argv = shlex.split(doc_blocks()[kind].replace(WORK, str(work)))
    assert argv[0] == "gymrpc"
    argv = [sys.executable, "-m", "gymrpc.cli", *argv[1:]]
    if run_dir is not None:
        argv[argv.index("--run-dir") + 1] = str(run_dir)
    return argv


def stack_config(work: Path) -> dict[str, Any]:
    config = yaml.safe_load(doc_blocks()["stack"].replace(WORK, str(work)))
    config["restart"] = {"max_restarts": 5, "window_seconds": 60, "backoff_seconds": 0.05}
    for server in config["servers"]:  # the doc's 300 s is for a quiet machine; CI may be busy
        if "start_timeout" in server:
            server["start_timeout"] = max(server["start_timeout"], START_TIMEOUT)
    return config


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The doc's /tmp/grpo, with the weak start built by the doc's `gymrpc train init`."""
    work = tmp_path_factory.mktemp("grpo")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        command("init", work), cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return work


@pytest.fixture(scope="module")
def stack(work: Path) -> Iterator[VllmStack]:
    started = VllmStack(stack_config(work))
    yield started
    started.stop()


def metrics(out: Path) -> list[dict[str, str]]:
    with open(out / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def batches(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "batches.jsonl").read_text().splitlines()]


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def assert_each_episode_once(out: Path, group_size: int, tasks: int = 1) -> None:
    """Every trained batch holds each of its tasks x group episodes exactly once."""
    for batch in batches(out):
        ids = [e["episode_id"] for e in batch["episodes"]] + batch["failed"]
        assert len(ids) == len(set(ids)) == tasks * group_size, batch["iteration"]
        expected = {f"-i{batch['iteration']}-t{t}-r{m}" for t in batch["tasks"] for m in range(group_size)}
        assert {i[i.index("-i") :] for i in ids} == expected


def test_the_trainer_learns_the_counter_from_a_weak_start(stack: VllmStack, work: Path) -> None:
    """The doc's `train run` (without its checkpoints) from the weak start to the target."""
    argv = command("run", work, stack.run_dir)
    argv[argv.index("--out") + 1] = str(work / "plain")
    argv = argv[: argv.index("--checkpoint-every")]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr + stack.logs()
    out = work / "plain"
    rows = metrics(out)
    assert float(rows[0]["reward"]) <= START, rows[0]
    assert float(rows[-1]["reward"]) >= TARGET
    assert len(rows) <= int(option(argv, "--iterations"))
    assert [int(r["iteration"]) for r in rows] == list(range(len(rows)))
    assert max(int(r["max_lag"]) for r in rows) <= 1
    assert any(int(r["max_lag"]) == 1 for r in rows)  # the next batch really ran while weights were pushed
    assert_each_episode_once(out, int(option(argv, "--group-size")))
    assert (out / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert proc.stdout.count("iter ") == len(rows)


def kill_everything(trainer: subprocess.Popen[str], stack: VllmStack) -> None:
    """SIGKILL the trainer, the launcher and every server (and the engine) at once; wait until all are gone."""
    victims = [trainer.pid, stack.process.pid, *descendants(stack.process.pid)]
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    trainer.wait(timeout=60)
    stack.process.wait(timeout=60)
    deadline = time.monotonic() + 60
    while any(alive(p) for p in victims) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in victims if alive(p)]


def test_sigkill_of_trainer_and_stack_mid_iteration_then_resume_on_a_fresh_stack(stack: VllmStack, work: Path) -> None:
    """The doc's `train run`, SIGKILLed with every server after its first checkpoint, then its `--resume`."""
    out = work / "out"
    trainer = subprocess.Popen(
        command("run", work, stack.run_dir), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen: list[str] = []
    assert trainer.stdout is not None
    for line in trainer.stdout:  # events: the trainer's own lines
        seen.append(line)
        # The first iteration trained after a joint checkpoint: the batch after it is running now.
        # (With 64 episodes a batch on a CPU the checkpointed batch has usually finished by then.)
        if line.startswith("iter ") and any(s.startswith("checkpoint ") for s in seen):
            break
    else:
        pytest.fail("the trainer ended before a checkpoint and an iteration after it:\n" + "".join(seen))
    kill_everything(trainer, stack)
    checkpointed = next(s for s in seen if s.startswith("checkpoint "))
    iteration = int(checkpointed.split("iteration ")[1].split(",")[0])
    assert len(metrics(out)) == iteration + 1  # one iteration past the checkpoint was trained

    fresh = VllmStack(stack_config(work))
    try:
        argv = command("resume", work, fresh.run_dir)
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False)
        print("".join(seen) + proc.stdout)
        assert proc.returncode == 0, proc.stdout + proc.stderr + fresh.logs()
    finally:
        fresh.stop()
    assert f"resumed from {checkpointed.split()[1].rstrip(':')}: iteration {iteration}," in proc.stdout
    rows = metrics(out)
    assert [int(r["iteration"]) for r in rows] == list(range(len(rows)))  # the iteration after it was redone
    assert float(rows[-1]["reward"]) >= TARGET
    assert_each_episode_once(out, int(option(argv, "--group-size")))
    resumed = batches(out)[iteration]
    continued = int(checkpointed.split("weights ")[1].split(", ")[1].split()[0])
    attempts = [e["attempt"] for e in resumed["episodes"]]
    # In flight at the checkpoint: continued (or restarted) as attempt 1; finished before it: attempt 0.
    assert attempts.count(1) >= continued, (checkpointed, resumed)
