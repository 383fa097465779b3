"""The collector and `gymrpc rollouts` against real stacks started with `gymrpc up`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import gymrpc.envs.counter
from gymrpc.client import Client
from gymrpc.rollouts import EpisodeResult, collect, load_tasks

ROOT = Path(__file__).resolve().parents[2]
COUNTER_TASKS = gymrpc.envs.counter.example_tasks_path()


def _config(**model_args: Any) -> dict[str, Any]:
    return {
        "servers": [
            {"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}},
            {"name": "model/policy", "role": "model", "args": {"policy": "counter", **model_args}},
            {
                "name": "agent/simple",
                "role": "agent",
                "args": {"resources": "resources/counter", "model": "model/policy"},
            },
        ]
    }


def test_collect_runs_every_task_and_repeat_within_the_concurrency(start_stack: Any) -> None:
    stack = start_stack(_config())
    tasks = load_tasks(COUNTER_TASKS)
    running, peak, seen = 0, 0, []

    def on_start(*_: object) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)

    async def on_result(result: EpisodeResult) -> None:  # async callbacks are awaited
        nonlocal running
        running -= 1
        seen.append(result.episode_id)

    async def main() -> list[EpisodeResult]:
        async with Client(run_dir=stack.run_dir) as client:
            return await collect(
                client, tasks, agent="agent/simple", concurrency=4, repeats=3, on_start=on_start, on_result=on_result
            )

    results = asyncio.run(main())
    assert len(results) == 15
    assert all(r.ok and r.reward == 1.0 for r in results), [r.error for r in results if not r.ok]
    assert seen == [r.episode_id for r in results]  # reported in finishing order, each once
    assert sorted(seen) == sorted(f"example-t{t}-r{r}" for t in range(5) for r in range(3))
    assert peak == 4
    assert {r.trajectory.episode_id.rollout_id for r in results if r.trajectory} == set(seen)

    async def bare() -> list[list[str]]:  # a trainer's own Task protos: fresh ids per call unless a prefix is given
        async with Client(run_dir=stack.run_dir) as client:
            protos = [t.task for t in tasks[:2]]
            calls = [collect(client, protos, agent="agent/simple") for _ in range(2)]
            calls.append(collect(client, protos, agent="agent/simple", id_prefix="step7"))
            return [sorted(r.episode_id for r in rs if r.reward == 1.0) for rs in await asyncio.gather(*calls)]

    first, second, named = asyncio.run(bare())
    assert len(first) == len(second) == 2
    assert first[0].startswith("rollout-")
    assert first[0].endswith("-t0-r0")
    assert not set(first) & set(second)
    assert named == ["step7-t0-r0", "step7-t1-r0"]


def test_a_rerun_check_runs_an_episode_again_as_its_next_attempt_a_bounded_number_of_times(start_stack: Any) -> None:
    stack = start_stack(_config())
    tasks = load_tasks(COUNTER_TASKS)[:3]
    asked: list[tuple[str, int]] = []

    async def rerun(result: EpisodeResult) -> bool:  # async checks are awaited
        asked.append((result.episode_id, result.attempt))
        assert result.trajectory is not None
        assert result.trajectory.episode_id.attempt == result.attempt
        return result.episode_id != "example-t0-r0"

    async def main() -> list[EpisodeResult]:
        async with Client(run_dir=stack.run_dir) as client:
            with pytest.raises(ValueError, match="max_reruns"):
                await collect(client, tasks, rerun=rerun, max_reruns=-1)
            return await collect(client, tasks, agent="agent/simple", rerun=rerun, max_reruns=2)

    results = {r.episode_id: r for r in asyncio.run(main())}
    assert all(r.ok and r.reward == 1.0 for r in results.values())
    assert (results["example-t0-r0"].reruns, results["example-t0-r0"].attempt) == (0, 0)
    for other in ("example-t1-r0", "example-t2-r0"):  # asked after attempts 0 and 1; the last try is reported
        last = results[other]
        assert (last.reruns, last.attempt, last.trajectory.episode_id.attempt) == (2, 2, 2)
        assert [a for e, a in asked if e == other] == [0, 1]
    assert [a for e, a in asked if e == "example-t0-r0"] == [0]


def test_cli_reports_a_failing_episode_and_exits_non_zero(start_stack: Any, tmp_path: Path) -> None:
    stack = start_stack(_config())
    rows = COUNTER_TASKS.read_text().splitlines()
    broken = json.loads(rows[1])
    del broken["expected_count"]
    tasks = tmp_path / "mixed.jsonl"
    tasks.write_text("\n".join([rows[0], json.dumps(broken), rows[2]]) + "\n")
    out = tmp_path / "out.jsonl"

    proc = _cli(stack.run_dir, "rollouts", str(tasks), "--agent", "agent/simple", "--out", str(out), "--repeats", "2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 6
    bad = [x for x in lines if not x["ok"]]
    assert sorted(x["episode_id"] for x in bad) == ["mixed-t1-r0", "mixed-t1-r1"]
    for x in bad:
        assert x["reward"] is None
        assert x["error"]["code"] == "INVALID_ARGUMENT"
        assert "expected_count" in x["error"]["message"]
    for x in lines:
        if x["ok"]:
            assert x["reward"] == 1.0
            assert x["steps"] == 3
            assert x["stop_reason"] == "final_answer"
            assert x["tokens"]["output"] > 0
            assert x["timings"]["latency_s"] > 0
            assert (x["resume_count"], x["restart_count"]) == (0, 0)
            assert x["trajectory"]["episode_id"]["rollout_id"] == x["episode_id"]
    assert "6 of 6 finished: 4 ok, 2 failed" in proc.stdout
    assert "mixed-t1-r0  INVALID_ARGUMENT" in proc.stdout
    assert "p50" in proc.stdout
    assert "p95" in proc.stdout

    again = _cli(stack.run_dir, "rollouts", str(tasks), "--agent", "agent/simple", "--out", str(out))
    assert again.returncode == 2
    assert "--resume" in again.stderr
    wrong = _cli(stack.run_dir, "rollouts", str(tasks), "--agent", "agent/nope", "--out", str(tmp_path / "x.jsonl"))
    assert wrong.returncode == 2
    assert "agent/nope" in wrong.stderr
    assert "registered agents: agent/simple" in wrong.stderr
    assert not (tmp_path / "x.jsonl").exists()


def test_lines_appear_as_episodes_finish_and_ctrl_c_keeps_them(start_stack: Any, tmp_path: Path) -> None:
    # ~0.4 s per episode (3 model calls of ~13 tokens, 10 ms apart), one at a time.
    stack = start_stack(_config(token_delay=0.01))
    out = tmp_path / "out.jsonl"
    argv = ["rollouts", str(COUNTER_TASKS), "--agent", "agent/simple", "--out", str(out)]
    # Started as a non-interactive shell starts a background job: with SIGINT ignored.
    proc = _spawn(stack.run_dir, *argv, "--concurrency", "1", "--repeats", "4", ignore_sigint=True)
    counts = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        counts.append(len(out.read_text().splitlines()) if out.exists() else 0)
        if counts[-1] >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    assert 1 in counts
    assert 2 in counts
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stdout + stderr
    assert "--resume" in stderr
    assert "(interrupted)" in stdout
    kept = [json.loads(x) for x in out.read_text().splitlines()]
    assert 3 <= len(kept) < 20
    assert all(x["ok"] for x in kept)

    resumed = _cli(stack.run_dir, *argv, "--concurrency", "8", "--repeats", "4", "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"({len(kept)} skipped" in resumed.stdout
    final = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(x["episode_id"] for x in final) == sorted(f"example-t{t}-r{r}" for t in range(5) for r in range(4))
    assert all(x["reward"] == 1.0 for x in final)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _cli(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "gymrpc.cli", "--run-dir", str(run_dir), *args, "--quiet"]
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=120)


def _spawn(run_dir: Path, *args: str, ignore_sigint: bool = False) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "gymrpc.cli", "--run-dir", str(run_dir), *args]
    preexec = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=_env(), preexec_fn=preexec
    )
