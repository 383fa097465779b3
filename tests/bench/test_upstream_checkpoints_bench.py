"""Smoke test of `bench/upstream_checkpoints.py --quick`: it runs end to end and reports sane figures.

No timing assertions: throughput depends on the machine and its load.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_quick_upstream_checkpoint_bench_reports_figures(tmp_path: Path) -> None:
    out = tmp_path / "upstream.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "upstream_checkpoints.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "throughput ratio (checkpointed / baseline)" in proc.stdout
    figures = json.loads(out.read_text())
    baseline, checked = figures["baseline"], figures["checkpointed"]
    assert baseline["episodes"] == checked["episodes"] == 60
    assert baseline["mean_reward"] == checked["mean_reward"] == 1.0  # checkpoints change no episode
    assert baseline["checkpoints"] == 0
    assert checked["checkpoints"] > 0
    assert checked["continuations"] > 0  # cuts continued from their streamed tokens
    assert figures["throughput_ratio"] > 0
