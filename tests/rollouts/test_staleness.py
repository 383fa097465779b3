"""The staleness bound: episodes whose oldest token is too many weight versions old, flagged or rerun.

A real stack (`gymrpc up`: counter resources, the scripted model, an agent). Every episode's
first model call is delivered under `scripted:0` (waited for on the model's ledger), then the
weights move three versions on while the episodes are still running, so each finishes 3
versions behind: with `max_policy_lag=1` each is stale.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import gymrpc.envs.counter
from gymrpc.client import Client
from gymrpc.rollouts import EpisodeResult, collect, load_tasks
from gymrpc.rollouts.report import Summary
from gymrpc.testing.safetensors_files import write_safetensors
from gymrpc.v1 import participant_service_pb2 as part_pb
from gymrpc.weights import policy_lag, update_weights

ROOT = Path(__file__).resolve().parents[2]
MODEL = "model/policy"
EPISODES = 4


def _config(weights: Path, token_delay: float) -> dict[str, Any]:
    model = {"policy": "counter", "weights": str(weights), "token_delay": token_delay}
    return {
        "servers": [
            {"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}},
            {"name": MODEL, "role": "model", "args": model},
            {"name": "agent/simple", "role": "agent", "args": {"resources": "resources/counter", "model": MODEL}},
        ]
    }


def _weights(root: Path, name: str) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    write_safetensors(folder / "model.safetensors", {"w": ("F32", (2, 2), None)})
    return folder


async def _ledger_rows(client: Client) -> int:
    status = await client.participant(MODEL).GetStatus(part_pb.GetStatusRequest())
    return int(status.report.counts["ledger_rows"])


async def _run(run_dir: Path, stale: str) -> list[EpisodeResult]:
    tasks = load_tasks(gymrpc.envs.counter.example_tasks_path())[:EPISODES]
    async with Client(run_dir=run_dir) as client:
        collection = asyncio.ensure_future(
            collect(client, tasks, concurrency=EPISODES, max_policy_lag=1, stale=stale, id_prefix=f"stale-{stale}")
        )
        while await _ledger_rows(client) < EPISODES:  # every episode's first call delivered under scripted:0
            assert not collection.done(), collection
            await asyncio.sleep(0.02)
        for k in (1, 2, 3):
            await update_weights(client, MODEL, weight_version=f"it:{k}", path=_weights(run_dir, f"w{k}-{stale}"))
        return await collection


@pytest.mark.parametrize("stale", ["flag", "restart"])
def test_episodes_three_versions_behind_are_flagged_or_restarted_and_counted(
    start_stack: Any, run_dir: Path, stale: str
) -> None:
    stack = start_stack(_config(_weights(run_dir, "w0"), token_delay=0.03))
    results = asyncio.run(_run(stack.run_dir, stale))
    assert len(results) == EPISODES
    assert all(r.ok and r.reward == 1.0 for r in results), [r.error for r in results]
    summary = Summary(results, 1.0, EPISODES).to_json()
    if stale == "flag":
        for r in results:
            assert (r.oldest_weight_version, r.newest_weight_version) == ("scripted:0", "it:3")
            assert (r.policy_lag, r.stale, r.stale_restarts, r.attempt) == (3, True, 0, 0)
        assert (summary["stale"], summary["stale_restarts"], summary["max_policy_lag_seen"]) == (EPISODES, 0, 3)
    else:
        for r in results:  # run again from the start as the next attempt, under it:3 only
            assert (r.oldest_weight_version, r.newest_weight_version) == ("it:3", "it:3")
            assert (r.policy_lag, r.stale, r.stale_restarts, r.attempt) == (0, False, 1, 1)
            assert r.trajectory is not None
            assert r.trajectory.episode_id.attempt == 1
        assert (summary["stale"], summary["stale_restarts"]) == (0, EPISODES)


def test_rollouts_command_reports_staleness_in_its_summary(start_stack: Any, run_dir: Path, tmp_path: Path) -> None:
    stack = start_stack(_config(_weights(run_dir, "w0"), token_delay=0.0))
    out = tmp_path / "results.jsonl"
    argv = [sys.executable, "-m", "gymrpc.cli", "rollouts", str(gymrpc.envs.counter.example_tasks_path())]
    argv += ["--run-dir", str(stack.run_dir), "--out", str(out), "--max-policy-lag", "1", "--stale", "restart"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "staleness 0 stale (flagged), 0 restarts of stale episodes; policy lag max 0" in proc.stdout


def test_policy_lag_by_number_or_by_the_servers_history() -> None:
    assert policy_lag("iteration:7", "iteration:10") == 3
    assert policy_lag("a", "c", ["a", "b", "c"]) == 2
    assert policy_lag("a", "a") == 0
    assert policy_lag("x", "c", ["a", "b", "c"]) is None
    assert policy_lag("", "c") == 0
