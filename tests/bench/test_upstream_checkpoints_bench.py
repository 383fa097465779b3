"""Smoke test of `bench/upstream_checkpoints.py --quick`: it runs end to end and reports sane figures.

No timing assertions: throughput depends on the machine and its load.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.quick import run_quick

pytestmark = pytest.mark.slow


def test_quick_upstream_checkpoint_bench_reports_figures(tmp_path: Path) -> None:
    stdout, figures = run_quick("upstream_checkpoints.py", tmp_path, timeout=600)
    assert "throughput ratio (checkpointed / baseline)" in stdout
    baseline, checked = figures["baseline"], figures["checkpointed"]
    assert baseline["episodes"] == checked["episodes"] == 60
    assert baseline["mean_reward"] == checked["mean_reward"] == 1.0  # checkpoints change no episode
    assert baseline["checkpoints"] == 0
    assert checked["checkpoints"] > 0
    assert checked["continuations"] > 0  # cuts continued from their streamed tokens
    assert figures["throughput_ratio"] > 0
