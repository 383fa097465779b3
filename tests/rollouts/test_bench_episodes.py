"""Smoke tests of `bench/episodes.py --quick` (counter levels; workplace A/B modes): they run end to end and print.

No timing assertions: the figures depend on the machine and its load.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.bench.quick import run_quick, without_pythonpath

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for CPU time"),
]


def test_quick_episode_bench_prints_a_row_per_level(tmp_path: Path) -> None:
    # run in tmp_path: the bench must not depend on the working directory
    stdout, figures = run_quick("episodes.py", tmp_path, timeout=240, cwd=tmp_path, env=without_pythonpath())
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["concurrency", "episodes"])
    rows = [line.split() for line in lines[header + 1 :] if line.strip()]
    assert [row[0] for row in rows] == ["1", "8", "32"]
    for row in rows:
        assert len(row) == 11
        assert int(row[1]) >= 40
        assert float(row[2]) > 0
        assert float(row[5]) == 1.0
    levels = figures["levels"]
    assert set(levels) == {"1", "8", "32"}
    for level in levels.values():
        median = level["median"]
        assert median["episodes_per_s"] > 0
        assert 0 < median["p50_ms"] <= median["p95_ms"]
        assert set(median["cpu_ms_per_episode"]) == {"agent", "model", "resources", "registry", "client"}


def _run_workplace(tmp_path: Path, *mode: str) -> tuple[list[str], dict]:
    """`bench/episodes.py --env workplace --quick <mode>`: its summary lines (after the blank line) and JSON."""
    args = ["--env", "workplace", *mode]
    stdout, figures = run_quick("episodes.py", tmp_path, timeout=240, args=args, cwd=tmp_path, env=without_pythonpath())
    lines = stdout.splitlines()
    return lines[lines.index("") + 1 :], figures


def _check_side(side: dict, rounds: int = 1) -> None:
    assert side["episodes"] == 16 * rounds
    assert side["episodes_per_s"] > 0
    assert len(side["rounds"]) == rounds
    assert 0 < side["mean_reward"] <= 1


def test_quick_workplace_incremental_comparison_prints_model_cpu_per_side_and_the_ratio(tmp_path: Path) -> None:
    summary, figures = _run_workplace(tmp_path, "--compare", "incremental")
    assert [line.split()[0] for line in summary[1:3]] == ["full", "incremental"]
    assert summary[-1].startswith("RATIO model-server CPU per episode, full / incremental: ")
    sides = figures["sides"]
    for name in ("full", "incremental"):
        _check_side(sides[name])
        assert sides[name]["model_cpu_ms_per_episode"] > 0
    assert (
        sides["ratio"] == sides["full"]["model_cpu_ms_per_episode"] / sides["incremental"]["model_cpu_ms_per_episode"]
    )
    assert figures["meta"]["concurrency"] == 16
    assert figures["meta"]["mode"] == "incremental"


def test_quick_workplace_checkpoint_comparison_prints_episodes_per_s_per_side_and_parked_time(tmp_path: Path) -> None:
    summary, figures = _run_workplace(tmp_path, "--checkpoint-every", "0.2")
    assert [line.split()[0] for line in summary[1:3]] == ["none", "checkpoints"]
    assert summary[3].startswith("checkpoints every 0.2 s: ")
    assert summary[-1].startswith("RATIO episodes/s, checkpoints / none: ")
    sides = figures["sides"]
    for name in ("none", "checkpoints"):
        _check_side(sides[name])
    checkpoints = sides["checkpoints"]
    assert "checkpoints" not in sides["none"]["rounds"][0]
    logged = checkpoints["rounds"][0]["checkpoints"]
    assert checkpoints["taken"] == len(logged)
    assert checkpoints["committed"] == sum(1 for c in logged if c["committed"])
    if checkpoints["committed"]:  # how many fit in a round depends on the machine: the structure does not
        assert 0 < checkpoints["parked_ms"]["median"] <= checkpoints["parked_ms"]["max"]
        assert 0 < checkpoints["parked_share"] < 1
        assert checkpoints["episodes_per_checkpoint"] >= 0
    else:
        assert checkpoints["parked_ms"] is None
    assert sides["ratio"] == checkpoints["episodes_per_s"] / sides["none"]["episodes_per_s"]
    assert figures["meta"]["checkpoint_every"] == 0.2
