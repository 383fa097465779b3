"""Smoke test of `bench/durable_cpu.py --quick`: every mode runs real episodes end to end and the split of
what durable resume adds is reported. No timing assertions."""

from __future__ import annotations

from pathlib import Path

from tests.bench.quick import run_quick, without_pythonpath


def test_quick_durable_cpu_bench_reports_every_mode_and_the_split(tmp_path: Path) -> None:
    out, figures = run_quick(
        "durable_cpu.py", tmp_path, timeout=300, args=["--dir", str(tmp_path)], env=without_pythonpath()
    )
    results = figures["results"]
    assert results["boundaries_per_episode"] == 8.0  # a counter episode: seed, 3 model calls, 3 tool calls, done
    for mode in ("off", "on", "no-writes", "no-commit"):
        assert results[mode]["cpu_ms"] > 0
        assert results[mode]["main_ms"] > 0
    assert "durable resume adds" in out
    assert "RATIO on / off" in out


def test_one_mode_alone_runs_only_that_mode(tmp_path: Path) -> None:
    """`--only` (the run counted under callgrind): that mode's figures and no other's."""
    out, figures = run_quick(
        "durable_cpu.py", tmp_path, timeout=300, args=["--dir", str(tmp_path), "--only", "on"], env=without_pythonpath()
    )
    assert set(figures["results"]) == {"boundaries_per_episode", "on"}
    assert figures["results"]["boundaries_per_episode"] == 8.0
    assert figures["results"]["on"]["cpu_ms"] > 0
    assert out.splitlines()[-1].startswith("on: ")
