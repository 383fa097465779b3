"""Smoke test of `bench/durable_cpu.py --quick`: every mode runs real episodes end to end and the split of
what durable resume adds is reported. No timing assertions."""

from __future__ import annotations

from pathlib import Path

import pytest

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
        assert results[mode]["commit_ms"] >= 0
    assert results["on"]["commit_ms"] > 0, "the one store whose commit thread writes: its CPU is counted"
    assert "of which the commit thread's own CPU" in out
    assert "durable resume adds" in out
    assert "RATIO on / off" in out


@pytest.mark.parametrize("mode", ["on", "off"])
def test_one_mode_alone_runs_only_that_mode(tmp_path: Path, mode: str) -> None:
    """`--only` (the run counted under callgrind): that mode's figures and no other's; the boundaries per
    episode only where they were counted (the `on` store's saves), never a 0 for a mode that saved nothing."""
    args = ["--dir", str(tmp_path), "--only", mode]
    out, figures = run_quick("durable_cpu.py", tmp_path, timeout=300, args=args, env=without_pythonpath())
    if mode == "on":
        assert set(figures["results"]) == {"boundaries_per_episode", "on"}
        assert figures["results"]["boundaries_per_episode"] == 8.0
    else:
        assert set(figures["results"]) == {mode}
    assert figures["results"][mode]["cpu_ms"] > 0
    assert out.splitlines()[-1].startswith(f"{mode}: ")
